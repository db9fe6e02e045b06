"""`run_step` against a fake provider: what the step makes of responses the provider cut off or stopped."""

from __future__ import annotations

import json

from tether_planner.domain.messages import ChatMessage, PinnedModel, ToolView
from tether_planner.domain.validation import RawToolCall
from tether_planner.pricing import PricingTable
from tether_planner.providers.port import ModelRequest, ModelResponse
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
