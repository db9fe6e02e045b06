"""Model answers as untrusted input: every badly formed, oversized or implausible answer ends its
step with a ModelCallCompleted (sanitised) or a ModelCallFailed with a code and the usage spent,
never a step left pending. The in-memory driver, the real adapters, a mock HTTP transport."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tether_contracts.base import AvroRecord
from tether_contracts.records import ModelCallCompleted, ModelCallFailed, ModelRef, RunCompleted, ToolCallRequested

MAX_TOKENS_PER_CALL = 100_000_000  # tether_planner.step.MAX_TOKENS_PER_CALL, as documented


def oa(message: dict[str, Any], finish: str | None = "tool_calls", usage: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"choices": [{"message": message, "finish_reason": finish}], "model": "tether-scripted"}
    body["usage"] = {"prompt_tokens": 100, "completion_tokens": 20} if usage is None else usage
    return body


def tc(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


GOOD_CALL = oa({"content": None, "tool_calls": [tc("z", "anything", '{"ok":1}')]})


def failed(out: list[AvroRecord]) -> ModelCallFailed:
    assert [type(p) for p in out] == [ModelCallFailed], out
    return out[0]  # type: ignore[return-value]


# -- 1. answers the loop could not record ---------------------------------------------------------


def test_a_lone_surrogate_in_the_text_becomes_a_replacement_character(mock_model: Any) -> None:
    h = mock_model([b'{"choices":[{"message":{"content":"hi \\ud800 there"},"finish_reason":"stop"}],'
                b'"usage":{"prompt_tokens":5,"completion_tokens":5}}'])
    out = h.run()
    assert [type(p) for p in out] == [ModelCallCompleted, RunCompleted]
    assert out[1].answer == "hi \ufffd there"


def test_a_lone_surrogate_in_arguments_becomes_a_replacement_character(mock_model: Any) -> None:
    args = '{"url":"x\\ud800"}'
    h = mock_model([oa({"content": None, "tool_calls": [tc("a", "anything", args)]})])
    out = h.run(open_tools=True)
    assert [type(p) for p in out] == [ModelCallCompleted, ToolCallRequested]
    assert json.loads(out[1].call.args_json) == {"url": "x\ufffd"}


@pytest.mark.parametrize(
    ("usage", "expected_in"),
    [
        ({"prompt_tokens": -1_000_000, "completion_tokens": 20}, None),  # not plausible: estimated
        ({"prompt_tokens": 2**64, "completion_tokens": 20}, MAX_TOKENS_PER_CALL),
    ],
)
def test_implausible_usage_is_estimated_or_clamped(mock_model: Any, usage: dict[str, int], expected_in: int | None) -> None:
    out = mock_model([oa({"content": "done"}, "stop", usage)]).run()
    assert [type(p) for p in out] == [ModelCallCompleted, RunCompleted]
    tokens = out[0].usage.input_tokens
    assert 0 < tokens <= MAX_TOKENS_PER_CALL
    if expected_in is not None:
        assert tokens == expected_in
    assert out[0].usage.output_tokens == 20


def test_oversized_arguments_are_a_malformed_answer_with_the_usage_kept(mock_model: Any) -> None:
    big = tc("a", "anything", json.dumps({"blob": "x" * 2_000_000}))
    h = mock_model([oa({"content": None, "tool_calls": [big]})] * 3)
    f = failed(h.run(open_tools=True))
    assert f.error_code == "MALFORMED_OUTPUT" and f.detail.startswith("ARGS_TOO_LARGE")
    assert f.usage.input_tokens == 300 and f.attempts == 3
    assert len(h.http_requests) == 3


def test_too_many_tool_calls_are_a_malformed_answer_then_the_model_is_asked_again(mock_model: Any) -> None:
    many = oa({"content": None, "tool_calls": [tc(f"c{i}", "anything", "{}") for i in range(10_000)]})
    h = mock_model([many, GOOD_CALL])
    out = h.run(open_tools=True)
    assert [type(p) for p in out] == [ModelCallCompleted, ToolCallRequested]
    assert out[0].usage.input_tokens == 200  # both answers were billed


def test_too_many_tool_calls_every_time_fail_the_step(mock_model: Any) -> None:
    many = oa({"content": None, "tool_calls": [tc(f"c{i}", "anything", "{}") for i in range(10_000)]})
    f = failed(mock_model([many] * 3).run(open_tools=True))
    assert f.detail.startswith("TOO_MANY_TOOL_CALLS") and f.usage.input_tokens == 300


def test_an_outcome_that_cannot_be_recorded_fails_the_step_with_its_usage(mock_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import tether_planner.handlers as handlers

    def broken(_args_json: str) -> str:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(handlers, "args_hash", broken)
    h = mock_model([GOOD_CALL])
    f = failed(h.run(open_tools=True))
    assert f.error_code == "MALFORMED_OUTPUT" and f.detail.startswith("UNRECORDABLE")
    assert f.usage.input_tokens == 100 and f.attempts == 1
    assert h.driver.states["r1"].done_step == 1


# -- 2. empty and unfinished answers ----------------------------------------------------------------

ANSWER = oa({"content": "the answer"}, "stop")


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (oa({"content": None}, "stop"), "EMPTY_ANSWER"),
        (oa({"content": "  "}, "stop"), "EMPTY_ANSWER"),
        (oa({"content": None}, "tool_calls"), "MISSING_TOOL_CALLS"),
        (oa({"content": "half an ans"}, "MAX_TOKENS"), "INCOMPLETE"),
    ],
)
def test_an_empty_or_unfinished_answer_is_asked_again_then_fails_the_step(mock_model: Any, bad: dict, code: str) -> None:
    out = mock_model([bad, ANSWER]).run()
    assert [type(p) for p in out] == [ModelCallCompleted, RunCompleted]
    assert out[1].answer == "the answer" and out[0].usage.input_tokens == 200
    f = failed(mock_model([bad] * 3).run())
    assert f.error_code == "MALFORMED_OUTPUT" and f.detail.startswith(code), f.detail
    assert f.usage.input_tokens == 300


def test_anthropic_pause_turn_is_not_a_final_answer(mock_model: Any) -> None:
    paused = {"type": "message", "content": [{"type": "text", "text": "Let me search fir"}], "stop_reason": "pause_turn",
              "usage": {"input_tokens": 10, "output_tokens": 2}}
    f = failed(mock_model([paused] * 3).run(model=ModelRef(provider="anthropic", name="claude-x")))
    assert f.detail.startswith("INCOMPLETE") and "pause_turn" in f.detail
    assert f.usage.input_tokens == 30


def test_a_legacy_function_call_is_a_tool_call(mock_model: Any) -> None:
    legacy = oa({"content": None, "function_call": {"name": "anything", "arguments": '{"url":"x"}'}}, "function_call")
    out = mock_model([legacy]).run(open_tools=True)
    assert [type(p) for p in out] == [ModelCallCompleted, ToolCallRequested]
    assert out[1].call.tool_name == "anything" and json.loads(out[1].call.args_json) == {"url": "x"}


# -- 3. non-standard JSON in arguments ------------------------------------------------------------


@pytest.mark.parametrize("args", ['{"n":NaN}', '{"m":1e999}', '{"m":-Infinity}', '{"a":[Infinity]}'])
def test_nan_and_infinities_in_arguments_are_invalid_json(mock_model: Any, args: str) -> None:
    h = mock_model([oa({"content": None, "tool_calls": [tc("a", "anything", args)]}), GOOD_CALL])
    out = h.run(open_tools=True)
    assert [type(p) for p in out] == [ModelCallCompleted, ToolCallRequested]
    assert out[1].call.args_json == '{"ok":1}'
    repairs = [m.content for m in h.driver.states["r1"].messages if m.role == "tool" and m.repair]
    assert len(repairs) == 1 and "INVALID_JSON" in repairs[0]


def test_canonical_json_refuses_nan() -> None:
    from tether_planner.domain.canonical import canonical_json

    with pytest.raises(ValueError):
        canonical_json({"n": float("nan")})


# -- 4. duplicate tool-call ids --------------------------------------------------------------------


@pytest.mark.parametrize("ids", [["a_2", "a", "a"], ["a", "a", "a_1"], ["", "call_1_0_0", ""], ["x", "x", "x", "x_2"]])
def test_tool_call_ids_are_made_unique(mock_model: Any, ids: list[str]) -> None:
    h = mock_model([oa({"content": None, "tool_calls": [tc(i, "anything", "{}") for i in ids]})])
    out = h.run(open_tools=True)
    made = [p.call.provider_call_id for p in out if isinstance(p, ToolCallRequested)]
    assert len(made) == len(ids) and len(set(made)) == len(ids), made
    assert all(m for m in made)
    state_ids = [c.id for m in h.driver.states["r1"].messages if m.role == "assistant" for c in m.tool_calls]
    assert state_ids == made


# -- 5. answers not in the shape of the provider's API ----------------------------------------------

BAD_REPAIR = oa({"content": None, "tool_calls": [tc("a", "anything", '{"url":')]}, usage={"prompt_tokens": 50_000, "completion_tokens": 4_000})


@pytest.mark.parametrize(
    "bad",
    [
        {"choices": {"x": 1}},
        oa({"content": None, "tool_calls": ["oops"]}),
        oa({"content": "x"}, "stop", usage=5),
        oa({"content": "x"}, "stop", usage={"prompt_tokens": 100.5, "completion_tokens": 3}),
        oa({"content": "x"}, "stop", usage={"prompt_tokens": "100", "completion_tokens": 3}),
        b'{"choices":[{"message":{"content":"caf\xe9"},"finish_reason":"stop"}]}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=["choices-dict", "call-string", "usage-int", "usage-float", "usage-string", "not-utf8", "deep-body"],
)
def test_a_badly_shaped_answer_is_malformed_and_earlier_usage_is_kept(mock_model: Any, bad: Any) -> None:
    h = mock_model([BAD_REPAIR, bad, bad])
    f = failed(h.run(open_tools=True))
    assert f.error_code == "MALFORMED_OUTPUT" and "INVALID_RESPONSE" in f.detail, f.detail
    assert f.usage.input_tokens > 50_000 and f.usage.output_tokens == 4_000
    assert f.attempts == 3 and len(h.http_requests) == 3


def test_a_badly_shaped_answer_is_asked_again(mock_model: Any) -> None:
    out = mock_model([{"choices": ["x"]}, GOOD_CALL]).run(open_tools=True)
    assert [type(p) for p in out] == [ModelCallCompleted, ToolCallRequested]
    assert out[0].attempts == 2


def test_arguments_nested_too_deeply_are_invalid_json(mock_model: Any) -> None:
    deep = oa({"content": None, "tool_calls": [tc("a", "anything", "[" * 20_000 + "]" * 20_000)]})
    h = mock_model([deep, GOOD_CALL])
    out = h.run(open_tools=True)
    assert [type(p) for p in out] == [ModelCallCompleted, ToolCallRequested]
    repairs = [m.content for m in h.driver.states["r1"].messages if m.role == "tool" and m.repair]
    assert "INVALID_JSON" in repairs[0] and "nested too deeply" in repairs[0]


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "message", "content": ["hi"], "stop_reason": "end_turn", "usage": {"input_tokens": 10, "output_tokens": 2}},
        {"type": "message", "content": [{"type": "text", "text": "x"}], "stop_reason": "end_turn",
         "usage": {"input_tokens": "ten", "output_tokens": 2}},
    ],
    ids=["block-string", "tokens-string"],
)
def test_a_badly_shaped_anthropic_answer_is_malformed(mock_model: Any, bad: dict) -> None:
    f = failed(mock_model([bad] * 3).run(model=ModelRef(provider="anthropic", name="claude-x")))
    assert f.error_code == "MALFORMED_OUTPUT" and "INVALID_RESPONSE" in f.detail and f.attempts == 3
    assert f.usage.input_tokens > 0


def test_a_streamed_tool_call_without_an_index_is_malformed(mock_model: Any) -> None:
    chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": None, "id": "a", "function": {"name": "anything",
             "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]}
    body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()

    def sse(_request: Any) -> Any:
        import httpx

        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    f = failed(mock_model([sse] * 3, stream=True).run(open_tools=True))
    assert f.error_code == "MALFORMED_OUTPUT" and "INVALID_RESPONSE" in f.detail and f.attempts == 3


# -- 6. retries and the tokens they cost ----------------------------------------------------------


def _sse(*chunks: dict, done: bool = True) -> Any:
    import httpx

    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ("data: [DONE]\n\n" if done else "")
    return lambda _request: httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


def test_a_stream_cut_after_its_usage_is_billed_when_retried(mock_model: Any) -> None:
    partial = {"choices": [{"index": 0, "delta": {"content": "partial"}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 90_000, "completion_tokens": 4_000}}
    ok = [{"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]},
          {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 1}}]
    out = mock_model([_sse(partial, usage, done=False), _sse(*ok)], stream=True).run()
    assert [type(p) for p in out] == [ModelCallCompleted, RunCompleted]
    assert (out[0].usage.input_tokens, out[0].usage.output_tokens, out[0].attempts) == (90_100, 4_001, 2)


def test_a_stream_cut_every_time_fails_with_the_billed_usage(mock_model: Any) -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 1_000, "completion_tokens": 10}}
    f = failed(mock_model([_sse(usage, done=False)] * 3, stream=True).run())
    assert f.error_code == "PROVIDER_ERROR" and (f.usage.input_tokens, f.usage.output_tokens, f.attempts) == (3_000, 30, 3)


def test_a_200_with_a_non_retryable_error_is_not_retried(mock_model: Any) -> None:
    error = {"error": {"message": "invalid model", "type": "invalid_request_error"}}
    h = mock_model([error] * 3)
    f = failed(h.run())
    assert f.error_code == "PROVIDER_ERROR" and f.attempts == 1 and len(h.http_requests) == 1
    # ...while a transient one still is.
    error = {"error": {"message": "try later", "type": "server_error"}}
    out = mock_model([error, oa({"content": "fine"}, "stop")]).run()
    assert [type(p) for p in out] == [ModelCallCompleted, RunCompleted] and out[0].attempts == 2


def test_an_unexpected_error_in_the_step_keeps_the_usage_of_earlier_calls(mock_model: Any) -> None:
    def boom(_request: Any) -> Any:
        raise RuntimeError("adapter bug")

    f = failed(mock_model([BAD_REPAIR, boom]).run(open_tools=True))
    assert f.error_code == "PROVIDER_ERROR" and "RuntimeError" in f.detail
    assert (f.usage.input_tokens, f.usage.output_tokens, f.attempts) == (50_000, 4_000, 1)
