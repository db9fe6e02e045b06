"""Handlers of the approval processor: load the run's approvals, ask the domain, emit the decision.

Each handler is a plain function (record first, dependencies as named parameters); the tables
mapping record types to handlers are at the bottom. A refused decision is logged
(`decision_refused`, with reason and facts) and counted (`tether_approval_refusals_total`). One
recorded in time but read after its approval expired (DECISION_AFTER_EXPIRY) is also counted in
`tether_approval_decisions_after_expiry_total` and recorded on the log as an
`ApprovalDecisionRefused`: a human's decision that did not take effect is part of the run's record.
Every other refusal emits nothing (run-api refuses those before it takes a decision, or it is a
duplicate; a stranger's command must not write into a run's log).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from tether_approval.domain.decisions import (
    ApprovalPolicy,
    call_finished,
    concerns_call,
    drop_stale_early,
    expire_due,
    park_early,
    record_decided,
    record_request,
    request_for_unknown_outcome,
    take_early,
    track_call,
    validate_decision,
)
from tether_approval.domain.errors import ApprovalNotFound, DecisionAfterExpiry, DecisionRefused, WrongTenant
from tether_approval.domain.state import Notification, OpenCall, RunApprovals
from tether_approval.metrics import ApprovalMetrics
from tether_approval.notifier import ApprovalNotification, ApproverNotifier, Delivery
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalRequested,
    DecideApproval,
    RunAccepted,
    RunCompleted,
    RunTerminated,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
)
from tether_messaging.envelopes import derived_id
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.topics import Topics

PRODUCER = "approval"
NOTIFY_PREFIX = "notify:"

log = structlog.get_logger("tether_approval")


@dataclass(frozen=True)
class Deps:
    """What the handlers need besides the record and the context; built by the bootstrap."""

    topics: Topics
    policy: ApprovalPolicy
    metrics: ApprovalMetrics
    notifier: ApproverNotifier | None = None


def decided_event_id(run_id: str, approval_id: str) -> str:
    """One event id for any decision of an approval, so at most one is ever sequenced."""
    return derived_id(run_id, PRODUCER, "approval-decided", approval_id)


def refused_event_id(run_id: str, command_event_id: str) -> str:
    """One event id per refused command: re-reading the command after a crash emits the same record."""
    return derived_id(run_id, PRODUCER, "approval-decision-refused", command_event_id)


def outcome_unknown_request_event_id(run_id: str, call_id: str) -> str:
    return derived_id(run_id, PRODUCER, "approval-requested", "outcome-unknown", call_id)


def notify_key(approval_id: str) -> str:
    return NOTIFY_PREFIX + approval_id


# -- shared steps ----------------------------------------------------------------------------


def _load(ctx: Context, run_id: str) -> RunApprovals | None:
    state = ctx.get_state(run_id)
    # A working copy: the loop keeps the committed object to undo a failed batch.
    return None if state is None else state.model_copy(deep=True)


def _load_or_new(ctx: Context, run_id: str, tenant_id: str) -> RunApprovals:
    run = _load(ctx, run_id)
    if run is None:
        run = RunApprovals(run_id=run_id, tenant_id=tenant_id)
    elif run.tenant_id is None:
        run.tenant_id = tenant_id  # state begun by an early decision; the log now names the tenant
    return run


def _refused(refusal: DecisionRefused, command: DecideApproval, *, run_id: str, tenant_id: str,
             event_id: str, deps: Deps) -> None:
    deps.metrics.refusals.labels(refusal.reason).inc()
    if isinstance(refusal, DecisionAfterExpiry):
        deps.metrics.decisions_after_expiry.labels("approve" if command.approve else "reject").inc()
    fields = {
        "reason": refusal.reason,
        "detail": refusal.detail,
        "run_id": run_id,
        "tenant_id": tenant_id,
        "approval_id": command.approval_id,
        "call_id": command.call_id,
        "approver_id": command.approver_id,
        "approve": command.approve,
        "command_event_id": event_id,
    }
    log.warning("decision_refused", **{**refusal.facts, **fields})


def _emit_decision(decided: ApprovalDecided, run: RunApprovals, ctx: Context, deps: Deps, cause: str) -> None:
    ctx.emit(
        deps.topics.run_intake,
        decided,
        run_id=run.run_id,
        tenant_id=run.tenant_id or "",
        event_id=decided_event_id(run.run_id, decided.approval_id),
        causation_id=cause,
    )
    deps.metrics.decisions.labels(decided.outcome.value).inc()
    log.info(
        "approval_decided",
        run_id=run.run_id,
        approval_id=decided.approval_id,
        call_id=decided.call_id,
        outcome=decided.outcome.value,
        approver_id=decided.approver_id,
    )


def _record_refusal(refusal: DecisionAfterExpiry, command: DecideApproval, run: RunApprovals, *,
                    decided_at_ms: int, event_id: str, ctx: Context, deps: Deps) -> None:
    """Put a decision that came in time but was read after the expiry on the log (budget sequences it)."""
    approval = run.approvals[command.approval_id]
    ctx.emit(
        deps.topics.run_intake,
        ApprovalDecisionRefused(
            approval_id=approval.approval_id,
            call_id=approval.call_id,
            approver_id=command.approver_id,
            approve=command.approve,
            comment=command.comment,
            reason=refusal.reason,
            detail=refusal.detail,
            decided_at_ms=decided_at_ms,
            expires_at_ms=approval.expires_at_ms,
        ),
        run_id=run.run_id,
        tenant_id=run.tenant_id or "",
        event_id=refused_event_id(run.run_id, event_id),
        causation_id=event_id,
    )


def _decide(command: DecideApproval, run: RunApprovals, *, tenant_id: str, decided_at_ms: int, event_id: str,
            ctx: Context, deps: Deps) -> None:
    try:
        decided = validate_decision(command, run, tenant_id=tenant_id, decided_at_ms=decided_at_ms, policy=deps.policy)
    except DecisionRefused as refusal:
        _refused(refusal, command, run_id=run.run_id, tenant_id=tenant_id, event_id=event_id, deps=deps)
        if isinstance(refusal, DecisionAfterExpiry):
            _record_refusal(refusal, command, run, decided_at_ms=decided_at_ms, event_id=event_id, ctx=ctx, deps=deps)
        return
    record_decided(run, decided)
    _emit_decision(decided, run, ctx, deps, cause=event_id)


def _start_notification(event: ApprovalRequested, msg: Inbound, ctx: Context, deps: Deps) -> None:
    notifier = deps.notifier
    if notifier is None:
        return
    notification = ApprovalNotification.from_request(
        event, run_id=msg.envelope.run_id, tenant_id=msg.envelope.tenant_id,
        requested_at_ms=msg.envelope.recorded_at_ms,
    )
    ctx.start_work(notify_key(event.approval_id), msg.envelope.run_id, msg.envelope.tenant_id,
                   lambda: notifier.notify(notification))


# -- run events ------------------------------------------------------------------------------


def on_run_accepted(event: RunAccepted, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """Remember who submitted the run (self-approval rule) and its tools' risk classes."""
    run = _load_or_new(ctx, msg.envelope.run_id, msg.envelope.tenant_id)
    run.tenant_id = msg.envelope.tenant_id
    run.submitter_id = event.principal_id
    run.tool_risk = {tool.name: tool.risk_class for tool in event.tools}
    run.unknown_outcome_tools = sorted(tool.name for tool in event.tools if not tool.idempotent)
    ctx.put_state(run.run_id, run)


