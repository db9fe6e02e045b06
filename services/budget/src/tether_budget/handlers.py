"""Handlers of the budget processor: load the run's ledger, ask the domain, seal and append the plan.

Each handler is a plain function (record first, dependencies as named parameters); the tables
mapping record types to handlers are at the bottom. Domain guards raise `ProtocolViolation`;
the processor turns them into dead letters.

A run whose submit carried tenant limits holds a place in its tenant's ledger on the lane
(`tenant:<id>`, domain/tenancy.py): the handlers load it with the run's ledger, let the domain
decide with both, and when the run ends free its slot and accept the next queued run, all in
the same transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from tether_budget.domain.decisions import (
    INTAKE_TYPES,
    AdmissionPolicy,
    AppendRecord,
    Plan,
    Retention,
    admit,
    admit_queued,
    cancel,
    fold,
    grant_deferred,
    resubmit,
    tick,
    tick_due,
)
from tether_budget.domain.errors import ProtocolViolation, UnknownRun
from tether_budget.domain.ledger import Ledger, Reason, negative_usage_fields
from tether_budget.domain.loopguard import LoopGuard
from tether_budget.domain.tenancy import TenantLedger, no_limits, tenant_key
from tether_budget.metrics import BudgetMetrics
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    CancelRun,
    DecideApproval,
    Envelope,
    ModelCallCompleted,
    ModelCallFailed,
    RunAccepted,
    RunCompleted,
    RunQueued,
    RunRejected,
    RunTerminated,
    StepDeferred,
    StepGranted,
    SubmitRun,
    ToolCallBudgeted,
    Usage,
)
from tether_messaging.chain import seal
from tether_messaging.envelopes import derived_id, make_envelope
from tether_messaging.processor import Context, Inbound, TickContext
from tether_messaging.topics import Topics

PRODUCER = "budget"

log = structlog.get_logger("tether_budget")


@dataclass(frozen=True)
class Deps:
    """What the handlers need besides the record and the context; built by the bootstrap."""

    topics: Topics
    policy: AdmissionPolicy
    guard: LoopGuard
    retention: Retention
    metrics: BudgetMetrics


# -- shared steps ----------------------------------------------------------------------------


def _load(ctx: Context, run_id: str) -> Ledger | None:
    state = ctx.get_state(run_id)
    # A working copy: the loop keeps the committed object for undo, and a refused record
    # must leave it untouched.
    return None if state is None else state.clone()


def _load_tenant(ctx: Context, tenant_id: str) -> TenantLedger:
    state = ctx.get_state(tenant_key(tenant_id))
    return state.clone() if isinstance(state, TenantLedger) else TenantLedger(tenant_id=tenant_id)


def _save_tenant(tenant: TenantLedger | None, ctx: Context) -> None:
    if tenant is not None and tenant.touched:
        ctx.put_state(tenant_key(tenant.tenant_id), tenant)


def _report_negative_usage(msg: Inbound, *, deps: Deps) -> None:
    # The ledger counted them as 0; the record itself is appended as it came.
    if not isinstance(msg.payload, ModelCallCompleted | ModelCallFailed):
        return
    fields = negative_usage_fields(msg.payload.usage)
    if fields:
        log.warning("negative_usage_clamped", run_id=msg.envelope.run_id, event_id=msg.envelope.event_id,
                    event_type=type(msg.payload).__name__, fields=fields)
        for field in fields:
            deps.metrics.usage_clamped.labels(field).inc()


def _model_call_open(ledger: Ledger) -> int | None:
    """The granted step whose model call has no recorded outcome yet, if any."""
    cur = ledger.current
    return cur.step if cur is not None and not cur.model_done else None


def _settle_usage(
    ledger: Ledger, before: Usage, tenant: TenantLedger | None, now_ms: int, *, model_call_returned: bool
) -> None:
    """Charge the tenant with the usage the record added to the run (its spend window, its token
    bucket in place of the grant's reservation). Settled whenever the granted step's model call
    returned, even with zero usage: its reservation must make way for the real usage (none)."""
    if tenant is None or (ledger.usage == before and not model_call_returned):
        return
    tokens = ledger.tokens_used - (before.input_tokens + before.output_tokens)
    cost = ledger.usage.cost_usd_micros - before.cost_usd_micros
    tenant.record_usage(tokens, cost, reserved_tokens=ledger.rate_reserved, reserved_cost=ledger.spend_reserved,
                        now_ms=now_ms)
    ledger.rate_reserved = ledger.spend_reserved = 0


def _release_if_ended(ledger: Ledger, was_open: bool, tenant: TenantLedger | None) -> bool:
    """A run that held a place in its tenant's ledger ended: free it. True if a slot may be free."""
    if tenant is None or not was_open or ledger.open:
        return False
    tenant.release(ledger.run_id, held_slot=ledger.holds_tenant_slot, reserved_tokens=ledger.rate_reserved,
                   reserved_cost=ledger.spend_reserved)
    ledger.holds_tenant_slot = False
    ledger.rate_reserved = ledger.spend_reserved = 0
    return True


def admit_from_queue(tenant: TenantLedger, ctx: Context, *, deps: Deps) -> None:
    """Accept queued runs, first in line first, while the tenant has free slots on this lane."""
    while (run_id := tenant.next_queued()) is not None:
        queued = _load(ctx, run_id)
        if queued is None or not queued.queued:
            log.warning("queued_run_missing", tenant_id=tenant.tenant_id, run_id=run_id)
            continue
        plan = admit_queued(queued, tenant, now_ms=ctx.now_ms)
        _release_if_ended(queued, True, tenant)
        write_plan(plan, queued, ctx, deps=deps, inbound=None)


def grant_from_line(tenant: TenantLedger, ctx: Context, *, deps: Deps) -> bool:
    """Grant deferred steps, longest waiting first, while the tenant's bucket allows. True if a
    run ended instead (over the spend cap, out of wall clock), so a slot may be free."""
    freed = False
    while (run_id := tenant.next_deferred(ctx.now_ms)) is not None:
        ledger = _load(ctx, run_id)
        if ledger is None:
            continue
        plan = grant_deferred(ledger, tenant, now_ms=ctx.now_ms)
        freed = _release_if_ended(ledger, True, tenant) or freed
        write_plan(plan, ledger, ctx, deps=deps, inbound=None)
    return freed


def serve_tenant(tenant: TenantLedger | None, ctx: Context, *, deps: Deps, freed: bool = False) -> None:
    """After any change to the tenant's ledger: accept queued runs into free slots, and grant the
    deferred line as far as the bucket allows now. A grant behind a non-empty line is deferred
    (decisions._grant_or_stop), so the line is served here at once rather than on the next tick
    (about a second later), and waiting in line adds no latency while the bucket has room."""
    if tenant is None:
        return
    while True:
        if freed:
            admit_from_queue(tenant, ctx, deps=deps)
        freed = grant_from_line(tenant, ctx, deps=deps)
        if not freed:
            return


def _decision_envelope(
    payload: AvroRecord, what: tuple, ledger: Ledger, ctx: Context, cause: Envelope | None
) -> Envelope:
    return make_envelope(
        payload,
        run_id=ledger.run_id,
        tenant_id=ledger.tenant_id,
        event_id=derived_id(ledger.run_id, *what),
        producer=PRODUCER,
        recorded_at_ms=ctx.now_ms,
        causation_id=cause.event_id if cause else None,
        traceparent=cause.traceparent if cause else None,
    )


def write_plan(plan: Plan, ledger: Ledger, ctx: Context, *, deps: Deps, inbound: Envelope | None) -> None:
    """Seal the plan's records onto the run's chain, append them to the log, checkpoint the ledger."""
    metrics = deps.metrics
    for entry in plan.entries:
        if isinstance(entry, AppendRecord):
            if inbound is None:
                raise ProtocolViolation("NOTHING_TO_APPEND", "a plan without an input record appended one")
            envelope, payload = inbound, None
        else:
            envelope, payload = _decision_envelope(entry.payload, entry.what, ledger, ctx, inbound), entry.payload
        if envelope.event_id in ledger.seen_event_ids:
            # Deterministic ids: the same decision was already appended; appending it again
            # would put one fact in the log twice.
            log.warning("decision_already_sequenced", run_id=ledger.run_id, event_id=envelope.event_id)
            continue
        sealed = seal(envelope, ledger.seq + 1, ledger.last_hash)
        ctx.emit_envelope(deps.topics.run_events, sealed)
        ledger.record_appended(sealed.event_id, sealed.seq or 0, sealed.hash or "")
        metrics.events_sequenced.labels(sealed.event_type).inc()
        _count(payload, sealed, metrics)
    if plan.detection is not None:
        stopped = any(
            not isinstance(e, AppendRecord)
            and isinstance(e.payload, RunTerminated)
            and e.payload.reason_code == Reason.LOOP_DETECTED
            for e in plan.entries
        )
        metrics.loop_detections.labels(plan.detection.rule.value, "terminate" if stopped else "warn").inc()
        log.info("loop_detected", run_id=ledger.run_id, rule=plan.detection.rule.value, terminate=stopped)
    if plan.dropped is not None:
        metrics.records_dropped.labels(plan.dropped).inc()
        log.info(
            "record_dropped",
            run_id=ledger.run_id,
            reason=plan.dropped,
            event_id=inbound.event_id if inbound else None,
            event_type=inbound.event_type if inbound else None,
        )
    if plan.entries or plan.dropped is None:
        ctx.put_state(ledger.run_id, ledger)  # a dropped record changed nothing worth a checkpoint


def _count(payload: AvroRecord | None, sealed: Envelope, metrics: BudgetMetrics) -> None:
    if payload is None:
        if sealed.event_type == RunCompleted.AVRO_NAME:
            metrics.runs_completed.inc()
        return
    if isinstance(payload, RunAccepted):
        metrics.runs_accepted.inc()
    elif isinstance(payload, RunQueued):
        metrics.runs_queued.inc()
    elif isinstance(payload, StepDeferred):
        metrics.steps_deferred.inc()
    elif isinstance(payload, RunRejected):
        metrics.runs_rejected.labels(payload.reason_code).inc()
    elif isinstance(payload, RunTerminated):
        metrics.runs_terminated.labels(payload.reason_code).inc()
        log.info("run_terminated", run_id=sealed.run_id, reason=payload.reason_code, detail=payload.report.detail)
    elif isinstance(payload, StepGranted):
        metrics.steps_granted.inc()
    elif isinstance(payload, ToolCallBudgeted):
        metrics.tool_calls_budgeted.inc()


# -- commands --------------------------------------------------------------------------------


def submit_run(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """SubmitRun → RunAccepted + StepGranted(1), RunQueued (the tenant is at its concurrency cap
    on this lane), or RunRejected; a repeated submit is dropped."""
    env, command = msg.envelope, msg.payload
    existing = _load(ctx, env.run_id)
    if existing is not None:
        write_plan(resubmit(existing, command, event_id=env.event_id), existing, ctx, deps=deps, inbound=env)
        return
    tenant = None
    limits = command.tenant_limits
    if limits is not None and (not no_limits(limits) or ctx.get_state(tenant_key(env.tenant_id)) is not None):
        # A tenant without limits has no ledger (and its runs cost nothing here), unless it had
        # limits before: then its ledger takes the new limits and lets the queue go.
        tenant = _load_tenant(ctx, env.tenant_id)
    ledger, plan = admit(
        command,
        run_id=env.run_id,
        tenant_id=env.tenant_id,
        partition=ctx.partition,
        event_id=env.event_id,
        now_ms=ctx.now_ms,
        policy=deps.policy,
        tenant=tenant,
    )
    write_plan(plan, ledger, ctx, deps=deps, inbound=env)
    if tenant is not None:
        serve_tenant(tenant, ctx, deps=deps, freed=True)  # the new limits may have freed slots
        _save_tenant(tenant, ctx)


def cancel_run(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """CancelRun → RunTerminated(CANCELLED) with the run's report."""
    env = msg.envelope
    ledger = _load(ctx, env.run_id)
    if ledger is None:
        raise UnknownRun(env.run_id)
    was_open = ledger.open
    plan = cancel(ledger, msg.payload, tenant_id=env.tenant_id, now_ms=ctx.now_ms)
    tenant = _load_tenant(ctx, ledger.tenant_id) if ledger.tenant_tracked else None
    freed = _release_if_ended(ledger, was_open, tenant)
    write_plan(plan, ledger, ctx, deps=deps, inbound=env)
    serve_tenant(tenant, ctx, deps=deps, freed=freed)
    _save_tenant(tenant, ctx)


def not_ours(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """Commands on the shared topic that another service handles (DecideApproval: approval)."""


# -- intake ----------------------------------------------------------------------------------


def sequence_intake(msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """Any intake record: append it to the run's log (or drop it) with the decisions it triggers."""
    env = msg.envelope
    ledger = _load(ctx, env.run_id)
    if ledger is None:
        raise UnknownRun(env.run_id)
    if ctx.partition != ledger.partition:
        raise ProtocolViolation(
            "WRONG_PARTITION", f"run {env.run_id} lives on partition {ledger.partition}, record came on {ctx.partition}"
        )
    tenant = _load_tenant(ctx, ledger.tenant_id) if ledger.tenant_tracked else None
    if tenant is not None and ledger.active and ledger.run_id not in tenant.deferred:
        # Runs already waiting go before a grant this record may bring (this run's own ledger is
        # in hand, so only while it is not one of them).
        serve_tenant(tenant, ctx, deps=deps)
    was_open, usage_before, model_call_open = ledger.open, ledger.usage, _model_call_open(ledger)
    plan = fold(
        ledger,
        msg.payload,
        event_id=env.event_id,
        tenant_id=env.tenant_id,
        guard=deps.guard,
        now_ms=ctx.now_ms,
        tenant=tenant,
    )
    returned = model_call_open is not None and _model_call_open(ledger) != model_call_open
    _report_negative_usage(msg, deps=deps)
    _settle_usage(ledger, usage_before, tenant, ctx.now_ms, model_call_returned=returned)
    freed = _release_if_ended(ledger, was_open, tenant)
    write_plan(plan, ledger, ctx, deps=deps, inbound=env)
    serve_tenant(tenant, ctx, deps=deps, freed=freed)
    _save_tenant(tenant, ctx)


# -- timers ----------------------------------------------------------------------------------


def check_run_timers(run_id: str, ctx: Context, *, deps: Deps) -> None:
    """Wall-clock cap of an active run; retention of an ended one."""
    state = ctx.get_state(run_id)
    if not isinstance(state, Ledger) or not tick_due(state, now_ms=ctx.now_ms, retention=deps.retention):
        return
    ledger = state.model_copy(deep=True)
    was_open = ledger.open
    result = tick(ledger, now_ms=ctx.now_ms, retention=deps.retention)
    if result.forget:
        ctx.put_state(run_id, None)
    elif result.changed:
        tenant = _load_tenant(ctx, ledger.tenant_id) if ledger.tenant_tracked else None
        freed = _release_if_ended(ledger, was_open, tenant)
        write_plan(result.plan, ledger, ctx, deps=deps, inbound=None)
        serve_tenant(tenant, ctx, deps=deps, freed=freed)
        _save_tenant(tenant, ctx)


def check_tenant_timers(key: str, ctx: Context, *, deps: Deps) -> None:
    """Grants deferred by the tenant's token rate, longest waiting first, once its bucket refills."""
    state = ctx.get_state(key)
    if not isinstance(state, TenantLedger) or not state.deferred or not state.rate_allows(ctx.now_ms):
        return
    tenant = state.clone()
    serve_tenant(tenant, ctx, deps=deps)
    _save_tenant(tenant, ctx)


def check_timers(ctx: TickContext, *, deps: Deps) -> None:
    """Run the due timers of the run and tenant ledgers in the partitions this instance owns."""
    for partition in ctx.owned_partitions():
        pctx = ctx.for_partition(partition)
        for key in ctx.runs_due(partition):
            if key.startswith("tenant:"):
                check_tenant_timers(key, pctx, deps=deps)
            else:
                check_run_timers(key, pctx, deps=deps)


Handler = Callable[..., None]

COMMAND_HANDLERS: dict[type[AvroRecord], Handler] = {
    SubmitRun: submit_run,
    CancelRun: cancel_run,
    DecideApproval: not_ours,
}

INTAKE_HANDLERS: dict[type[AvroRecord], Handler] = {record_type: sequence_intake for record_type in INTAKE_TYPES}
