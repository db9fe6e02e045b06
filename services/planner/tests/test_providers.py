"""Provider adapters: wire formats, SSE accumulation, Retry-After, timeouts and connection errors (real sockets)."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tether_planner.domain.messages import ChatMessage, ToolCallRef, ToolView
from tether_planner.providers.anthropic import AnthropicProvider, to_wire_messages as anthropic_messages
from tether_planner.providers.http import HttpSettings, RetryPolicy, is_context_overflow, iter_sse, parse_retry_after
from tether_planner.providers.openai import OpenAIChatProvider, to_wire_messages as openai_messages
from tether_planner.providers.port import (
    ContextOverflow,
    MalformedResponse,
    ModelRequest,
    ProviderError,
    ProviderTimeout,
)

TOOL = ToolView(name="http_get", description="GET a URL", args_schema_json='{"type":"object"}')


def _request(goal: str, **kw) -> ModelRequest:
    values = dict(
        model="tether-scripted",
        system="sys",
        messages=(ChatMessage(role="user", content=goal),),
        tools=(TOOL,),
        max_tokens=100,
        run_id="r1",
        step=1,
    )
    values.update(kw)
    return ModelRequest(**values)


FAST = RetryPolicy(max_attempts=2, backoff_initial_s=0.01, backoff_max_s=0.02)


# -- HTTP helpers -----------------------------------------------------------------------------


def test_retry_after_forms() -> None:
    assert parse_retry_after(httpx.Headers({"retry-after": "2.5"})) == 2.5
    assert parse_retry_after(httpx.Headers({"retry-after-ms": "150", "retry-after": "9"})) == 0.15
    now = datetime(2025, 1, 1, tzinfo=UTC)
    date = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(httpx.Headers({"retry-after": date}), now=now.timestamp()) == 30
    assert parse_retry_after(httpx.Headers({"retry-after": "soon"})) is None
    assert parse_retry_after(httpx.Headers({})) is None


def test_sse_framing() -> None:
    lines = [": comment", "event: a", "data: {\"x\":", "data: 1}", "", "data: [DONE]", ""]
    assert list(iter_sse(iter(lines))) == [("a", '{"x":\n1}'), (None, "[DONE]")]


def test_context_overflow_wording() -> None:
    assert is_context_overflow(400, "This model's maximum context length is 8192 tokens")
    assert is_context_overflow(400, "prompt is too long: 210000 tokens > 200000 maximum")
    assert is_context_overflow(400, "the request exceeds the available context size, try increasing it")
    assert not is_context_overflow(429, "too many tokens per minute")
    assert not is_context_overflow(400, "invalid tool schema")


# -- wire formats ------------------------------------------------------------------------------------


def _conversation() -> list[ChatMessage]:
    return [
        ChatMessage(role="user", content="goal"),
        ChatMessage(role="user", content="[tether:compacted assistant_turns=1 tool_results=1]\nsummary"),
        ChatMessage(
            role="assistant",
            content="",
            tool_calls=(ToolCallRef(id="t1", name="http_get", arguments='{"url": '),),
            repair=True,
        ),
        ChatMessage(role="tool", content="bad json", tool_call_id="t1", repair=True),
        ChatMessage(
            role="assistant",
            content="again",
            tool_calls=(
                ToolCallRef(id="t2", name="http_get", arguments='{"url":"u"}', call_id="1.0"),
                ToolCallRef(id="t3", name="http_get", arguments='{"url":"v"}', call_id="1.1"),
            ),
        ),
        ChatMessage(role="tool", content="r2", tool_call_id="t2"),
        ChatMessage(role="tool", content="r3", tool_call_id="t3"),
        ChatMessage(role="system", content="Platform note (loop detection): stop repeating"),
    ]


def test_openai_wire_messages() -> None:
    wire = openai_messages("sys", _conversation())
    assert [m["role"] for m in wire] == ["system", "user", "user", "assistant", "tool", "assistant", "tool", "tool", "system"]
    assert wire[3]["content"] is None
    assert wire[3]["tool_calls"][0]["function"]["arguments"] == '{"url": '
    assert wire[6] == {"role": "tool", "tool_call_id": "t2", "content": "r2"}


def test_anthropic_wire_messages_alternate_and_put_results_first() -> None:
    wire = anthropic_messages(_conversation())
    assert [m["role"] for m in wire] == ["user", "assistant", "user", "assistant", "user"]
    assert [b["type"] for b in wire[0]["content"]] == ["text", "text"]
    assert wire[1]["content"] == [{"type": "tool_use", "id": "t1", "name": "http_get", "input": {"_unparsed_arguments": '{"url": '}}]
    assert wire[2]["content"] == [{"type": "tool_result", "tool_use_id": "t1", "content": "bad json", "is_error": True}]
    assert [b["type"] for b in wire[3]["content"]] == ["text", "tool_use", "tool_use"]
    assert [b["type"] for b in wire[4]["content"]] == ["tool_result", "tool_result", "text"]
    assert wire[4]["content"][2]["text"].startswith("Platform note")


def test_openai_max_tokens_parameter() -> None:
    official = OpenAIChatProvider(HttpSettings("https://api.openai.com/v1"))
    local = OpenAIChatProvider(HttpSettings("http://127.0.0.1:11434/v1"))
    try:
        assert official.body(_request("g"))["max_completion_tokens"] == 100
        body = local.body(_request("g", stream=True))
        assert body["max_tokens"] == 100 and body["stream_options"] == {"include_usage": True}
        assert body["tools"][0]["function"]["parameters"] == {"type": "object"}
    finally:
        official.close()
        local.close()


# -- stream accumulation -------------------------------------------------------------------------


def _data(obj) -> tuple[None, str]:
    return None, json.dumps(obj)


def test_openai_stream_accumulates_content_and_tool_call_deltas() -> None:
    p = OpenAIChatProvider(HttpSettings("http://x"))
    events = [
        _data({"choices": [{"delta": {"role": "assistant", "content": "Hel"}}]}),
        _data({"choices": [{"delta": {"content": "lo"}}]}),
        _data({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c0", "function": {"name": "http_", "arguments": ""}}]}}]}),
        _data({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "get", "arguments": '{"url"'}}]}}]}),
        _data({"choices": [{"delta": {"tool_calls": [{"index": 1, "function": {"name": "kv_put", "arguments": {"key": "k"}}}]}}]}),
        _data({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ': "u"}'}}]}}]}),
        _data({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
        _data({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}, "model": "m-1"}),
        (None, "[DONE]"),
    ]
    text, calls, (finish, _raw), tin, tout, model = p._parse_stream(iter(events), _request("g"))
    p.close()
    assert text == "Hello"
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("c0", "http_get", '{"url": "u"}'),
        ("call_1_0_1", "kv_put", '{"key": "k"}'),
    ]
    assert (finish, tin, tout, model) == ("tool_calls", 7, 3, "m-1")


def test_openai_stream_errors() -> None:
    p = OpenAIChatProvider(HttpSettings("http://x"))
    with pytest.raises(ProviderError) as cut:
        p._parse_stream(iter([_data({"choices": [{"delta": {"content": "a"}}]})]), _request("g"))
    assert cut.value.retryable
    with pytest.raises(ContextOverflow):
        p._parse_stream(iter([_data({"error": {"message": "maximum context length is 10"}})]), _request("g"))
    p.close()


def test_anthropic_stream_accumulates_blocks() -> None:
    p = AnthropicProvider(HttpSettings("http://x"))
    events = [
        _data({"type": "message_start", "message": {"model": "claude-x", "usage": {"input_tokens": 10, "cache_read_input_tokens": 5, "output_tokens": 1}}}),
        _data({"type": "ping"}),
        _data({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        _data({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}}),
        _data({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "tu1", "name": "http_get", "input": {}}}),
        _data({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"url":'}}),
        _data({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": ' "u"}'}}),
        _data({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "tu2", "name": "noargs", "input": {}}}),
        _data({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 12}}),
        _data({"type": "message_stop"}),
    ]
    text, calls, (finish, _raw), tin, tout, model = p._parse_stream(iter(events))
    assert text == "Hi"
    assert [(c.id, c.name, c.arguments) for c in calls] == [("tu1", "http_get", '{"url": "u"}'), ("tu2", "noargs", "{}")]
    assert (finish, tin, tout, model) == ("tool_calls", 15, 12, "claude-x")
    with pytest.raises(ProviderError) as overloaded:
        p._parse_stream(iter([_data({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})]))
    assert overloaded.value.retryable
    p.close()


# -- real sockets ----------------------------------------------------------------------------------


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_connection_refused_is_retried_then_a_provider_error() -> None:
    p = OpenAIChatProvider(HttpSettings(f"http://127.0.0.1:{_closed_port()}/v1", retry=FAST))
    with pytest.raises(ProviderError) as err:
        p.complete(_request("g"))
    p.close()
    assert err.value.code == "PROVIDER_ERROR" and err.value.attempts == 2
    assert "ConnectError" in err.value.detail


def test_a_key_in_an_error_body_is_scrubbed_before_the_body_is_cut() -> None:
    # A provider's 401 quotes the key it was sent, in a body that is not JSON, starting 20 characters
    # before where the error text used to be cut (500): those 20 characters matched no scrubbing rule.
    key = "vllm-Qm7vT2kLx9pR4sW8yZ1bN6cD3fG5hJ0a"

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            sent = self.headers.get("Authorization", "").removeprefix("Bearer ")
            body = ("e" * 479 + " " + sent + " is not a valid key").encode()
            self.send_response(401)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    p = OpenAIChatProvider(HttpSettings(f"http://127.0.0.1:{server.server_port}/v1", api_key=key, retry=FAST))
    try:
        with pytest.raises(ProviderError) as err:
            p.complete(_request("g"))
    finally:
        p.close()
        server.shutdown()
        server.server_close()
    detail = err.value.detail
    assert not any(key[i:i + 8] in detail for i in range(len(key) - 7)), detail
    assert detail.startswith("HTTP 401: eee") and "[redacted]" in detail


def test_a_slow_model_is_a_timeout(model_server) -> None:
    p = OpenAIChatProvider(HttpSettings(model_server.base_url, read_timeout_s=0.2, retry=FAST))
    with pytest.raises(ProviderTimeout) as err:
        p.complete(_request("[t:slow]"))
    p.close()
    assert err.value.code == "TIMEOUT" and err.value.attempts == 2
    assert [r["headers"]["x-tether-attempt"] for r in model_server.requests()] == ["1", "2"]


def test_anthropic_plain_response_and_malformed_input(model_server) -> None:
    p = AnthropicProvider(HttpSettings(model_server.url + "/v1", api_key="k-123456", retry=FAST))
    response = p.complete(_request("[t:broken]", model="claude-x"))
    p.close()
    # The stand-in sends the broken arguments as a raw string input; the adapter passes them on unparsed.
    assert response.tool_calls[0].arguments == '{"url": '
    assert response.finish_reason == "tool_calls"
    assert model_server.requests()[0]["path"] == "/v1/messages"


class _Dripping(BaseHTTPRequestHandler):
    """A provider that answers 200 and then keeps the answer alive: an SSE ping (or a body byte)
    every 0.1 s for 30 s — each read well within any read timeout, the whole never ending."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        stream = self.server.stream  # type: ignore[attr-defined]  # set by the test
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if stream else "application/json")
        self.end_headers()
        ends = time.monotonic() + 30
        try:
            while time.monotonic() < ends:
                self.wfile.write(b": ping\n\n" if stream else b" ")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:  # the client gave up
            pass

    def log_message(self, *args) -> None:
        pass


