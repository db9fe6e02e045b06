"""One step's model work, run on a worker thread: compaction, the model call, checks, repairs.

`run_step` gets an immutable snapshot of the run's working context and returns a
`StepSucceeded` or `StepFailed`; it never touches the loop's context. The handler turns the
result into events on the loop thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog
from pydantic import TypeAdapter

from tether_planner.checkpoint import compact_to_fit
from tether_planner.domain.canonical import call_id as make_call_id
from tether_planner.domain.compaction import compact, estimate_tokens, over_threshold
from tether_planner.domain.context import for_request
from tether_planner.domain.messages import ChatMessage, PinnedModel, ToolCallRef, ToolView, UsageTotals
from tether_planner.domain.provenance import provenance_of
from tether_planner.domain.redaction import cut_whole
from tether_planner.domain.tool_results import wrap_tool_result
from tether_planner.domain.validation import (
    NOT_EXECUTED,
    TRUNCATED,
    CallProblem,
    RawToolCall,
    ValidCall,
    check_calls,
)
from tether_planner.pricing import PricingTable
from tether_planner.providers.port import (
    FINISH_ERROR,
    FINISH_INCOMPLETE,
    FINISH_LENGTH,
    FINISH_TOOL_CALLS,
    ContextOverflow,
    MalformedResponse,
    ModelProvider,
    ModelRequest,
    ModelResponse,
    ProviderError,
)
from tether_planner.statecodec import checkpoint_size
from tether_security.argument_schema import ASSERTABLE_FORMATS

log = structlog.get_logger("tether_planner.step")

#: ModelCallFailed error codes.
PROVIDER_ERROR = "PROVIDER_ERROR"
MALFORMED_OUTPUT = "MALFORMED_OUTPUT"
CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"
TIMEOUT = "TIMEOUT"


@dataclass(frozen=True)
class StepConfig:
    """Knobs of a step (from settings)."""

    max_output_tokens: int = 4096
    #: Consecutive responses with invalid tool calls after which the step fails.
    malformed_limit: int = 3
    stream: bool = False
    keep_turns: int = 2
    emergency_keep_turns: int = 1
    summary_max_chars: int = 6000
    error_result_max_chars: int = 4000
    #: Bound on the run's checkpoint (the encoded state), at the start of a step and after every
    #: record (checkpoint.fit): a working context over it is compacted whatever the model's
    #: window. Under Kafka's 1,000,000-byte record limit.
    state_max_bytes: int = 512 * 1024
    #: Bounds on one model answer (untrusted input): more tool calls, larger arguments or text make
    #: it a malformed answer (asked again within `malformed_limit`, then MALFORMED_OUTPUT), so that
    #: no record or checkpoint it would produce is too large for the loop to write.
    max_tool_calls: int = 64
    max_tool_args_bytes: int = 64 * 1024
    max_text_bytes: int = 256 * 1024
    #: The `format`s checked in a call's arguments (the gateway policy's arguments.assert_formats).
    assert_formats: frozenset[str] = ASSERTABLE_FORMATS


#: A token count a provider reports above this (for one call) is clamped to it: no model reads or
#: writes that many tokens in a call, and a larger count would overflow the recorded usage and cost.
MAX_TOKENS_PER_CALL = 100_000_000

#: Codes at the start of a MALFORMED_OUTPUT detail for an answer refused as a whole (not its calls).
TOO_MANY_TOOL_CALLS = "TOO_MANY_TOOL_CALLS"
ARGS_TOO_LARGE = "ARGS_TOO_LARGE"
TEXT_TOO_LARGE = "TEXT_TOO_LARGE"
EMPTY_ANSWER = "EMPTY_ANSWER"
MISSING_TOOL_CALLS = "MISSING_TOOL_CALLS"
INCOMPLETE = "INCOMPLETE"

#: Codes a MalformedResponse detail starts with (providers/http.py); any other is INVALID_RESPONSE.
_RESPONSE_CODES = ("ANSWER_TOO_LARGE", "INVALID_RESPONSE")
#: Why an answer refused as a whole was refused, in our own words (never the answer's text: it is
#: untrusted, and repeating it would invite the same answer).
_REASK_REASONS = {
    EMPTY_ANSWER: "it had neither text nor a tool call",
    MISSING_TOOL_CALLS: "its finish reason said tool calls but it had none",
    INCOMPLETE: "it was not finished",
    TOO_MANY_TOOL_CALLS: "it had more tool calls than one answer may have",
    ARGS_TOO_LARGE: "the arguments of a tool call were larger than allowed",
    TEXT_TOO_LARGE: "its text was longer than allowed",
    "ANSWER_TOO_LARGE": "it was larger than allowed",
    "INVALID_RESPONSE": "it was not in the shape of the provider's API",
}
#: The fixed start of the platform note added to a re-ask after an answer refused as a whole.
REASK_NOTE_PREFIX = "Platform note (unusable answer): "


def reask_note(code: str) -> ChatMessage:
    """The note that goes with the re-ask after an answer refused as a whole: our own fixed text and
    the machine-readable code, so the model knows why and does not answer the same way again."""
    code = code if code in _REASK_REASONS else "INVALID_RESPONSE"
    return ChatMessage(
        role="system",
        content=(
            f"{REASK_NOTE_PREFIX}[{code}] your previous answer could not be used: {_REASK_REASONS[code]}. "
            "It was discarded. Answer again, either with valid tool calls to the offered tools or with "
            "your final answer as text."
        ),
    )


def _response_code(detail: str) -> str:
    head = detail.split(":", 1)[0]
    return head if head in _RESPONSE_CODES else "INVALID_RESPONSE"


@dataclass(frozen=True)
class StepInput:
    """A snapshot of what the step's model call needs, taken on the loop thread."""

    run_id: str
    step: int
    model: PinnedModel
    system: str
    #: The working context; messages[0] is the goal.
    messages: tuple[ChatMessage, ...]
    offered: tuple[ToolView, ...]
    tools: Mapping[str, ToolView]
    remaining_tokens: int
    compaction_threshold: float


