"""The scripted model server over real HTTP on 127.0.0.1: matching, statelessness, log, broken outputs, SSE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tether_modelserver import (
    ModelServer,
    ScenarioError,
    ScenarioSet,
    bundled_scenarios_dir,
    demo_scenario_path,
    load_scenarios,
    parse_scenario,
    read_request_log,
)
from tether_security import wrap_untrusted

HERE = Path(__file__).parent
SCENARIOS = [HERE / "scenarios", bundled_scenarios_dir()]


@pytest.fixture
def server(tmp_path: Path):
    with ModelServer(load_scenarios(SCENARIOS), request_log=tmp_path / "requests.jsonl") as s:
        yield s


def chat(server: ModelServer, messages: list[dict[str, Any]], headers: dict[str, str] | None = None, **extra: Any):
    body = {"model": "tether-scripted", "messages": messages, **extra}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, headers=headers or {}, timeout=10)


def user(goal: str) -> dict[str, Any]:
    return {"role": "user", "content": goal}


def assistant_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# -- scenario files ------------------------------------------------------------------------


def test_scenario_validation_rejects_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError):
        parse_scenario({"name": "x", "match": {"default": True}, "turns": []})
    with pytest.raises(ScenarioError):
        parse_scenario({"name": "x", "match": {}, "turns": [{"text": "a"}]})
    with pytest.raises(ScenarioError):
        parse_scenario(
            {
                "name": "x",
                "match": {"default": True},
                "turns": [{"tool_calls": [{"name": "t", "arguments": {}, "arguments_raw": "{"}]}],
            }
        )
    with pytest.raises(ScenarioError):
        parse_scenario({"name": "x", "match": {"goal_regex": "("}, "turns": [{"text": "a"}]})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ScenarioError):
        load_scenarios([tmp_path])
    one = {"name": "dup", "match": {"default": True}, "turns": [{"text": "a"}]}
    with pytest.raises(ScenarioError):
        ScenarioSet([parse_scenario(one), parse_scenario(one)])


def test_specific_scenarios_win_over_the_default() -> None:
    scenarios = load_scenarios(SCENARIOS)
    assert scenarios.select("please [scenario:parallel] now").name == "parallel"
    assert scenarios.select("flaky goal").name == "flaky"
    assert scenarios.select("not flaky").name == "demo"  # regex is anchored
    assert scenarios.select("anything else").name == "demo"
    no_default = ScenarioSet(
        [parse_scenario({"name": "a", "match": {"goal_contains": "A"}, "turns": [{"text": "x"}]})]
    )
    assert no_default.select("B") is None


def test_no_matching_scenario_is_a_400(tmp_path: Path) -> None:
    only = ScenarioSet([parse_scenario({"name": "a", "match": {"goal_contains": "A"}, "turns": [{"text": "x"}]})])
    with ModelServer(only) as s:
        r = chat(s, [user("B")])
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "no_matching_scenario"


# -- turns, statelessness --------------------------------------------------------------------


def test_turn_index_comes_from_the_request_and_replays_are_identical(server: ModelServer) -> None:
    goal = "Summarise the news"
    first = chat(server, [user(goal)])
    again = chat(server, [user(goal)])
    assert first.status_code == 200
    assert first.content == again.content
    call = first.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "http_get"

    second = chat(server, [user(goal), assistant_call(call["id"], "http_get", call["function"]["arguments"]), tool(call["id"], "page")])
    msg = second.json()["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"]["name"] == "kv_put"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"key": "demo/last-goal", "value": goal}

    # A compaction summary that stands for two earlier assistant turns moves the index by two.
    compacted = chat(
        server,
        [
            user(goal),
            user("[tether:compacted assistant_turns=2 tool_results=2] earlier work summarised"),
        ],
    )
    assert compacted.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "send_email"


def test_exhausted_scenario_is_an_error_unless_it_repeats(server: ModelServer) -> None:
    goal = "[scenario:parallel]"
    history = [user(goal), assistant_call("a", "http_get", "{}"), tool("a", "x"), {"role": "assistant", "content": "Both done."}]
    r = chat(server, history)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "scenario_exhausted"

    demo_history = [user("g")]
    for i in range(5):
        demo_history += [assistant_call(f"c{i}", "http_get", "{}"), tool(f"c{i}", "r")]
    r = chat(server, demo_history)
    assert r.status_code == 200
    assert "Summary for the goal \"g\"" in r.json()["choices"][0]["message"]["content"]


def test_demo_makes_three_builtin_tool_calls_then_summarises_the_goal() -> None:
    demo = load_scenarios([demo_scenario_path()])
    goal = "Find out what example.com is"
    with ModelServer(demo) as s:
        history = [user(goal)]
        names = []
        for i in range(3):
            msg = chat(s, history).json()["choices"][0]["message"]
            call = msg["tool_calls"][0]
            names.append(call["function"]["name"])
            args = json.loads(call["function"]["arguments"])
            history += [assistant_call(call["id"], call["function"]["name"], call["function"]["arguments"]), tool(call["id"], f"result {i}")]
            assert isinstance(args, dict)
        final = chat(s, history).json()["choices"][0]
    assert names == ["http_get", "kv_put", "send_email"]
    assert final["finish_reason"] == "stop"
    assert goal in final["message"]["content"]
    assert "result 2" in final["message"]["content"]


def test_demo_fetches_the_url_the_goal_names() -> None:
    demo = load_scenarios([demo_scenario_path()])
    with ModelServer(demo) as s:
        named = chat(s, [user("Check the status page at http://127.0.0.1:8090/service-status, then report.")])
        unnamed = chat(s, [user("Check the status page")])
    url = json.loads(named.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["url"]
    fallback = json.loads(unnamed.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["url"]
    assert url == "http://127.0.0.1:8090/service-status"
    assert fallback == "https://example.com/"


def test_demo_tool_arguments_fit_the_builtin_tools() -> None:
    scenario = load_scenarios([demo_scenario_path()]).select("x")
    args = [t.tool_calls[0].arguments for t in scenario.turns[:3]]
    assert set(args[0]) == {"url"}
    assert set(args[1]) == {"key", "value"}
    assert set(args[2]) == {"to", "subject", "body"}


# -- broken outputs and errors ------------------------------------------------------------------


def test_broken_outputs_are_sent_as_scripted(server: ModelServer) -> None:
    goal = "[scenario:broken]"
    r0 = chat(server, [user(goal)]).json()["choices"][0]["message"]["tool_calls"][0]
    assert r0["function"]["arguments"] == '{"key": "a", "value": '
    with pytest.raises(json.JSONDecodeError):
        json.loads(r0["function"]["arguments"])
    history = [user(goal), assistant_call(r0["id"], "kv_put", r0["function"]["arguments"]), tool(r0["id"], "bad")]
    r1 = chat(server, history).json()["choices"][0]["message"]["tool_calls"][0]
    assert r1["function"]["name"] == "no_such_tool"
    history += [assistant_call(r1["id"], "no_such_tool", "{}"), tool(r1["id"], "unknown")]
    r2 = chat(server, history).json()["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(r2["function"]["arguments"]) == {"url": 42}
    history += [
        assistant_call(r2["id"], "http_get", '{"url": 42}'),
        tool(r2["id"], json.dumps({"error": {"code": "INVALID_ARGS"}})),
    ]
    final = chat(server, history).json()["choices"][0]["message"]["content"]
    assert final.startswith("done after 3 results; last from http_get: ")
    assert final.endswith("/ INVALID_ARGS")


def test_templates_read_into_a_tool_result_in_the_data_envelope() -> None:
    scenario = parse_scenario({"name": "env", "match": {"default": True}, "turns": [
        {"tool_calls": [{"name": "http_get", "arguments": {"url": "u"}}]},
        {"text": "{{last_tool_result.status}} {{last_tool_result.source}}: {{last_tool_result.content.error.code}}"},
    ]})
    result = wrap_untrusted(json.dumps({"error": {"code": "TIMEOUT"}}), source="http_get", call_id="1.0",
                            status="failed")
    with ModelServer(ScenarioSet([scenario])) as s:
        history = [user("g"), assistant_call("c1", "http_get", '{"url": "u"}'), tool("c1", result.text)]
        final = chat(s, history).json()["choices"][0]["message"]["content"]
    assert final == "failed http_get: TIMEOUT"


def test_scripted_errors_answer_by_attempt_with_retry_after(server: ModelServer) -> None:
    msgs = [user("flaky goal")]
    r1 = chat(server, msgs, headers={"X-Tether-Attempt": "1"})
    assert r1.status_code == 429
    assert r1.headers["retry-after"] == "0.5"
    assert r1.json()["error"]["code"] == "rate_limit_exceeded"
    r2 = chat(server, msgs, headers={"X-Tether-Attempt": "2"})
    assert r2.status_code == 503
    r3 = chat(server, msgs, headers={"X-Tether-Attempt": "3"})
    assert r3.status_code == 200
    assert r3.json()["usage"] == {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}
    # No attempt header means attempt 1: the same request gets the same answer.
    assert chat(server, msgs).status_code == 429


def test_simulated_context_window(server: ModelServer) -> None:
    r = chat(server, [user("[scenario:parallel] " + "x" * 500)])
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_template_variable_is_a_500(server: ModelServer) -> None:
    r = chat(server, [user("[scenario:bad-template]")])
    assert r.status_code == 500
    assert "nope" in r.json()["error"]["message"]


def test_malformed_request_is_a_400_and_still_logged(server: ModelServer, tmp_path: Path) -> None:
    r = httpx.post(f"{server.base_url}/chat/completions", content=b"{nope", timeout=10)
    assert r.status_code == 400
    records = read_request_log(tmp_path / "requests.jsonl")
    assert records[-1]["status"] == 400
    assert records[-1]["body"] == "{nope"


# -- request log --------------------------------------------------------------------------------


def test_every_request_is_logged_with_run_step_scenario_turn_and_body(server: ModelServer, tmp_path: Path) -> None:
    headers = {"X-Tether-Run": "run-1", "X-Tether-Step": "3", "Authorization": "Bearer sk-secret-value"}
    chat(server, [user("flaky goal")], headers=headers)
    chat(server, [user("[scenario:parallel]")], headers={**headers, "X-Tether-Attempt": "1"})
    records = read_request_log(tmp_path / "requests.jsonl")
    assert records == server.requests()
    assert [r["scenario"] for r in records] == ["flaky", "parallel"]
    assert [r["status"] for r in records] == [429, 200]
    assert records[1]["headers"]["x-tether-run"] == "run-1"
    assert records[1]["headers"]["x-tether-step"] == "3"
    assert records[1]["turn"] == 0
    assert records[1]["body"]["messages"] == [user("[scenario:parallel]")]
    assert records[1]["auth"] == "bearer"
    assert "sk-secret-value" not in (tmp_path / "requests.jsonl").read_text()


def test_models_endpoint(server: ModelServer) -> None:
    r = httpx.get(f"{server.base_url}/models", timeout=10)
    assert "tether-scripted" in [m["id"] for m in r.json()["data"]]


# -- streaming ------------------------------------------------------------------------------------


def _openai_stream(server: ModelServer, messages: list[dict[str, Any]], headers: dict[str, str]) -> tuple[dict, list[dict]]:
    body = {"model": "m", "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    text, calls, finish, usage, done = "", {}, None, None, False
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, headers=headers, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            chunks.append(chunk)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                text += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                    slot["id"] = tc.get("id") or slot["id"]
                    fn = tc.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
                finish = choice["finish_reason"] or finish
    assert done
    return {"text": text, "calls": [calls[i] for i in sorted(calls)], "finish": finish, "usage": usage}, chunks


def test_openai_streaming_reassembles_to_the_non_streamed_answer(server: ModelServer) -> None:
    msgs = [user("[scenario:parallel]")]
    headers = {"X-Tether-Run": "r9"}
    streamed, chunks = _openai_stream(server, msgs, headers)
    plain = chat(server, msgs, headers=headers).json()
    message = plain["choices"][0]["message"]
    assert len(chunks) > 4  # really split into pieces
    assert streamed["text"] == message["content"]
    assert streamed["calls"] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]
    ]
    assert streamed["calls"][0]["id"] == "call_fixed"
    assert json.loads(streamed["calls"][0]["arguments"]) == {"url": "https://example.com/r9"}
    assert streamed["finish"] == "tool_calls"
    assert streamed["usage"] == plain["usage"]
    assert server.requests()[0]["stream"] is True


def test_openai_streaming_carries_broken_arguments_verbatim(server: ModelServer) -> None:
    streamed, _ = _openai_stream(server, [user("[scenario:broken]")], {})
    assert streamed["calls"][0]["arguments"] == '{"key": "a", "value": '


def test_anthropic_messages_plain_and_streamed(server: ModelServer) -> None:
    body = {"model": "claude-x", "max_tokens": 100, "system": "be brief", "messages": [user("[scenario:parallel]")]}
    headers = {"x-api-key": "sk-ant-secret", "anthropic-version": "2023-06-01"}
    plain = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=10).json()
    assert plain["stop_reason"] == "tool_use"
    assert [b["type"] for b in plain["content"]] == ["text", "tool_use", "tool_use"]
    assert plain["content"][2]["input"] == {"key": "k", "value": "[scenario:parallel]"}

    blocks: dict[int, dict[str, Any]] = {}
    stop_reason = None
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True}, headers=headers, timeout=10) as r:
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == event
                if event == "content_block_start":
                    blocks[data["index"]] = {**data["content_block"], "partial": ""}
                elif event == "content_block_delta":
                    d = data["delta"]
                    if d["type"] == "text_delta":
                        blocks[data["index"]]["text"] += d["text"]
                    else:
                        blocks[data["index"]]["partial"] += d["partial_json"]
                elif event == "message_delta":
                    stop_reason = data["delta"]["stop_reason"]
    assert stop_reason == "tool_use"
    assert blocks[0]["text"] == plain["content"][0]["text"]
    assert json.loads(blocks[2]["partial"]) == plain["content"][2]["input"]
    rec = server.requests()[-1]
    assert rec["api"] == "anthropic" and rec["auth"] == "x-api-key"
    assert rec["headers"]["anthropic-version"] == "2023-06-01"

    # The next turn, with the tool results as tool_result blocks.
    follow = {
        **body,
        "messages": [
            user("[scenario:parallel]"),
            {"role": "assistant", "content": plain["content"]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": plain["content"][1]["id"], "content": "a"},
                    {"type": "tool_result", "tool_use_id": plain["content"][2]["id"], "content": [{"type": "text", "text": "b"}]},
                ],
            },
        ],
    }
    final = httpx.post(f"{server.url}/v1/messages", json=follow, headers=headers, timeout=10).json()
    assert final["content"] == [{"type": "text", "text": "Both done."}]
    assert final["stop_reason"] == "end_turn"


def test_anthropic_errors_use_its_error_shape(server: ModelServer) -> None:
    body = {"model": "c", "max_tokens": 10, "messages": [user("flaky goal")]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=10)
    assert r.status_code == 429
    assert r.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}


# -- the command line ---------------------------------------------------------------------------


def test_cli_serves_the_scenarios_and_logs_requests(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    log = tmp_path / "req.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether_modelserver", "--port", "0", "--port-file", str(port_file), "--request-log", str(log)],
        stdout=subprocess.PIPE,
        env={**os.environ},
    )
    try:
        for _ in range(600):  # 30 s: a Python start on a loaded machine
            if port_file.exists() and port_file.read_text():
                break
            if proc.poll() is not None:
                pytest.fail("model server exited")
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port_file.read_text()}/v1"
        r = httpx.post(f"{base}/chat/completions", json={"model": "m", "messages": [user("hello")]}, timeout=10)
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "http_get"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    assert read_request_log(log)[0]["scenario"] == "demo"


def test_connections_are_kept_alive_like_a_real_providers(server: ModelServer) -> None:
    """One connection serves a client's successive calls, an unknown route's body included
    (an unread body would be taken for the next request)."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    body = json.dumps({"model": "tether-scripted", "messages": [user("hello")]})
    answers = []
    sockets = []
    try:
        for path in (f"{url.path}/chat/completions", f"{url.path}/no-such-route", f"{url.path}/chat/completions"):
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            answers.append((response.status, response.will_close))
            json.loads(response.read())
            sockets.append(conn.sock)
    finally:
        conn.close()
    assert answers == [(200, False), (404, False), (200, False)]
    assert sockets[0] is not None and all(s is sockets[0] for s in sockets), "a new connection per request"
