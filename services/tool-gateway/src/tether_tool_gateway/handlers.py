"""The gateway's handlers: fold run events into per-run state, decide, start executions, emit outcomes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import structlog
from prometheus_client import Counter

from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalRequested,
    RunAccepted,
    RunCompleted,
    RunRejected,
    RunTerminated,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallDeferred,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
)
from tether_messaging.envelopes import derived_id
from tether_messaging.processor import Context, Inbound
from tether_messaging.topics import Topics
from tether_tool_gateway.domain.canonical import canonical_json
from tether_tool_gateway.domain.errors import UnknownCall, UnknownRun
from tether_tool_gateway.domain.policy import (
    Allow,
    ApprovalDecisionInputs,
    CallDecisionInputs,
    Decision,
    Defer,
    Deny,
    Policy,
    RateDecisionInputs,
    RequireApproval,
    approval_id_for,
    policy_for_run,
)
from tether_tool_gateway.domain.policy_document import DEFAULT_POLICY_VERSION
from tether_tool_gateway.domain.provenance import copied_args, linked_args, provenance, result_text
from tether_tool_gateway.domain.state import CallState, CallStatus, RunState
from tether_tool_gateway.execution import (
    CallRef,
    Completed,
    Failed,
    Outcome,
    Pending,
    RateLimited,
    ToolRunner,
    Unknown,
    tool_spec_json,
)
from tether_tool_gateway.ledger.port import Intent

log = structlog.get_logger("tether_tool_gateway.handlers")

PRODUCER = "tool-gateway"

DECISIONS = Counter("tether_gateway_decisions_total", "Policy decisions on tool calls.", ["verdict", "reason"])
OUTCOMES = Counter("tether_gateway_outcomes_total", "Tool call outcomes emitted.", ["outcome", "replayed"])


@dataclass(frozen=True)
class Deps:
    """What the handlers need besides the message and the context."""

    topics: Topics
    policy: Policy
    runner: ToolRunner
    #: How long after a Pending outcome (or a failed attempt) a call's work is started again.
    recheck_ms: int = 2_000
    #: How long a started execution may go without finishing before on_tick starts it again
    #: (the ledger makes that safe); a lost worker is the only reason it would be needed.
    stall_ms: int = 120_000


# -- ids -----------------------------------------------------------------------------------------
def outcome_event_id(run_id: str, idem_key: str) -> str:
    """One id for a call's terminal outcome (Completed, Failed, Denied, OutcomeUnknown): whichever
    instance or replay emits it, the sequencer appends only the first."""
    return derived_id(run_id, PRODUCER, "outcome", idem_key)


def approval_event_id(run_id: str, idem_key: str) -> str:
    return derived_id(run_id, PRODUCER, "approval-requested", idem_key)


def authorized_event_id(run_id: str, idem_key: str) -> str:
    return derived_id(run_id, PRODUCER, "authorized", idem_key)


def deferred_event_id(run_id: str, idem_key: str, attempt: int) -> str:
    return derived_id(run_id, PRODUCER, "deferred", idem_key, str(attempt))


def call_work_key(idem_key: str) -> str:
    return f"call:{idem_key}"


def recover_work_key(idem_key: str, attempt: int) -> str:
    return f"recover:{idem_key}:{attempt}"


def sweep_work_key(partition: int) -> str:
    return f"sweep:{partition}"


class StartedCalls:
    """The work keys of calls this process started and that are not resolved yet, each with its
    partition. A call EXECUTING in the state but absent here was started by an earlier owner (or
    before this process lost and got back its partition, which drops the loop's work): the tick
    starts it again at once instead of waiting for its recheck time.

    Bounded by the calls in flight on the partitions this process owns: a resolved call or an
    ended run removes its keys, and `keep_only` forgets the keys of partitions that moved to
    another instance (their runs end there, so nothing here would ever remove them).
    """

    def __init__(self) -> None:
        self._partition_of: dict[str, int] = {}

    def add(self, key: str, partition: int) -> None:
        self._partition_of[key] = partition

    def discard(self, key: str) -> None:
        self._partition_of.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._partition_of

    def __len__(self) -> int:
        return len(self._partition_of)

    def keep_only(self, partitions: Iterable[int]) -> None:
        """Forget the calls of every partition not in `partitions` (the ones this process owns)."""
        owned = set(partitions)
        for key in [k for k, p in self._partition_of.items() if p not in owned]:
            del self._partition_of[key]


# -- helpers -------------------------------------------------------------------------------------
def run_policy(run: RunState, deps: Deps) -> Policy:
    """The policy this run's decisions are made under (`policy.policy_for_run`)."""
    return policy_for_run(deps.policy, run.default_policy_version)


def _state(ctx: Context, run_id: str) -> RunState | None:
    state = ctx.get_state(run_id)
    # A copy: the loop keeps the committed object to undo an aborted batch.
    return None if state is None else state.clone()


def _emit(ctx: Context, deps: Deps, payload: AvroRecord, *, run_id: str, tenant_id: str, event_id: str,
          causation_id: str | None) -> None:
    ctx.emit(deps.topics.run_intake, payload, run_id=run_id, tenant_id=tenant_id, event_id=event_id,
             causation_id=causation_id)


def emit_outcome(outcome: Outcome, ctx: Context, deps: Deps, causation_id: str | None = None) -> bool:
    """Emit the event an outcome stands for; False for Pending (nothing to emit yet)."""
    c = outcome.call
    payload: AvroRecord
    if isinstance(outcome, Completed):
        payload = ToolCallCompleted(step=c.step, call_id=c.call_id, idem_key=c.idem_key, tool_name=c.tool_name,
                                    result_json=outcome.result_json, result_ref=outcome.result_ref,
                                    untrusted=outcome.untrusted, duration_ms=outcome.duration_ms,
                                    replayed=outcome.replayed)
        OUTCOMES.labels("completed", str(outcome.replayed).lower()).inc()
    elif isinstance(outcome, Failed):
        payload = ToolCallFailed(step=c.step, call_id=c.call_id, idem_key=c.idem_key, tool_name=c.tool_name,
                                 error_code=outcome.error_code, detail=outcome.detail, retryable=outcome.retryable)
        OUTCOMES.labels("failed", "false").inc()
    elif isinstance(outcome, Unknown):
        payload = ToolCallOutcomeUnknown(step=c.step, call_id=c.call_id, idem_key=c.idem_key,
                                         tool_name=c.tool_name, detail=outcome.detail)
        OUTCOMES.labels("unknown", "false").inc()
    else:
        return False
    _emit(ctx, deps, payload, run_id=c.run_id, tenant_id=c.tenant_id,
          event_id=outcome_event_id(c.run_id, c.idem_key), causation_id=causation_id)
    return True


def _deny(call: CallState, decision: Decision, verdict: Deny, run_id: str, tenant_id: str, ctx: Context,
          deps: Deps, causation_id: str) -> None:
    _emit(ctx, deps, ToolCallDenied(step=call.step, call_id=call.call_id, idem_key=call.idem_key,
                                    tool_name=call.tool_name, reason_code=verdict.reason_code, detail=verdict.detail,
                                    policy_version=decision.policy_version, inputs_hash=decision.inputs_hash),
          run_id=run_id, tenant_id=tenant_id, event_id=outcome_event_id(run_id, call.idem_key),
          causation_id=causation_id)
    call.status = CallStatus.RESOLVED
    DECISIONS.labels("deny", verdict.reason_code).inc()


def start_execution(call: CallState, run: RunState, run_id: str, ctx: Context, deps: Deps,
                    seen: StartedCalls | None = None) -> None:
    """Mark the call EXECUTING and start its work (idempotent: a running key is not started twice)."""
    tool = run.tools[call.tool_name]
    intent = Intent(idem_key=call.idem_key, run_id=run_id, tenant_id=run.tenant_id, partition=ctx.partition,
                    step=call.step, call_id=call.call_id, tool_name=call.tool_name, args_json=call.args_json,
                    args_hash=call.args_hash, tool_spec_json=tool_spec_json(tool), idempotent=tool.idempotent)
    call.status = CallStatus.EXECUTING
    call.recheck_at_ms = ctx.now_ms + deps.stall_ms
    key = call_work_key(call.idem_key)
    if seen is not None:
        seen.add(key, ctx.partition)
    # The rate limit is checked when the call is about to run (after any approval), not when
    # it was decided: a human may take days, and the limiter answers for "now".
    limit = run_policy(run, deps).rate_limit_for(run.tenant_id, call.tool_name)
    ctx.start_work(key, run_id, run.tenant_id,
                   partial(deps.runner.run, intent, tool, limit, call.rate_attempts + 1))


# -- event handlers (message first, dependencies named) ------------------------------------------
def on_run_accepted(event: RunAccepted, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    run_id = msg.envelope.run_id
    if ctx.get_state(run_id) is not None:
        return  # replayed
    run = RunState(
        tenant_id=msg.envelope.tenant_id,
        principal_id=event.principal_id,
        agent_id=event.agent.agent_id,
        agent_allowlist=list(event.agent.tool_allowlist),
        tenant_grants=list(event.tenant_grants),
        delegated_scope=None if event.delegated_scope is None else list(event.delegated_scope),
        tools={t.name: t for t in event.tools},
        default_policy_version=DEFAULT_POLICY_VERSION,
    )
    run.read_goal(event.goal)
    ctx.put_state(run_id, run)


def on_tool_call_requested(event: ToolCallRequested, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    run_id = msg.envelope.run_id
    run = _state(ctx, run_id)
    if run is None:
        raise UnknownRun(run_id)
    call = event.call
    if call.call_id in run.calls:
        return  # replayed
    run.calls[call.call_id] = CallState(
        call_id=call.call_id, step=event.step, call_index=call.call_index, idem_key=call.idem_key,
        tool_name=call.tool_name, args_json=call.args_json, args_hash=call.args_hash,
        provenance_json=event.provenance_json,
    )
    ctx.put_state(run_id, run)


def on_tool_call_budgeted(event: ToolCallBudgeted, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    run_id = msg.envelope.run_id
    run = _state(ctx, run_id)
    if run is None:
        raise UnknownRun(run_id)
    call = run.calls.get(event.call_id)
    if call is None:
        raise UnknownCall(run_id, event.call_id)
    if call.status is CallStatus.EXECUTING:
        # A held input re-delivered after a failover: its work did not finish; start it again.
        start_execution(call, run, run_id, ctx, deps, seen)
        ctx.put_state(run_id, run)
        return
    if call.status is not CallStatus.REQUESTED:
        return  # already decided
    policy = run_policy(run, deps)
    decision = policy.decide_call(call_decision_inputs(run, call, recorded_at_ms=msg.envelope.recorded_at_ms))
    verdict = decision.verdict
    if isinstance(verdict, Deny):
        _deny(call, decision, verdict, run_id, run.tenant_id, ctx, deps, msg.envelope.event_id)
    elif isinstance(verdict, RequireApproval):
        tool = run.tools[call.tool_name]
        approval_id = approval_id_for(run_id, call.idem_key, call.args_hash)
        shown = call_provenance(run, call, tool_taint=policy.counts_tool_taint)
        _emit(ctx, deps, ApprovalRequested(
            approval_id=approval_id, step=call.step, call_id=call.call_id, idem_key=call.idem_key,
            tool_name=call.tool_name, args_json=call.args_json, args_hash=call.args_hash,
            risk_class=tool.risk_class, reasons=list(verdict.reasons), provenance_json=shown,
            expires_at_ms=verdict.expires_at_ms, policy_version=decision.policy_version,
            inputs_hash=decision.inputs_hash,
        ), run_id=run_id, tenant_id=run.tenant_id, event_id=approval_event_id(run_id, call.idem_key),
            causation_id=msg.envelope.event_id)
        call.status = CallStatus.AWAITING_APPROVAL
        call.approval_id = approval_id
        call.approval_expires_at_ms = verdict.expires_at_ms
        DECISIONS.labels("approval", ",".join(verdict.reasons)).inc()
        log.info("tool_call_needs_approval", run_id=run_id, call_id=call.call_id, tool=call.tool_name,
                 reasons=list(verdict.reasons), policy_version=decision.policy_version,
                 inputs_hash=decision.inputs_hash)
    elif isinstance(verdict, Allow):
        tool = run.tools[call.tool_name]
        # The go, on the record before the effect: the rules that allowed it, never the argument values.
        _emit(ctx, deps, ToolCallAuthorized(
            step=call.step, call_id=call.call_id, idem_key=call.idem_key, tool_name=call.tool_name,
            tool_version=tool.version, args_hash=call.args_hash, risk_class=tool.risk_class,
            reasons=list(verdict.reasons), policy_version=decision.policy_version, inputs_hash=decision.inputs_hash,
        ), run_id=run_id, tenant_id=run.tenant_id, event_id=authorized_event_id(run_id, call.idem_key),
            causation_id=msg.envelope.event_id)
        start_execution(call, run, run_id, ctx, deps, seen)
        DECISIONS.labels("allow", "").inc()
        # Every allowed call is logged with the evidence; WRITE and IRREVERSIBLE ones at info.
        (log.debug if tool.risk_class.value == "READ_ONLY" else log.info)(
            "tool_call_allowed", run_id=run_id, call_id=call.call_id, tool=call.tool_name,
            risk_class=tool.risk_class.value, args_hash=call.args_hash, policy_version=decision.policy_version,
            inputs_hash=decision.inputs_hash)
    ctx.put_state(run_id, run)


def call_decision_inputs(run: RunState, call: CallState, *, recorded_at_ms: int) -> CallDecisionInputs:
    """The decision inputs of a budgeted call, all from the log as folded up to its ToolCallBudgeted."""
    tool = run.tools.get(call.tool_name)
    tool_taint = run.tool_taint()
    copied = linked = None
    if tool is not None and tool.egress and tool.risk_class.value == "READ_ONLY" and (run.tainted_by or tool_taint):
        # Only where the link-following rule could apply (it searches up to 128 KiB of text).
        # Both rules' answers: `copied_args` (taint.follow_links as default/2 read it) and the
        # stricter `linked_args`; a policy hashes the one it reads, and only on a run it deems
        # tainted (CallDecisionInputs.canonical), so earlier policies' inputs do not change.
        try:
            args = json.loads(call.args_json)
        except json.JSONDecodeError:
            copied, linked = {}, {}
        else:
            copied = copied_args(args, run.sources)
            linked = linked_args(args, run.sources, run.request_texts(call.call_id))
    return CallDecisionInputs(
        tool_name=call.tool_name, args_json=call.args_json, args_hash=call.args_hash,
        tool=tool, tenant_grants=run.tenant_grants, agent_allowlist=run.agent_allowlist,
        recorded_at_ms=recorded_at_ms, tenant_id=run.tenant_id, agent_id=run.agent_id,
        principal_id=run.principal_id, delegated_scope=run.delegated_scope, tainted_by=tuple(run.tainted_by),
        copied_args=copied, tool_taint=tuple(tool_taint), linked_args=linked,
    )


def call_provenance(run: RunState, call: CallState, *, tool_taint: bool = False) -> str:
    """ApprovalRequested.provenance_json: the gateway's own derivation from the log, plus what
    the planner claimed (kept for comparison, never trusted). `tainted_by` is what tainted the
    run: with `tool_taint` (a policy with taint.mcp_tool_descriptions) the snapshot's untrusted
    MCP tools (`tools:<name>`) first, then the call ids of untrusted outcomes; without it exactly
    what policies before that rule recorded (the audit compares it byte for byte)."""
    try:
        args = json.loads(call.args_json)
    except json.JSONDecodeError:
        args = call.args_json
    shown = provenance(args, run.sources)
    tainted_by = [*(run.tool_taint() if tool_taint else ()), *run.tainted_by]
    if tainted_by:
        shown["tainted_by"] = tainted_by
    try:
        claimed = json.loads(call.provenance_json or "{}")
    except json.JSONDecodeError:
        claimed = call.provenance_json
    if claimed:
        shown["planner"] = claimed
    return canonical_json(shown)


def on_approval_decided(event: ApprovalDecided, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    run_id = msg.envelope.run_id
    run = _state(ctx, run_id)
    if run is None:
        return  # the run ended; nothing is parked any more
    call = run.calls.get(event.call_id)
    if call is None:
        raise UnknownCall(run_id, event.call_id)
    if call.status is CallStatus.EXECUTING and call.approval_id == event.approval_id:
        start_execution(call, run, run_id, ctx, deps, seen)  # held input re-delivered
        ctx.put_state(run_id, run)
        return
    if call.status is not CallStatus.AWAITING_APPROVAL:
        return
    if call.approval_id != event.approval_id:
        log.warning("approval_for_other_request", run_id=run_id, call_id=call.call_id,
                    expected=call.approval_id, got=event.approval_id)
        return
    decision = run_policy(run, deps).decide_approval(ApprovalDecisionInputs(
        approval_id=event.approval_id, call_args_hash=call.args_hash,
        approval_expires_at_ms=call.approval_expires_at_ms or 0, decided_args_hash=event.args_hash,
        outcome=event.outcome, approver_id=event.approver_id, comment=event.comment,
        decided_at_ms=event.decided_at_ms,
    ))
    if isinstance(decision.verdict, Deny):
        _deny(call, decision, decision.verdict, run_id, run.tenant_id, ctx, deps, msg.envelope.event_id)
    else:
        start_execution(call, run, run_id, ctx, deps, seen)
        DECISIONS.labels("approved", "").inc()
    ctx.put_state(run_id, run)


def on_approval_requested(event: ApprovalRequested, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    # Our own decision, sequenced. Matters only when the state is rebuilt from the log.
    run_id = msg.envelope.run_id
    run = _state(ctx, run_id)
    call = None if run is None else run.calls.get(event.call_id)
    if run is None or call is None or call.status is not CallStatus.REQUESTED:
        return
    call.status = CallStatus.AWAITING_APPROVAL
    call.approval_id = event.approval_id
    call.approval_expires_at_ms = event.expires_at_ms
    ctx.put_state(run_id, run)


def on_call_outcome(event: ToolCallCompleted | ToolCallFailed | ToolCallDenied | ToolCallOutcomeUnknown, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    """A terminal outcome of a call reached the log: the call needs nothing more from us, and
    what the model will read from it is folded into the run (taint, provenance sources)."""
    run_id = msg.envelope.run_id
    run = _state(ctx, run_id)
    if run is None:
        return
    changed = read_outcome(run, event)
    call = run.calls.get(event.call_id)
    if call is not None and call.status is not CallStatus.RESOLVED:
        call.status = CallStatus.RESOLVED
        seen.discard(call_work_key(call.idem_key))
        changed = True
    if changed:
        ctx.put_state(run_id, run)


def read_outcome(run: RunState, event: AvroRecord) -> bool:
    """Fold an outcome's content into the run; True if the run changed."""
    tool = run.tools.get(getattr(event, "tool_name", ""))
    untrusted_tool = tool is not None and tool.untrusted_source
    before = (len(run.tainted_by), len(run.sources))
    if isinstance(event, ToolCallCompleted):
        text = result_text(event.result_json) if event.result_json is not None else None
        run.read_result(event.call_id, event.tool_name, text, untrusted=event.untrusted or untrusted_tool)
    elif isinstance(event, ToolCallFailed):
        # An untrusted tool's error text may quote what it read; the model sees it too.
        run.read_result(event.call_id, event.tool_name, event.detail, untrusted=untrusted_tool, failure=True)
    return (len(run.tainted_by), len(run.sources)) != before


def on_call_deferred(event: ToolCallDeferred, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    # Our own rate-limit decision, sequenced: keeps attempt numbers unique when state is rebuilt.
    run_id = msg.envelope.run_id
    run = _state(ctx, run_id)
    call = None if run is None else run.calls.get(event.call_id)
    if run is None or call is None or call.rate_attempts >= event.attempt:
        return
    call.rate_attempts = event.attempt
    ctx.put_state(run_id, run)


def on_run_ended(event: AvroRecord, msg: Inbound, ctx: Context, *, deps: Deps, seen: StartedCalls) -> None:
    """Nothing new runs after the run ends; executions already running still report (audit)."""
    run_id = msg.envelope.run_id
    run = ctx.get_state(run_id)
    if run is None:
        return
    for call in run.calls.values():
        seen.discard(call_work_key(call.idem_key))
    ctx.put_state(run_id, None)


# -- work handlers -------------------------------------------------------------------------------
def on_call_work_done(outcome: Outcome | None, error: BaseException | None, ctx: Context, *, deps: Deps,
                      run_id: str, idem_key: str, seen: StartedCalls) -> None:
    """An execution (or a look at the ledger) finished: emit its outcome, or look again later."""
    run = _state(ctx, run_id)
    call = None if run is None else next((c for c in run.calls.values() if c.idem_key == idem_key), None)
    if isinstance(outcome, RateLimited):
        if run is not None and call is not None and call.status is CallStatus.EXECUTING:
            _defer(outcome, run, call, run_id, ctx, deps)
            seen.discard(call_work_key(idem_key))
            ctx.put_state(run_id, run)
        return
    if error is not None or isinstance(outcome, Pending) or outcome is None:
        if error is not None:
            log.warning("execution_attempt_failed", run_id=run_id, idem_key=idem_key,
                        error=f"{type(error).__name__}: {error}")
        if call is not None and call.status is CallStatus.EXECUTING:
            # The ledger decides what the next attempt does (replay, wait, take over).
            call.recheck_at_ms = ctx.now_ms + deps.recheck_ms
            ctx.put_state(run_id, run)
        return
    emit_outcome(outcome, ctx, deps)
    seen.discard(call_work_key(idem_key))
    if call is not None and call.status is CallStatus.EXECUTING:
        call.status = CallStatus.RESOLVED
        ctx.put_state(run_id, run)


def _defer(limited: RateLimited, run: RunState, call: CallState, run_id: str, ctx: Context, deps: Deps) -> None:
    """Record the rate-limit decision (with the limiter's answer as an input) and park the call."""
    decision = run_policy(run, deps).decide_rate(RateDecisionInputs(
        tenant_id=run.tenant_id, tool_name=call.tool_name, call_id=call.call_id, idem_key=call.idem_key,
        attempt=limited.attempt, limit=limited.limit, answer=limited.answer, decided_at_ms=ctx.now_ms,
    ))
    verdict = decision.verdict
    if not isinstance(verdict, Defer):
        call.recheck_at_ms = ctx.now_ms  # the limiter said no but the policy says go: ask again at once
        return
    _emit(ctx, deps, ToolCallDeferred(
        step=call.step, call_id=call.call_id, idem_key=call.idem_key, tool_name=call.tool_name,
        reason_code=verdict.reason_code, retry_after_ms=verdict.retry_after_ms, not_before_ms=verdict.not_before_ms,
        attempt=limited.attempt, decided_at_ms=ctx.now_ms, policy_version=decision.policy_version,
        inputs_hash=decision.inputs_hash,
    ), run_id=run_id, tenant_id=run.tenant_id, event_id=deferred_event_id(run_id, call.idem_key, limited.attempt),
        causation_id=None)
    call.status = CallStatus.RATE_LIMITED
    call.not_before_ms = verdict.not_before_ms
    call.rate_attempts = limited.attempt
    DECISIONS.labels("defer", verdict.reason_code).inc()
    log.info("tool_call_deferred", run_id=run_id, call_id=call.call_id, tool=call.tool_name,
             retry_after_ms=verdict.retry_after_ms, attempt=limited.attempt)


def on_sweep_done(result: Any, ctx: Context, *, deps: Deps) -> None:
    """A sweep took over expired intents: emit OutcomeUnknown for non-idempotent ones, re-run the rest."""
    for outcome in result.resolved:
        emit_outcome(outcome, ctx, deps)
        _mark_resolved(outcome.call, ctx)
    for claim in result.to_resume:
        intent = claim.record.intent
        ctx.start_work(recover_work_key(intent.idem_key, claim.attempt), intent.run_id, intent.tenant_id,
                       partial(deps.runner.resume, claim))


def _mark_resolved(call: CallRef, ctx: Context) -> None:
    run = _state(ctx, call.run_id)
    if run is None or call.call_id not in run.calls:
        return
    run.calls[call.call_id].status = CallStatus.RESOLVED
    ctx.put_state(call.run_id, run)


EventHandler = Callable[..., None]

HANDLERS: dict[type[AvroRecord], EventHandler] = {
    RunAccepted: on_run_accepted,
    ToolCallRequested: on_tool_call_requested,
    ToolCallBudgeted: on_tool_call_budgeted,
    ApprovalDecided: on_approval_decided,
    ApprovalRequested: on_approval_requested,
    ToolCallCompleted: on_call_outcome,
    ToolCallFailed: on_call_outcome,
    ToolCallDenied: on_call_outcome,
    ToolCallOutcomeUnknown: on_call_outcome,
    ToolCallDeferred: on_call_deferred,
    RunCompleted: on_run_ended,
    RunTerminated: on_run_ended,
    RunRejected: on_run_ended,
}