@dataclass(frozen=True)
class PlannedCall:
    """A checked tool call, ready to become a ToolCallRequested."""

    call_index: int
    tool_name: str
    args_json: str
    provider_call_id: str
    provenance_json: str


@dataclass(frozen=True)
class StepSucceeded:
    """The model answered usably: tool calls to request, or (no calls) the final answer `text`."""

    step: int
    text: str
    calls: tuple[PlannedCall, ...]
    finish_reason: str
    usage: UsageTotals
    attempts: int
    latency_ms: int
    compacted: bool
    priced: bool
    model_calls: int
    #: The new working context (compacted, with the step's repairs and answer) and how many
    #: messages of the snapshot it was built from.
    messages: tuple[ChatMessage, ...]
    base_len: int
    #: True when part of `usage` is the planner's estimate, not the provider's count (not reported,
    #: or an attempt cut before its usage: providers/http.py `estimate_usage`).
    usage_estimated: bool = False

    @property
    def final(self) -> bool:
        return not self.calls


@dataclass(frozen=True)
class StepFailed:
    """No usable response: the step fails with a ModelCallFailed code."""

    step: int
    error_code: str
    detail: str
    usage: UsageTotals
    attempts: int
    compacted: bool
    priced: bool
    model_calls: int
    messages: tuple[ChatMessage, ...] = field(default=())
    base_len: int = 0
    usage_estimated: bool = False


StepResult = StepSucceeded | StepFailed


def _estimate_output(text: str, calls: Sequence[RawToolCall]) -> int:
    return max(1, math.ceil((len(text) + sum(len(c.name) + len(c.arguments) for c in calls)) / 4))


def _excerpt(text: str, max_chars: int = 200) -> str:
    if not text:
        return ""
    return f"; text so far: {text[:max_chars]!r}" + ("…" if len(text) > max_chars else "")