class _Huge(BaseHTTPRequestHandler):
    """A provider whose JSON answer never stops growing (2 MB+ of one string)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        try:
            self.wfile.write(b'{"choices": [{"message": {"content": "')
            for _ in range(64):
                self.wfile.write(b"x" * 65536)
            self.wfile.write(b'"}}]}')
        except OSError:
            pass

    def log_message(self, *args) -> None:
        pass


def _serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_an_answer_kept_alive_for_ever_ends_at_the_call_timeout(stream: bool) -> None:
    # read_timeout_s bounds each read only: a byte or an SSE ping every 0.1 s kept the work thread for ever.
    server = _serve(_Dripping)
    server.stream = stream
    p = OpenAIChatProvider(HttpSettings(f"http://127.0.0.1:{server.server_port}/v1", read_timeout_s=5,
                                        call_timeout_s=1.0, retry=FAST))
    started = time.monotonic()
    try:
        with pytest.raises(ProviderTimeout) as err:
            p.complete(_request("g", stream=stream))
    finally:
        p.close()
        server.shutdown()
        server.server_close()
    assert time.monotonic() - started < 10  # the 1 s call timeout (loose: a loaded machine), not the server's 30 s
    assert err.value.code == "TIMEOUT" and err.value.attempts == 1 and "call_timeout_s" in err.value.detail


def test_an_answer_past_the_size_limit_is_malformed() -> None:
    server = _serve(_Huge)
    p = OpenAIChatProvider(HttpSettings(f"http://127.0.0.1:{server.server_port}/v1", max_response_bytes=1024 * 1024,
                                        retry=FAST))
    try:
        with pytest.raises(MalformedResponse) as err:
            p.complete(_request("g"))
    finally:
        p.close()
        server.shutdown()
        server.server_close()
    assert "ANSWER_TOO_LARGE" in err.value.detail
