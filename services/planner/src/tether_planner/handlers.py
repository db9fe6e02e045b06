"""Handlers of the planner processor: fold the run event log into the working context, start a
step's model work on StepGranted, and turn the finished work into events.

Each handler is a plain function (record first, dependencies as named parameters); the table
mapping record types to handlers is at the bottom. The model is never called on the loop
thread: `ctx.start_work` runs `tether_planner.step.run_step` on a worker, and
`on_step_work_done` emits its outcome in the loop's next transaction together with the state
checkpoint that marks the step done, so a re-delivered StepGranted never calls the model twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ModelCallCompleted,
    ModelCallFailed,
    ModelRef,
    RunAccepted,
    RunCompleted,
    RunTerminated,
    StepGranted,
    ToolCall,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
    Usage,
)
from tether_messaging.envelopes import derived_id
from tether_messaging.processor import Context, Inbound, WorkDone
from tether_messaging.serde import encode
from tether_messaging.topics import Topics
from tether_planner.checkpoint import StateBound, fit, limit, measure
from tether_planner.domain import state as st
from tether_planner.domain.canonical import args_hash, call_id, idem_key
from tether_planner.domain.messages import ToolCallRef, UsageTotals
from tether_planner.domain.redaction import Scrubber
from tether_planner.domain.tool_results import ScanOnce
from tether_planner.metrics import PlannerMetrics
from tether_planner.pricing import PricingTable
from tether_planner.providers.registry import ProviderRegistry
from tether_planner.step import (
    MALFORMED_OUTPUT,
    PROVIDER_ERROR,
    StepConfig,
    StepFailed,
    StepInput,
    StepResult,
    StepSucceeded,
    clean_text,
    run_step,
)

PRODUCER = "planner"

log = structlog.get_logger("tether_planner")


@dataclass(frozen=True)
class Limits:
    """Size caps on what the planner records (claim checks for larger payloads come later)."""

    assistant_text_max_chars: int = 8_000
    answer_max_chars: int = 64_000
    tool_result_max_chars: int = 16_000
    detail_max_chars: int = 2_000


@dataclass(frozen=True)
class Deps:
    """What the handlers need besides the record and the context; built by the bootstrap."""

    topics: Topics
    providers: ProviderRegistry
    pricing: PricingTable
    step_config: StepConfig
    limits: Limits
    metrics: PlannerMetrics
    scrub: Scrubber


def work_key(run_id: str, step: int) -> str:
    return f"{run_id}:{step}"


def _step_of(key: str) -> int:
    return int(key.rsplit(":", 1)[1])


def _usage(u: UsageTotals) -> Usage:
    return Usage(input_tokens=u.input_tokens, output_tokens=u.output_tokens, cost_usd_micros=u.cost_usd_micros)


def _put(
    ctx: Context,
    deps: Deps,
    run_id: str,
    before: st.RunState | None,
    after: st.RunState,
    *,
    may_compact: bool = True,
    awaiting: int = 0,
) -> st.RunState:
    """Checkpoint `after`, fitted to the state's byte bound (checkpoint.fit) so that what the record
    added (an answer, a tool result) cannot make the checkpoint too large to produce."""
    bound = _bound(deps)
    fitted = fit(before, after, bound, may_compact=may_compact, run_id=run_id, awaiting=awaiting)
    if fitted.checkpoint_bound > limit(bound, awaiting):
        log.warning("state_over_budget_after_compaction", run_id=run_id, state_bytes=fitted.checkpoint_bound)
    ctx.put_state(run_id, fitted)
    return fitted


def _bound(deps: Deps) -> StateBound:
    c = deps.step_config
    return StateBound(c.state_max_bytes, c.keep_turns, c.emergency_keep_turns, c.summary_max_chars)


def _emit(ctx: Context, deps: Deps, payload: AvroRecord, run_id: str, state: st.RunState, what: tuple, cause: str) -> None:
    ctx.emit(
        deps.topics.run_intake,
        payload,
        run_id=run_id,
        tenant_id=state.tenant_id,
        event_id=derived_id(run_id, payload.AVRO_NAME, *what),
        causation_id=cause,
    )


# -- folding the log -------------------------------------------------------------------------


def on_run_accepted(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id = msg.envelope.run_id
    if ctx.get_state(run_id) is not None:
        return
    accepted = msg.payload
    if not isinstance(accepted, RunAccepted):
        return
    _put(ctx, deps, run_id, None, st.new_run(accepted, msg.envelope.tenant_id, msg.envelope.seq))


def on_step_granted(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id, granted = msg.envelope.run_id, msg.payload
    if not isinstance(granted, StepGranted):
        return
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None:
        # The run ended (state dropped) or was never accepted here: nothing may run for it.
        deps.metrics.skipped.labels("unknown_run").inc()
        log.warning("step_granted_for_unknown_run", run_id=run_id, step=granted.step)
        return
    if state.ended:
        # A grant re-delivered after a crash, of a run that ended while this step's model call was in
        # flight: nothing runs for an ended run (the lost call is not made again); the state goes.
        deps.metrics.skipped.labels("run_ended").inc()
        ctx.put_state(run_id, None)
        return
    if granted.step <= state.done_step or state.finished:
        # A replayed grant of a finished step: its outcome is already emitted and checkpointed.
        deps.metrics.skipped.labels("step_done").inc()
        log.info("step_already_done", run_id=run_id, step=granted.step, done_step=state.done_step)
        return
    if not state.seen(msg.envelope.seq):
        if state.pending is not None and state.pending.step != granted.step:
            log.warning("grant_while_step_pending", run_id=run_id, step=granted.step, pending=state.pending.step)
            deps.metrics.skipped.labels("other_step_pending").inc()
            return
        # The step's work has not taken its snapshot yet: the context may still be compacted.
        state = _put(ctx, deps, run_id, state, st.grant_step(state, granted, msg.envelope.event_id, msg.envelope.seq))
    if state.pending is not None and state.pending.step == granted.step:
        # Also for a re-delivered grant whose work never finished (a crash): start it again.
        _start_step(ctx, run_id, state, deps)


def _start_step(ctx: Context, run_id: str, state: st.RunState, deps: Deps) -> None:
    pending = state.pending
    if pending is None:
        return
    inp = StepInput(
        run_id=run_id,
        step=pending.step,
        model=state.model,
        system=state.instructions,
        messages=tuple(state.messages),
        offered=tuple(state.offered_tools()),
        tools=state.tool_map(),
        remaining_tokens=pending.remaining_tokens,
        compaction_threshold=state.compaction_threshold,
    )
    provider_name = state.model.provider
    registry, pricing, config = deps.providers, deps.pricing, deps.step_config

    def work() -> StepResult:
        return run_step(inp, lambda: registry.get(provider_name), pricing, config)

    ctx.start_work(work_key(run_id, pending.step), run_id, state.tenant_id, work)


def on_tool_outcome(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id, outcome = msg.envelope.run_id, msg.payload
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.seen(msg.envelope.seq):
        return
    if not isinstance(outcome, (ToolCallCompleted, ToolCallFailed, ToolCallDenied, ToolCallOutcomeUnknown)):
        return
    bound, cap, scan = _bound(deps), deps.limits.tool_result_max_chars, ScanOnce()
    message = st.tool_result_message(state, outcome, max_chars=cap, detector=scan)
    after = st.record_tool_outcome(state, message, msg.envelope.seq)
    # Room stays for the results still to come, so the last of a step's many results still fits.
    awaiting = st.awaiting_results(after, outcome.call_id)
    room = limit(bound, awaiting)
    # Older turns are compacted, not the result's own (the model is to read it next); and not at
    # all while a step's model work runs on a snapshot of the context.
    fitted = fit(state, after, bound, may_compact=state.pending is None, run_id=run_id, awaiting=awaiting, keep_at_least=1)
    shortened = False
    while fitted.checkpoint_bound > room and cap > 1:
        # Compaction keeps the turn awaiting these results verbatim (a call is never separated from
        # its result), so what is over comes off this result: a shorter envelope marked truncated,
        # the whole result staying in the run's log under the same call id.
        over = fitted.checkpoint_bound - room
        cap = max(1, cap // 2 if shortened else min(cap, len(message.content)) - over - 256)
        shortened = True
        message = st.tool_result_message(state, outcome, max_chars=cap, detector=scan)
        fitted = st.record_tool_outcome(fitted, message, msg.envelope.seq)
        fitted = fitted.model_copy(update={"checkpoint_bound": measure(fitted, room)})
    if shortened:
        deps.metrics.results_shortened.inc()
        log.warning(
            "tool_result_shortened", run_id=run_id, call_id=outcome.call_id, max_chars=cap, state_bytes=fitted.checkpoint_bound
        )
    if fitted.checkpoint_bound > room:
        log.warning("state_over_budget_after_compaction", run_id=run_id, state_bytes=fitted.checkpoint_bound)
    ctx.put_state(run_id, fitted)


# The planner's own events come back sequenced (ModelCallCompleted, ToolCallRequested,
# ModelCallFailed): on_step_work_done applied them already, so their fold changes nothing and the
# handlers put no state (no checkpoint of the whole conversation, and with nothing else in the
# batch the loop commits nothing: `noop_commit_ms`). `last_seq` is not advanced past such an
# echo; it only tells folds that do change the state whether their event is already in, and an
# echo replayed after a crash is recognised by its step or call instead. Folding them matters only
# for a state rebuilt from the log.


def on_model_call_completed(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id, event = msg.envelope.run_id, msg.payload
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.seen(msg.envelope.seq) or not isinstance(event, ModelCallCompleted):
        return
    if event.step <= state.done_step:
        return  # an echo of an outcome already recorded
    usage = UsageTotals(
        input_tokens=event.usage.input_tokens,
        output_tokens=event.usage.output_tokens,
        cost_usd_micros=event.usage.cost_usd_micros,
    )
    after = st.record_model_call_seen(state, event.step, event.assistant_text, usage, msg.envelope.seq)
    _put(ctx, deps, run_id, state, after, may_compact=after.pending is None)


def on_tool_call_requested(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id, event = msg.envelope.run_id, msg.payload
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.seen(msg.envelope.seq) or not isinstance(event, ToolCallRequested):
        return
    c = event.call
    if st.has_tool_call(state, event.step, c.call_id):
        return  # an echo of a call already in the step's assistant message
    ref = ToolCallRef(id=c.provider_call_id or c.call_id, name=c.tool_name, arguments=c.args_json, call_id=c.call_id)
    _put(ctx, deps, run_id, state, st.record_tool_call_seen(state, event.step, ref, msg.envelope.seq), may_compact=state.pending is None)


def on_model_call_failed(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id, event = msg.envelope.run_id, msg.payload
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.seen(msg.envelope.seq) or not isinstance(event, ModelCallFailed):
        return
    if event.step <= state.done_step:
        return  # an echo: the step is done (and a later pending step is not this one)
    after = st.record_step_failed_seen(state, event.step, msg.envelope.seq)
    _put(ctx, deps, run_id, state, after, may_compact=after.pending is None)


def on_run_ended(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """RunCompleted / RunTerminated: nothing runs for the run any more; its state goes. A model call
    still in flight keeps it until the call's outcome is recorded: the call cost money, and the
    budget still appends the granted step's model call after the end (docs/architecture.md)."""
    run_id = msg.envelope.run_id
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.ended:
        return
    if state.pending is not None:
        ctx.put_state(run_id, state.model_copy(update={"ended": True}))
    else:
        ctx.put_state(run_id, None)