def on_tool_call_requested(event: ToolCallRequested, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """Remember the call's arguments until its outcome is known (an unknown outcome needs them).

    Only calls of non-idempotent tools: most calls change nothing here, so most steps cost this
    service no checkpoint and (with nothing else in the batch) no Kafka transaction."""
    run = _load_or_new(ctx, msg.envelope.run_id, msg.envelope.tenant_id)
    call = event.call
    if track_call(run, OpenCall(
        step=event.step, call_id=call.call_id, idem_key=call.idem_key, tool_name=call.tool_name,
        args_json=call.args_json, args_hash=call.args_hash, provenance_json=event.provenance_json,
    )):
        ctx.put_state(run.run_id, run)


def on_call_finished(event: AvroRecord, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """A terminal outcome (Completed, Failed, Denied): forget the call and any approval it no longer needs."""
    run = _load(ctx, msg.envelope.run_id)
    call_id = event.call_id  # type: ignore[attr-defined]
    if run is None or not concerns_call(run, call_id):
        return  # nothing to forget: no checkpoint
    moot = call_finished(run, call_id, msg.envelope.event_type)
    for approval in moot:
        log.info("approval_moot", run_id=run.run_id, approval_id=approval.approval_id, call_id=call_id,
                 outcome_event=msg.envelope.event_type)
    ctx.put_state(run.run_id, run)


def on_outcome_unknown(event: ToolCallOutcomeUnknown, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """A non-idempotent call's outcome is unknown: ask a human whether the run may go on."""
    run = _load(ctx, msg.envelope.run_id)
    request = None if run is None else request_for_unknown_outcome(
        run, event, now_ms=ctx.now_ms, policy=deps.policy
    )
    if run is None or request is None:
        if run is None or event.call_id not in run.open_calls:
            log.warning("outcome_unknown_without_call", run_id=msg.envelope.run_id, call_id=event.call_id)
        return
    ctx.emit(
        deps.topics.run_intake,
        request,
        run_id=run.run_id,
        tenant_id=run.tenant_id or msg.envelope.tenant_id,
        event_id=outcome_unknown_request_event_id(run.run_id, event.call_id),
        causation_id=msg.envelope.event_id,
    )
    deps.metrics.outcome_unknown_requests.inc()
    log.info("outcome_unknown_approval_requested", run_id=run.run_id, call_id=event.call_id,
             approval_id=request.approval_id)
    ctx.put_state(run.run_id, run)


def on_approval_requested(event: ApprovalRequested, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """Park the call: a pending approval, the approvers told, a decision that came early applied."""
    run = _load(ctx, msg.envelope.run_id)
    if run is None or not run.accepted:
        # RunAccepted precedes every ApprovalRequested on the run's log partition and its state
        # lives until RunCompleted/RunTerminated drops it, so a request finding no accepted state
        # is for a run that has ended: the held input of its webhook, re-delivered after the end
        # was committed (a crash, or a hand-over while the webhook still retried). Folding it
        # would revive the run here: pending again, the webhook re-sent, EXPIRED emitted, and a
        # state that no run end would drop. (A state without RunAccepted holds only decisions
        # read after the end or before the start; their TTL refuses and drops them.)
        log.info("approval_request_after_run_end", run_id=msg.envelope.run_id, approval_id=event.approval_id)
        return
    approval = record_request(run, event, event_id=msg.envelope.event_id, notify=deps.notifier is not None)
    if approval is None:
        known = run.approvals[event.approval_id]
        if known.pending and known.notification is Notification.SENDING:
            # A held input re-delivered after a failover: the webhook did not finish; send it again.
            _start_notification(event, msg, ctx, deps)
        return
    for reason in approval.reasons or ["UNSPECIFIED"]:
        deps.metrics.requested.labels(reason).inc()
    log.info("approval_requested", run_id=run.run_id, approval_id=approval.approval_id, call_id=approval.call_id,
             tool_name=approval.tool_name, reasons=approval.reasons, expires_at_ms=approval.expires_at_ms)
    _start_notification(event, msg, ctx, deps)
    early = take_early(run, approval.approval_id)
    if early is not None:
        _decide(early.command, run, tenant_id=early.tenant_id, decided_at_ms=early.decided_at_ms,
                event_id=early.event_id, ctx=ctx, deps=deps)
    ctx.put_state(run.run_id, run)


def on_approval_decided(event: ApprovalDecided, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """A decision reached the log (ours, sequenced): the approval is no longer pending."""
    run = _load(ctx, msg.envelope.run_id)
    if run is not None and record_decided(run, event):
        ctx.put_state(run.run_id, run)


def on_run_ended(event: AvroRecord, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """Nothing runs after RunTerminated/RunCompleted: drop the run's approvals."""
    run = ctx.get_state(msg.envelope.run_id)
    if run is None:
        return
    pending = [a.approval_id for a in run.pending()]
    if pending:
        log.info("pending_approvals_dropped", run_id=msg.envelope.run_id, approvals=pending,
                 ended_by=msg.envelope.event_type)
    ctx.put_state(msg.envelope.run_id, None)


# -- commands --------------------------------------------------------------------------------


def on_decide_approval(command: DecideApproval, msg: Inbound, ctx: Context, *, deps: Deps) -> None:
    """An approver's decision: valid → ApprovalDecided to intake; refused → logged and counted (and,
    read after its approval expired, ApprovalDecisionRefused to intake)."""
    run_id, tenant_id, event_id = msg.envelope.run_id, msg.envelope.tenant_id, msg.envelope.event_id
    decided_at_ms = msg.envelope.recorded_at_ms  # when the approver decided, as run-api recorded it
    run = _load(ctx, run_id)
    if run is None or command.approval_id not in run.approvals:
        if run is not None and run.tenant_id is not None and run.tenant_id != tenant_id:
            refusal: DecisionRefused = WrongTenant(f"tenant {tenant_id} may not decide approvals of run {run_id}")
            _refused(refusal, command, run_id=run_id, tenant_id=tenant_id, event_id=event_id, deps=deps)
            return
        run = run or RunApprovals(run_id=run_id)
        try:
            park_early(run, command, tenant_id=tenant_id, decided_at_ms=decided_at_ms, event_id=event_id,
                       policy=deps.policy)
        except DecisionRefused as refused:
            _refused(refused, command, run_id=run_id, tenant_id=tenant_id, event_id=event_id, deps=deps)
            return
        deps.metrics.early_decisions.inc()
        log.info("decision_parked", run_id=run_id, approval_id=command.approval_id, command_event_id=event_id)
        ctx.put_state(run_id, run)
        return
    _decide(command, run, tenant_id=tenant_id, decided_at_ms=decided_at_ms, event_id=event_id, ctx=ctx, deps=deps)
    ctx.put_state(run_id, run)


# -- finished work and timers ----------------------------------------------------------------


def on_notification_done(done: WorkDone, ctx: Context, *, deps: Deps) -> None:
    """The webhook finished (delivered or given up): record it; the run never waits for it."""
    approval_id = done.key.removeprefix(NOTIFY_PREFIX)
    if done.error is None:
        result = Notification.DELIVERED
        delivery: Delivery = done.result
        log.info("approval_webhook_delivered", run_id=done.run_id, approval_id=approval_id,
                 status=delivery.status_code, attempts=delivery.attempts)
    else:
        result = Notification.FAILED
        log.warning("approval_webhook_failed", run_id=done.run_id, approval_id=approval_id,
                    error=f"{type(done.error).__name__}: {done.error}",
                    attempts=getattr(done.error, "attempts", None))
    deps.metrics.webhook.labels(result.value.lower()).inc()
    run = _load(ctx, done.run_id)
    approval = None if run is None else run.approvals.get(approval_id)
    if run is not None and approval is not None and approval.notification is Notification.SENDING:
        approval.notification = result
        ctx.put_state(run.run_id, run)


def _needs_tick(run: RunApprovals, read_through_ms: int, policy: ApprovalPolicy) -> bool:
    return any(read_through_ms > a.expires_at_ms + policy.expiry_grace_ms for a in run.pending()) or any(
        read_through_ms - e.decided_at_ms > policy.early_decision_ttl_ms for e in run.early.values()
    )


def _empty(run: RunApprovals) -> bool:
    return run.tenant_id is None and not (run.approvals or run.open_calls or run.early)


def expire_approvals(ctx: TickContext, *, deps: Deps) -> None:
    """Every tick: EXPIRED (decided at ctx.now_ms) for pending approvals whose expires_at_ms and grace lie
    before the time the partition's commands and run events are read through, and refuse early decisions
    whose request never came (in the runs due by `domain.decisions.wake_at`; `domain.decisions.expire_due`
    says why the read-through time and not the clock). Only on the partitions whose input backlog at
    assignment is read: the loop shows no other (`tick_after_backlog`)."""
    now_ms = ctx.now_ms
    for partition in ctx.owned_partitions():
        due = ctx.runs_due(partition)
        if not due:
            continue  # not asked: a partition with nothing due costs no end-offset requests
        read_through_ms = ctx.inputs_read_through_ms(partition)
        pctx = ctx.for_partition(partition)
        for run_id in due:
            committed = pctx.get_state(run_id)
            if committed is None:
                continue
            if not _needs_tick(committed, read_through_ms, deps.policy):
                # Due by the clock, not yet by what is read (the loop is behind): it stays due and the
                # next tick looks again. The runs come earliest wake time first, and `wake_at` is exact,
                # so none after it has work either: a partition behind its input decodes one state a tick.
                break
            run = committed.model_copy(deep=True)
            for decided in expire_due(run, read_through_ms, deps.policy, now_ms=now_ms):
                _emit_decision(decided, run, pctx, deps, cause=run.approvals[decided.approval_id].requested_event_id)
            for early in drop_stale_early(run, read_through_ms, deps.policy):
                refusal = ApprovalNotFound(f"approval {early.command.approval_id} was never requested")
                _refused(refusal, early.command, run_id=run_id, tenant_id=early.tenant_id, event_id=early.event_id,
                         deps=deps)
            pctx.put_state(run_id, None if _empty(run) else run)


RUN_EVENT_HANDLERS = {
    RunAccepted: on_run_accepted,
    ToolCallRequested: on_tool_call_requested,
    ToolCallCompleted: on_call_finished,
    ToolCallFailed: on_call_finished,
    ToolCallDenied: on_call_finished,
    ToolCallOutcomeUnknown: on_outcome_unknown,
    ApprovalRequested: on_approval_requested,
    ApprovalDecided: on_approval_decided,
    RunTerminated: on_run_ended,
    RunCompleted: on_run_ended,
}

COMMAND_HANDLERS = {
    DecideApproval: on_decide_approval,
}
