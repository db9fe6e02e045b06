"""`run_step` against a fake provider: what the step makes of responses the provider cut off or stopped."""

from __future__ import annotations

import json
import random

from tether_planner.domain.compaction import estimate_tokens
from tether_planner.domain.messages import ChatMessage, PinnedModel, ToolCallRef, ToolView
from tether_planner.domain.state import RunState
from tether_planner.domain.validation import RawToolCall
from tether_planner.pricing import PricingTable
from tether_planner.providers.port import ModelRequest, ModelResponse
from tether_planner.statecodec import RunStateCodec
from tether_planner.step import StepConfig, StepFailed, StepInput, StepSucceeded, run_step

KV_PUT = ToolView(
    name="kv_put",
    description="Store a value.",
    args_schema_json=json.dumps({"type": "object", "properties": {"key": {"type": "string"}}}),
)


class ScriptedProvider:
    """Answers each model call with the next response; records the requests."""

    def __init__(self, *responses: tuple[str, tuple[RawToolCall, ...], str]) -> None:
        self.responses = list(responses)
        self.requests: list[ModelRequest] = []

    def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        text, calls, finish = self.responses.pop(0)
        return ModelResponse(text, calls, finish, 100, 10, 1, 5, request.model)


def _input(*, remaining_tokens: int = 1_000_000, goal: str = "summarise the report") -> StepInput:
    return StepInput(
        run_id="run-1",
        step=1,
        model=PinnedModel(provider="openai", name="gpt-4o"),
        system="You are a careful agent.",
        messages=(ChatMessage(role="user", content=goal),),
        offered=(KV_PUT,),
        tools={"kv_put": KV_PUT},
        remaining_tokens=remaining_tokens,
        compaction_threshold=0.8,
    )


def _run(inp: StepInput, provider: ScriptedProvider) -> StepSucceeded | StepFailed:
    return run_step(inp, lambda: provider, PricingTable(), StepConfig())


def test_an_answer_cut_off_by_the_remaining_budget_fails_the_step_instead_of_completing_the_run() -> None:
    provider = ScriptedProvider(("The", (), "length"))
    result = _run(_input(remaining_tokens=500, goal="x" * 3600), provider)  # a ~900-token prompt
    assert provider.requests[0].max_tokens == 1
    assert isinstance(result, StepFailed), result
    assert result.error_code == "MALFORMED_OUTPUT"
    assert result.detail.startswith("truncated: ") and "max_tokens=1" in result.detail and "budget" in result.detail
    assert "'The'" in result.detail
    assert result.usage.input_tokens == 100 and result.usage.output_tokens == 10  # the call is still paid for
    assert len(provider.requests) == 1


def test_an_answer_cut_off_at_the_output_limit_fails_the_step() -> None:
    provider = ScriptedProvider(("The report says", (), "length"))
    result = _run(_input(), provider)
    assert provider.requests[0].max_tokens == StepConfig().max_output_tokens
    assert isinstance(result, StepFailed) and result.error_code == "MALFORMED_OUTPUT"
    assert "TETHER_PLANNER_MAX_OUTPUT_TOKENS" in result.detail
    assert all(m.role != "assistant" for m in result.messages)  # the fragment is not kept as an answer


def test_a_filtered_or_refused_answer_fails_the_step() -> None:
    provider = ScriptedProvider(("", (), "error"))
    result = _run(_input(), provider)
    assert isinstance(result, StepFailed) and result.error_code == "PROVIDER_ERROR"
    assert "content filter" in result.detail


def test_tool_calls_cut_off_at_the_output_limit_are_repaired_never_executed() -> None:
    # Anthropic reports a tool_use block cut off before its input as input {}: valid JSON, valid
    # under a schema without required fields, yet not what the model meant.
    cut = RawToolCall("c1", "kv_put", "{}")
    whole = RawToolCall("c2", "kv_put", '{"key": "summary"}')
    provider = ScriptedProvider(("Storing", (cut,), "length"), ("Storing", (whole,), "tool_calls"))
    result = _run(_input(), provider)
    assert isinstance(result, StepSucceeded), result
    assert [(c.provider_call_id, c.args_json) for c in result.calls] == [("c2", '{"key":"summary"}')]
    repair = [m for m in result.messages if m.repair]
    assert [m.role for m in repair] == ["assistant", "tool"]
    assert "TRUNCATED" in repair[1].content
    assert len(provider.requests) == 2