# -- the finished model work ------------------------------------------------------------------


def on_step_work_done(done: WorkDone, ctx: Context, *, deps: Deps) -> None:
    """Emit the step's outcome and checkpoint the step as done, in the same transaction."""
    run_id = done.run_id
    step = _step_of(done.key)
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.pending is None or state.pending.step != step or step <= state.done_step:
        # A stale delivery (the step's outcome is already recorded, or the run's state is gone).
        deps.metrics.skipped.labels("stale_work").inc()
        log.info("model_outcome_dropped", run_id=run_id, step=step)
        return
    result: StepResult
    if done.error is not None:
        log.error("step_work_crashed", run_id=run_id, step=step, error=f"{type(done.error).__name__}")
        result = StepFailed(
            step,
            PROVIDER_ERROR,
            deps.scrub(f"planner error: {type(done.error).__name__}: {done.error}"),
            UsageTotals(),
            0,
            False,
            True,
            0,
        )
    else:
        result = done.result
    cause = state.pending.granted_event_id
    try:
        records, new_state = _outcome(result, step, run_id, state, deps)
        for payload, _ in records:
            encode(payload)  # what the loop cannot write must not leave the step pending
    except Exception as exc:
        # A model answer the planner cannot turn into events (a bug, or input no check caught) still
        # ends the step, with the usage the calls cost: never a dead-lettered work item, nothing emitted.
        log.error("step_outcome_unrecordable", run_id=run_id, step=step, error=type(exc).__name__)
        result = StepFailed(
            step,
            MALFORMED_OUTPUT,
            clean_text(deps.scrub(f"UNRECORDABLE: the model's answer could not be recorded: {type(exc).__name__}: {exc}")),
            _plausible(result.usage),
            max(0, min(result.attempts, 2**31 - 1)),
            result.compacted,
            result.priced,
            max(0, result.model_calls),
            usage_estimated=result.usage_estimated is True,
        )
        records, new_state = _outcome(result, step, run_id, state, deps)
    try:
        _observe(result, state.model.provider, state.model.name, deps)
    except Exception as exc:  # metrics never keep a step's outcome from being recorded
        log.error("step_metrics_failed", run_id=run_id, step=step, error=type(exc).__name__)
    for payload, what in records:
        _emit(ctx, deps, payload, run_id, state, what, cause)
    if state.ended:
        log.info("model_call_recorded_after_run_end", run_id=run_id, step=step)
        ctx.put_state(run_id, None)
        return
    # The step's answer and repairs joined the context: its checkpoint is fitted again, with room
    # for the results of the calls it requested.
    _put(ctx, deps, run_id, state, new_state, awaiting=st.awaiting_results(new_state))