_MESSAGES = TypeAdapter(list[ChatMessage])
_TOOLS = TypeAdapter(list[ToolView])


def _checkpoint_size(inp: StepInput, messages: Sequence[ChatMessage], budget: int) -> int:
    """The checkpoint's size with this working context: the messages and what else the state
    keeps of about that size (instructions, tool snapshots, the goal a second time)."""
    goal = messages[0].content if messages else ""
    data = b"".join(
        [
            _MESSAGES.dump_json(list(messages)),
            inp.system.encode(),
            _TOOLS.dump_json(list(inp.tools.values())),
            goal.encode(),
        ]
    )
    return checkpoint_size(data, budget=budget)


def clean_text(text: str) -> str:
    """`text` as valid Unicode: a lone surrogate (JSON "\\ud800" decodes to one; UTF-8 cannot encode
    it, so no record or checkpoint could hold it) becomes U+FFFD, as at the tool gateway; a
    surrogate pair split by streaming is joined again."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _tokens(value: int | None) -> int | None:
    """A reported token count as a non-negative int at most MAX_TOKENS_PER_CALL; anything else
    (negative, not an int) counts as not reported, so the step estimates it instead."""
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return min(value, MAX_TOKENS_PER_CALL)


def _clean_calls(calls: Sequence[RawToolCall]) -> list[RawToolCall]:
    return [RawToolCall(clean_text(c.id), clean_text(c.name), clean_text(c.arguments)) for c in calls]


def _unusable(text: str, calls: Sequence[RawToolCall], response: ModelResponse, config: StepConfig) -> tuple[str, str] | None:
    """(code, detail) when the answer as a whole is not one: unfinished, empty, or larger than the
    planner takes from a model."""
    if response.finish_reason == FINISH_INCOMPLETE:
        return INCOMPLETE, (
            f"the response ended with finish reason {str(response.raw_finish_reason)[:100]!r}, not a finished answer"
            + _excerpt(text)
        )
    if response.finish_reason == FINISH_TOOL_CALLS and not calls:
        return MISSING_TOOL_CALLS, "finish reason tool_calls but no tool call in the response" + _excerpt(text)
    if not calls and not text.strip():
        return EMPTY_ANSWER, "the response has neither text nor tool calls"
    if len(calls) > config.max_tool_calls:
        return TOO_MANY_TOOL_CALLS, f"{len(calls)} tool calls in one answer; the limit is {config.max_tool_calls}"
    for c in calls:
        size = len(c.arguments.encode("utf-8"))
        if size > config.max_tool_args_bytes:
            return ARGS_TOO_LARGE, (
                f"the arguments of a call to {c.name[:100]!r} are {size} bytes; the limit is {config.max_tool_args_bytes}"
            )
    size = len(text.encode("utf-8"))
    if size > config.max_text_bytes:
        return TEXT_TOO_LARGE, f"the answer's text is {size} bytes; the limit is {config.max_text_bytes}"
    return None


def _unique_ids(calls: Sequence[RawToolCall], step: int, model_call: int) -> list[RawToolCall]:
    # Tool results are matched to calls by id, so every call needs a distinct, non-empty one.
    # A made-up id is checked again (a_2, a, a must not give a_2 twice) and avoids the ids the
    # provider gave the later calls.
    given = {c.id for c in calls if c.id}
    seen: set[str] = set()
    out = []
    for i, c in enumerate(calls):
        cid = c.id or f"call_{step}_{model_call}_{i}"
        if cid in seen or (not c.id and cid in given):
            base, n = cid, i
            cid = f"{base}_{n}"
            while cid in seen or cid in given:
                n += 1
                cid = f"{base}_{n}"
        seen.add(cid)
        out.append(RawToolCall(cid, c.name, c.arguments))
    return out


def _repair_messages(
    text: str, step: int, checked: Sequence[ValidCall | CallProblem], offered: Sequence[str], max_chars: int
) -> list[ChatMessage]:
    raws = [c.raw for c in checked]
    assistant = ChatMessage(
        role="assistant",
        content=text,
        tool_calls=tuple(ToolCallRef(id=r.id, name=r.name, arguments=r.arguments) for r in raws),
        step=step,
        repair=True,
    )
    answers = [
        ChatMessage(
            role="tool",
            content=wrap_tool_result(
                tool_name=p.raw.name,
                call_id=p.raw.id,
                status="rejected",
                content=p.as_error(offered),
                untrusted=False,
                max_chars=max_chars,
            ),
            tool_call_id=p.raw.id,
            tool_name=p.raw.name,
            step=step,
            repair=True,
        )
        for p in checked
        if isinstance(p, CallProblem)
    ]
    return [assistant, *answers]


@dataclass
class _Tally:
    """What the step's model calls consumed so far."""

    usage: UsageTotals = field(default_factory=UsageTotals)
    attempts: int = 0
    latency_ms: int = 0
    priced: bool = True
    model_calls: int = 0
    usage_estimated: bool = False


