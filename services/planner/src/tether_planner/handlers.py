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
from tether_messaging.topics import Topics
from tether_planner.domain import state as st
from tether_planner.domain.canonical import args_hash, call_id, idem_key
from tether_planner.domain.messages import ToolCallRef, UsageTotals
from tether_planner.domain.redaction import Scrubber
from tether_planner.metrics import PlannerMetrics
from tether_planner.pricing import PricingTable
from tether_planner.providers.registry import ProviderRegistry
from tether_planner.step import PROVIDER_ERROR, StepConfig, StepFailed, StepInput, StepResult, StepSucceeded, run_step

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
    ctx.put_state(run_id, st.new_run(accepted, msg.envelope.tenant_id, msg.envelope.seq))


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
        state = st.grant_step(state, granted, msg.envelope.event_id, msg.envelope.seq)
        ctx.put_state(run_id, state)
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
    message = st.tool_result_message(state, outcome, max_chars=deps.limits.tool_result_max_chars)
    ctx.put_state(run_id, st.record_tool_outcome(state, message, msg.envelope.seq))


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
    ctx.put_state(run_id, st.record_model_call_seen(state, event.step, event.assistant_text, usage, msg.envelope.seq))


def on_tool_call_requested(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id, event = msg.envelope.run_id, msg.payload
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.seen(msg.envelope.seq) or not isinstance(event, ToolCallRequested):
        return
    c = event.call
    if st.has_tool_call(state, event.step, c.call_id):
        return  # an echo of a call already in the step's assistant message
    ref = ToolCallRef(id=c.provider_call_id or c.call_id, name=c.tool_name, arguments=c.args_json, call_id=c.call_id)
    ctx.put_state(run_id, st.record_tool_call_seen(state, event.step, ref, msg.envelope.seq))


def on_model_call_failed(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    run_id, event = msg.envelope.run_id, msg.payload
    state: st.RunState | None = ctx.get_state(run_id)
    if state is None or state.seen(msg.envelope.seq) or not isinstance(event, ModelCallFailed):
        return
    if event.step <= state.done_step:
        return  # an echo: the step is done (and a later pending step is not this one)
    ctx.put_state(run_id, st.record_step_failed_seen(state, event.step, msg.envelope.seq))


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
    model = ModelRef(
        provider=state.model.provider, name=state.model.name, context_window_tokens=state.model.context_window_tokens
    )
    provider = state.model.provider
    _observe(result, provider, state.model.name, deps)
    if isinstance(result, StepSucceeded):
        text = deps.scrub(result.text)
        _emit(
            ctx,
            deps,
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
            ),
            run_id,
            state,
            (step,),
            cause,
        )
        # The run ended while the model was thinking (cancel, cap): the call's usage is recorded,
        # but nothing it proposed is: no tool call is requested and no answer given for an ended run.
        for c in [] if state.ended else result.calls:
            cid = call_id(step, c.call_index)
            _emit(
                ctx,
                deps,
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
                run_id,
                state,
                (cid,),
                cause,
            )
        if result.final and not state.ended:
            _emit(
                ctx,
                deps,
                RunCompleted(
                    step=step,
                    answer=text[: deps.limits.answer_max_chars],
                    usage=_usage(state.usage + result.usage),
                ),
                run_id,
                state,
                (step,),
                cause,
            )
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
        _emit(
            ctx,
            deps,
            ModelCallFailed(
                step=step, error_code=result.error_code, detail=detail, attempts=result.attempts, usage=_usage(result.usage)
            ),
            run_id,
            state,
            (step,),
            cause,
        )
        log.warning("step_failed", run_id=run_id, step=step, error_code=result.error_code, detail=detail)
        new_state = st.finish_step(
            state, step, messages=result.messages, base_len=result.base_len, usage=result.usage, final=False
        )
    if state.ended:
        log.info("model_call_recorded_after_run_end", run_id=run_id, step=step)
        new_state = None
    ctx.put_state(run_id, new_state)


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