def _plausible(u: UsageTotals) -> UsageTotals:
    """Usage that can be recorded: each count within [0, 2**62)."""

    def bound(v: object) -> int:
        return max(0, min(v, 2**62 - 1)) if isinstance(v, int) else 0

    return UsageTotals(
        input_tokens=bound(u.input_tokens), output_tokens=bound(u.output_tokens), cost_usd_micros=bound(u.cost_usd_micros)
    )


def _outcome(
    result: StepResult, step: int, run_id: str, state: st.RunState, deps: Deps
) -> tuple[list[tuple[AvroRecord, tuple]], st.RunState]:
    """The step's records (payload, derived-id parts) and the state that marks the step done."""
    records: list[tuple[AvroRecord, tuple]] = []
    model = ModelRef(
        provider=state.model.provider, name=state.model.name, context_window_tokens=state.model.context_window_tokens
    )
    if isinstance(result, StepSucceeded):
        text = deps.scrub(result.text)
        records.append((
            ModelCallCompleted(
                step=step,
                model=model,
                usage=_usage(result.usage),
                assistant_text=text[: deps.limits.assistant_text_max_chars] if text else None,
                tool_call_count=len(result.calls),
                finish_reason=result.finish_reason,
                latency_ms=result.latency_ms,
                attempts=max(1, result.attempts),
                compacted=result.compacted,
                usage_estimated=result.usage_estimated,
            ),
            (step,),
        ))
        # The run ended while the model was thinking (cancel, cap): the call's usage is recorded,
        # but nothing it proposed is: no tool call is requested and no answer given for an ended run.
        for c in [] if state.ended else result.calls:
            cid = call_id(step, c.call_index)
            records.append((
                ToolCallRequested(
                    step=step,
                    call=ToolCall(
                        call_id=cid,
                        call_index=c.call_index,
                        idem_key=idem_key(run_id, step, c.call_index),
                        tool_name=c.tool_name,
                        args_json=c.args_json,
                        args_hash=args_hash(c.args_json),
                        provider_call_id=c.provider_call_id,
                    ),
                    provenance_json=c.provenance_json,
                ),
                (cid,),
            ))
        if result.final and not state.ended:
            records.append((
                RunCompleted(
                    step=step,
                    answer=text[: deps.limits.answer_max_chars],
                    usage=_usage(state.usage + result.usage),
                ),
                (step,),
            ))
        log.info(
            "step_planned",
            run_id=run_id,
            step=step,
            tool_calls=len(result.calls),
            final=result.final,
            input_tokens=result.usage.input_tokens,
            output_tokens=result.usage.output_tokens,
            cost_usd_micros=result.usage.cost_usd_micros,
            model_calls=result.model_calls,
            attempts=result.attempts,
            compacted=result.compacted,
        )
        new_state = st.finish_step(
            state, step, messages=result.messages, base_len=result.base_len, usage=result.usage, final=result.final
        )
    else:
        detail = deps.scrub(result.detail)[: deps.limits.detail_max_chars]
        records.append((
            ModelCallFailed(
                step=step, error_code=result.error_code, detail=detail, attempts=result.attempts, usage=_usage(result.usage),
                usage_estimated=result.usage_estimated,
            ),
            (step,),
        ))
        log.warning("step_failed", run_id=run_id, step=step, error_code=result.error_code, detail=detail)
        new_state = st.finish_step(
            state, step, messages=result.messages, base_len=result.base_len, usage=result.usage, final=False
        )
    return records, new_state