def run_step(
    inp: StepInput,
    provider: Callable[[], ModelProvider],
    pricing: PricingTable,
    config: StepConfig,
) -> StepResult:
    """Call the model for one step until it gives a usable answer, the repairs run out, or it fails.

    `provider` is a factory, so choosing the adapter (which fails for an unknown provider)
    happens here, off the loop thread, and ends as a StepFailed like any other error. An
    unexpected error ends it as PROVIDER_ERROR with the usage of the calls already made (the
    working context unchanged).
    """
    tally = _Tally()
    try:
        return _run_step(inp, provider, pricing, config, tally)
    except Exception as exc:
        log.error("step_work_crashed", run_id=inp.run_id, step=inp.step, error=type(exc).__name__)
        return StepFailed(
            inp.step, PROVIDER_ERROR, f"planner error: {type(exc).__name__}: {cut_whole(str(exc), 4000)}", tally.usage,
            tally.attempts, False, tally.priced, tally.model_calls, usage_estimated=tally.usage_estimated,
        )


def _run_step(
    inp: StepInput, provider: Callable[[], ModelProvider], pricing: PricingTable, config: StepConfig, tally: _Tally
) -> StepResult:
    base_len = len(inp.messages)
    working = list(inp.messages)
    compacted = False

    def failed(code: str, detail: str) -> StepFailed:
        return StepFailed(
            inp.step, code, detail, tally.usage, tally.attempts, compacted, tally.priced, tally.model_calls,
            tuple(working), base_len, tally.usage_estimated,
        )

    def succeeded(text: str, calls: tuple[PlannedCall, ...], finish_reason: str) -> StepSucceeded:
        return StepSucceeded(
            inp.step, text, calls, finish_reason, tally.usage, tally.attempts, tally.latency_ms, compacted,
            tally.priced, tally.model_calls, tuple(working), base_len, tally.usage_estimated,
        )

    def bill(input_tokens: int, output_tokens: int, *, estimate: bool = False) -> None:
        input_tokens, output_tokens = min(input_tokens, MAX_TOKENS_PER_CALL), min(output_tokens, MAX_TOKENS_PER_CALL)
        cost = pricing.cost(inp.model.name, input_tokens, output_tokens)
        tally.usage = tally.usage + UsageTotals(
            input_tokens=input_tokens, output_tokens=output_tokens, cost_usd_micros=cost.usd_micros
        )
        tally.priced = tally.priced and cost.priced
        tally.usage_estimated = tally.usage_estimated or estimate

    try:
        adapter = provider()
    except ProviderError as exc:
        return failed(PROVIDER_ERROR, exc.detail)

    estimated = estimate_tokens(inp.system, working, inp.offered)
    if over_threshold(estimated, inp.model.context_window_tokens, inp.compaction_threshold):
        c = compact(working, keep_turns=config.keep_turns, summary_max_chars=config.summary_max_chars)
        if c is not None:
            working = c.apply(working)
            compacted = True
            log.info("context_compacted", run_id=inp.run_id, step=inp.step, estimated_tokens=estimated, replaced=c.replaced)
    # The context must also fit a checkpoint, whatever the window: keep fewer turns verbatim,
    # down to none, until it does.
    fitted = compact_to_fit(
        working,
        lambda messages: _checkpoint_size(inp, messages, config.state_max_bytes),
        max_bytes=config.state_max_bytes,
        keep_turns=config.keep_turns,
        emergency_keep_turns=config.emergency_keep_turns,
        summary_max_chars=config.summary_max_chars,
        run_id=inp.run_id,
        step=inp.step,
    )
    working, compacted = fitted.messages, compacted or fitted.compacted
    if fitted.size > config.state_max_bytes:
        log.warning("state_over_budget_after_compaction", run_id=inp.run_id, step=inp.step, state_bytes=fitted.size)

    emergency_used = False
    failures = 0
    offered_names = [t.name for t in inp.offered]
    # The note for the next call after an answer refused as a whole (nothing of it is kept, so
    # without a note the model would not know why it is asked again); it is not kept either.
    note: ChatMessage | None = None
    while True:
        context = for_request(working)
        if note is not None:
            context.append(note)
            note = None
        estimated = estimate_tokens(inp.system, context, inp.offered)
        used = tally.usage.input_tokens + tally.usage.output_tokens
        request = ModelRequest(
            model=inp.model.name,
            system=inp.system,
            messages=tuple(context),
            tools=inp.offered,
            max_tokens=max(1, min(config.max_output_tokens, inp.remaining_tokens - used - estimated)),
            run_id=inp.run_id,
            step=inp.step,
            call=tally.model_calls,
            stream=config.stream,
        )
        tally.model_calls += 1
        try:
            response = adapter.complete(request)
        except ContextOverflow as exc:
            tally.attempts += exc.attempts
            if exc.input_tokens or exc.output_tokens:
                bill(exc.input_tokens, exc.output_tokens, estimate=exc.usage_estimated)
            c = None
            if not emergency_used:
                c = compact(working, keep_turns=config.emergency_keep_turns, summary_max_chars=config.summary_max_chars)
            if c is None:
                return failed(CONTEXT_OVERFLOW, f"the context does not fit the model's window even after compaction: {exc.detail}")
            emergency_used = True
            working = c.apply(working)
            compacted = True
            log.warning("emergency_compaction", run_id=inp.run_id, step=inp.step, replaced=c.replaced)
            continue
        except MalformedResponse as exc:
            # The provider answered (and billed the prompt, estimated here: the usage was unreadable)
            # in a shape the adapter could not read: a malformed answer, asked again within the limit.
            tally.attempts += exc.attempts
            bill(estimated + exc.input_tokens, exc.output_tokens, estimate=True)
            failures += 1
            log.info("malformed_answer", run_id=inp.run_id, step=inp.step, failures=failures, detail=exc.detail)
            if failures >= config.malformed_limit:
                return failed(MALFORMED_OUTPUT, f"{exc.detail} ({failures} consecutive unusable responses)")
            note = reask_note(_response_code(exc.detail))
            continue
        except ProviderError as exc:
            tally.attempts += exc.attempts
            if exc.input_tokens or exc.output_tokens:
                bill(exc.input_tokens, exc.output_tokens, estimate=exc.usage_estimated)
            return failed(exc.code, exc.detail)

        text = clean_text(response.text)
        calls = _unique_ids(_clean_calls(response.tool_calls), inp.step, request.call)
        reported_in, reported_out = _tokens(response.input_tokens), _tokens(response.output_tokens)
        if (reported_in, reported_out) != (response.input_tokens, response.output_tokens):
            log.warning(
                "usage_not_plausible", run_id=inp.run_id, step=inp.step,
                input_tokens=str(response.input_tokens)[:40], output_tokens=str(response.output_tokens)[:40],
            )
        input_tokens = reported_in if reported_in is not None else estimated
        output_tokens = reported_out if reported_out is not None else _estimate_output(text, calls)
        # Earlier attempts of this call that were billed before they failed (a cut stream) count too.
        bill(
            input_tokens + (_tokens(response.retried_input_tokens) or 0),
            output_tokens + (_tokens(response.retried_output_tokens) or 0),
            estimate=reported_in is None or reported_out is None or response.retried_usage_estimated,
        )
        tally.attempts += response.attempts
        tally.latency_ms += response.latency_ms

        # A response the provider stopped (content filter, refusal) or cut off at max_tokens is not
        # an answer: a cut-off text would end the run COMPLETED with half an answer, and cut-off
        # tool calls may carry incomplete arguments. Cut-off calls are repaired like invalid ones
        # when a new call can get more room; otherwise the step fails.
        if response.finish_reason == FINISH_ERROR:
            return failed(
                PROVIDER_ERROR,
                "the provider stopped the response (content filter or refusal, finish_reason error)"
                + _excerpt(text),
            )
        if response.finish_reason == FINISH_LENGTH and (not calls or request.max_tokens < config.max_output_tokens):
            limit = "the run's remaining token budget" if request.max_tokens < config.max_output_tokens else (
                "TETHER_PLANNER_MAX_OUTPUT_TOKENS"
            )
            return failed(
                MALFORMED_OUTPUT,
                f"truncated: the response was cut off at max_tokens={request.max_tokens} ({limit}), "
                f"finish_reason length, {'with' if calls else 'no'} tool calls" + _excerpt(text),
            )

        over = _unusable(text, calls, response, config)
        if over is not None:
            # Nothing of such an answer is kept (an oversized one could not be recorded): the model is asked again.
            failures += 1
            log.info("malformed_answer", run_id=inp.run_id, step=inp.step, failures=failures, code=over[0], detail=over[1])
            if failures >= config.malformed_limit:
                return failed(MALFORMED_OUTPUT, f"{over[0]}: {failures} consecutive unusable responses; last: {over[1]}")
            note = reask_note(over[0])
            continue

        if not calls:
            working.append(ChatMessage(role="assistant", content=text, step=inp.step))
            return succeeded(text, (), response.finish_reason)

        if response.finish_reason == FINISH_LENGTH:
            checked: list[ValidCall | CallProblem] = [
                CallProblem(
                    c,
                    TRUNCATED,
                    f"the response was cut off at the output limit ({request.max_tokens} tokens); "
                    "the arguments may be incomplete",
                )
                for c in calls
            ]
        else:
            checked = check_calls(calls, inp.tools, config.assert_formats)
        valid = [c for c in checked if isinstance(c, ValidCall)]
        if len(valid) == len(checked):
            planned = tuple(
                PlannedCall(i, v.raw.name, v.args_json, v.raw.id, provenance_of(v.args, working))
                for i, v in enumerate(valid)
            )
            refs = tuple(
                ToolCallRef(
                    id=p.provider_call_id, name=p.tool_name, arguments=p.args_json, call_id=make_call_id(inp.step, p.call_index)
                )
                for p in planned
            )
            working.append(ChatMessage(role="assistant", content=text, tool_calls=refs, step=inp.step))
            return succeeded(text, planned, response.finish_reason)

        failures += 1
        problems = [c for c in checked if isinstance(c, CallProblem) and c.code != NOT_EXECUTED]
        summary = "; ".join(f"{p.code} {p.raw.name}: {p.detail}" for p in problems)
        log.info("malformed_tool_calls", run_id=inp.run_id, step=inp.step, failures=failures, problems=summary)
        working.extend(_repair_messages(text, inp.step, checked, offered_names, config.error_result_max_chars))
        if failures >= config.malformed_limit:
            return failed(MALFORMED_OUTPUT, f"{failures} consecutive responses with invalid tool calls; last: {summary}")