def test_tool_calls_cut_off_by_the_remaining_budget_fail_the_step() -> None:
    # Another call could not get more room: asking again would only be cut off again.
    provider = ScriptedProvider(("", (RawToolCall("c1", "kv_put", '{"key": "su'),), "length"))
    result = _run(_input(remaining_tokens=500, goal="x" * 3600), provider)
    assert isinstance(result, StepFailed) and result.error_code == "MALFORMED_OUTPUT"
    assert "with tool calls" in result.detail and len(provider.requests) == 1


def test_a_complete_answer_still_ends_the_step() -> None:
    provider = ScriptedProvider(("The report is fine.", (), "stop"))
    result = _run(_input(), provider)
    assert isinstance(result, StepSucceeded) and result.final and result.text == "The report is fine."


# -- the checkpoint's size -----------------------------------------------------------------------

MILLION = PinnedModel(provider="openai", name="gpt-4.1", context_window_tokens=1_000_000)


def _big_context(turns: int, result_chars: int) -> tuple[ChatMessage, ...]:
    """The goal, then `turns` steps each with one call answered by a poorly compressible result
    (hex: about 2:1 under zlib; not wrapped in a data envelope, whose injection scan is slow on it)."""
    rng = random.Random(7)
    messages = [ChatMessage(role="user", content="collect every page")]
    for step in range(1, turns + 1):
        ref = ToolCallRef(id=f"c{step}", name="kv_put", arguments='{"key": "page"}', call_id=f"{step}.0")
        messages.append(ChatMessage(role="assistant", content="", tool_calls=(ref,), step=step))
        page = rng.randbytes(result_chars // 2).hex()
        messages.append(ChatMessage(role="tool", content=page, tool_call_id=ref.id, tool_name="kv_put", call_id=ref.call_id, step=step))
    return tuple(messages)


def _checkpoint(inp: StepInput, result: StepSucceeded | StepFailed) -> bytes:
    state = RunState(
        tenant_id="t1",
        goal=inp.messages[0].content,
        instructions=inp.system,
        model=inp.model,
        tools=list(inp.tools.values()),
        offered=[t.name for t in inp.offered],
        messages=list(result.messages),
        done_step=inp.step,
    )
    return RunStateCodec().encode(state)


def test_a_context_far_below_a_large_window_is_still_compacted_to_fit_a_checkpoint() -> None:
    # 208 results of 14 KB: ~730k estimated tokens, under 0.8 × a 1M window, yet ~1.5 MB compressed.
    messages = _big_context(208, 14_000)
    inp = StepInput(**{**_input().__dict__, "model": MILLION, "messages": messages, "step": 209})
    assert estimate_tokens(inp.system, messages, inp.offered) < 0.8 * MILLION.context_window_tokens
    uncompacted = _checkpoint(inp, StepSucceeded(209, "", (), "stop", None, 0, 0, False, True, 0, messages, 0))  # type: ignore[arg-type]
    assert len(uncompacted) > 1_000_000  # over Kafka's record limit: the defect
    provider = ScriptedProvider(("Stored them all.", (), "stop"))
    result = _run(inp, provider)
    assert isinstance(result, StepSucceeded) and result.compacted
    encoded = _checkpoint(inp, result)
    assert len(encoded) <= StepConfig().state_max_bytes
    # The model saw the compacted context too, and the last turns stayed verbatim.
    sent = provider.requests[0].messages
    assert sent[1].content.startswith("[tether:compacted assistant_turns=")
    assert sent[-1].call_id == "208.0" and sent[-1].content == messages[-1].content


def test_the_byte_budget_is_configurable_and_compacts_down_to_no_kept_turn() -> None:
    # Two turns of ~75 KB compressed each, budget 64 KiB: keeping 2 or 1 turns is too big, so none is kept.
    messages = _big_context(2, 150_000)
    inp = StepInput(**{**_input().__dict__, "model": MILLION, "messages": messages, "step": 3})
    provider = ScriptedProvider(("Done.", (), "stop"))
    config = StepConfig(state_max_bytes=64 * 1024)
    result = run_step(inp, lambda: provider, PricingTable(), config)
    assert isinstance(result, StepSucceeded) and result.compacted
    assert len(_checkpoint(inp, result)) <= config.state_max_bytes
    assert [m.role for m in provider.requests[0].messages] == ["user", "user"]


def test_a_context_within_the_byte_budget_is_left_alone() -> None:
    messages = _big_context(20, 15_000)  # ~300 KB raw
    inp = StepInput(**{**_input().__dict__, "model": MILLION, "messages": messages, "step": 21})
    result = _run(inp, ScriptedProvider(("Done.", (), "stop")))
    assert isinstance(result, StepSucceeded) and not result.compacted
    assert result.messages[: len(messages)] == messages


def test_an_unexpected_errors_text_is_not_cut_inside_a_secret_before_it_is_scrubbed() -> None:
    # The handler scrubs a failed step's detail and then cuts it; a detail already cut at a fixed
    # length could end inside a key (a self-hosted model's, with no recognisable shape), and a
    # piece of a key no longer matches the scrubber.
    from tether_planner.domain.redaction import Scrubber, cut_whole

    key = "Qm7vT2kLx9Pz4Rw8Nc5HtYu1"

    class LeakyAdapter:
        def complete(self, request: ModelRequest) -> ModelResponse:
            raise RuntimeError("x" * 465 + " request failed with key=" + key + " and more")  # the key at 490

    result = run_step(_input(), lambda: LeakyAdapter(), PricingTable(), StepConfig())
    assert isinstance(result, StepFailed)
    scrubbed = Scrubber([key])(result.detail)
    assert not any(key[i:i + 8] in scrubbed for i in range(len(key) - 7)), scrubbed
    # The cut itself drops the word it falls in.
    assert cut_whole("aaa bbb " + key, 12) == "aaa bbb …"
    assert cut_whole("short", 12) == "short"


def test_the_formats_checked_before_a_call_is_proposed_are_the_configured_ones() -> None:
    # The gateway asserts the formats its policy lists (arguments.assert_formats); the planner's pre-check
    # follows its assert_formats setting, so a policy asserting fewer formats is not undercut here by a
    # planner that refuses calls the gateway would allow (the run then failed MALFORMED_OUTPUT).
    invite = ToolView(name="invite", args_schema_json=json.dumps(
        {"type": "object", "properties": {"email": {"type": "string", "format": "email"}}}))
    inp = StepInput(
        run_id="run-1", step=1, model=PinnedModel(provider="openai", name="gpt-4o"), system="s",
        messages=(ChatMessage(role="user", content="invite ana"),), offered=(invite,), tools={"invite": invite},
        remaining_tokens=1_000_000, compaction_threshold=0.8,
    )
    call = RawToolCall("c1", "invite", '{"email": "Ana <ana at example.com>"}')

    def answers() -> ScriptedProvider:
        return ScriptedProvider(*[("Inviting.", (call,), "tool_calls")] * 3)

    strict = run_step(inp, answers, PricingTable(), StepConfig(malformed_limit=2))
    assert isinstance(strict, StepFailed) and strict.error_code == "MALFORMED_OUTPUT", strict
    lenient = run_step(inp, answers, PricingTable(), StepConfig(malformed_limit=2, assert_formats=frozenset({"date"})))
    assert isinstance(lenient, StepSucceeded), lenient
    assert [c.args_json for c in lenient.calls] == ['{"email":"Ana <ana at example.com>"}']