def _observe(result: StepResult, provider: str, model: str, deps: Deps) -> None:
    m = deps.metrics
    outcome = ("final" if result.final else "tool_calls") if isinstance(result, StepSucceeded) else result.error_code
    m.steps.labels(provider, outcome).inc()
    m.model_calls.labels(provider).inc(result.model_calls)
    m.tokens.labels(provider, "input").inc(result.usage.input_tokens)
    m.tokens.labels(provider, "output").inc(result.usage.output_tokens)
    m.cost.labels(provider).inc(result.usage.cost_usd_micros)
    repairs = sum(1 for msg in result.messages if msg.role == "assistant" and msg.repair and msg.step == result.step)
    if repairs:
        m.repairs.inc(repairs)
    if result.compacted:
        m.compactions.inc()
    if isinstance(result, StepSucceeded):
        m.step_seconds.observe(result.latency_ms / 1000)
    if not result.priced:
        m.unpriced.labels(model).inc()
        log.warning("model_not_in_pricing_table", model=model, pricing_version=deps.pricing.version)


HANDLERS: dict[type[AvroRecord], Callable[..., None]] = {
    RunAccepted: on_run_accepted,
    StepGranted: on_step_granted,
    ToolCallCompleted: on_tool_outcome,
    ToolCallFailed: on_tool_outcome,
    ToolCallDenied: on_tool_outcome,
    ToolCallOutcomeUnknown: on_tool_outcome,
    ModelCallCompleted: on_model_call_completed,
    ToolCallRequested: on_tool_call_requested,
    ModelCallFailed: on_model_call_failed,
    RunCompleted: on_run_ended,
    RunTerminated: on_run_ended,
}
