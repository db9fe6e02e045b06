"""The budget's decisions over a run's ledger: admission, sequencing, grants, caps and termination.

Every function here is pure: it reads the ledger, the record and the recorded clock value
(`now_ms`, stamped on the events the decisions produce) and returns a `Plan` — the records to
append to the run event log, in order — after updating the ledger. Guards run before any
change, so a refused record leaves the ledger untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether_budget.domain.errors import CancelForbidden, ProtocolViolation, RunAlreadyExists
from tether_budget.domain.ledger import (
    TERMINAL,
    CallEntry,
    CallStatus,
    Ledger,
    Reason,
    RunStatus,
    StepEntry,
    ToolFacts,
    args_hash,
    capped_error,
)
from tether_budget.domain.loopguard import (
    CURRENT_RULES,
    LOOP_RULES,
    Detection,
    LoopGuard,
    LoopGuardState,
    StepSignature,
    UnknownLoopRules,
    Verdict,
    call_signature,
)
from tether_budget.domain.report import termination_report
from tether_budget.domain.tenancy import TenantLedger, no_limits
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    CancelRun,
    ModelCallCompleted,
    ModelCallFailed,
    Remaining,
    RunAccepted,
    RunCompleted,
    RunQueued,
    RunRejected,
    RunTerminated,
    StepDeferred,
    StepGranted,
    SubmitRun,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallDeferred,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
)

# Calls that were budgeted and have no final outcome yet; a late outcome for them is still a fact.
OPEN = frozenset(
    {
        CallStatus.BUDGETED,
        CallStatus.APPROVAL_PENDING,
        CallStatus.APPROVED,
        CallStatus.DECLINED,
        CallStatus.OUTCOME_UNKNOWN,
    }
)
_MAY_EXECUTE = frozenset({CallStatus.BUDGETED, CallStatus.APPROVED})


@dataclass(frozen=True)
class AppendRecord:
    """Append the record being handled to the run's log."""


@dataclass(frozen=True)
class Decide:
    """Append a decision of the budget service. `what` derives its deterministic event id."""

    payload: AvroRecord
    what: tuple[str | int, ...]


APPEND = AppendRecord()
Entry = AppendRecord | Decide


@dataclass
class Plan:
    """What to append to the run's log, in order; `dropped` says why the record was not appended."""

    entries: list[Entry] = field(default_factory=list)
    dropped: str | None = None
    detection: Detection | None = None

    def extend(self, other: Plan) -> Plan:
        self.entries.extend(other.entries)
        self.detection = other.detection or self.detection
        return self


@dataclass(frozen=True)
class AdmissionPolicy:
    """Service-wide ceilings on the caps a run may ask for."""

    max_steps: int = 1_000
    max_wall_clock_ms: int = 7 * 24 * 3_600_000
    max_tokens: int = 50_000_000
    max_cost_usd_micros: int = 1_000_000_000
    max_tool_calls: int = 10_000


@dataclass(frozen=True)
class Retention:
    """How long an ended run's ledger is kept in full, and how long its tombstone is kept.

    The tombstone must outlive the intake topic's retention (7 days), so no record of the run
    can be replayed after it is forgotten.
    """

    ended_ledger_ms: int = 3_600_000
    tombstone_ms: int = 8 * 24 * 3_600_000


def idem_key(run_id: str, step: int, call_index: int) -> str:
    """The idempotency key of a tool call's side effect (the run protocol's definition)."""
    return hashlib.sha256(f"{run_id}\x1f{step}\x1f{call_index}".encode()).hexdigest()


# -- admission -------------------------------------------------------------------------------


def _admission_problem(submit: SubmitRun, policy: AdmissionPolicy) -> tuple[Reason, str] | None:
    caps = submit.caps
    values = {
        "max_steps": (caps.max_steps, policy.max_steps),
        "max_wall_clock_ms": (caps.max_wall_clock_ms, policy.max_wall_clock_ms),
        "max_tokens": (caps.max_tokens, policy.max_tokens),
        "max_cost_usd_micros": (caps.max_cost_usd_micros, policy.max_cost_usd_micros),
        "max_tool_calls": (caps.max_tool_calls, policy.max_tool_calls),
    }
    for name, (value, ceiling) in values.items():
        minimum = 0 if name == "max_tool_calls" else 1  # a run may be allowed no tool calls at all
        if value < minimum:
            return Reason.INVALID_CAPS, f"{name} must be at least {minimum}, got {value}"
        if value > ceiling:
            return Reason.CAPS_ABOVE_CEILING, f"{name} {value} is above the service ceiling {ceiling}"
    names = [t.name for t in submit.tools]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        return Reason.INVALID_TOOLS, f"tool names must be unique, repeated: {', '.join(dupes)}"
    return None


def admit(
    submit: SubmitRun,
    *,
    run_id: str,
    tenant_id: str,
    partition: int,
    event_id: str,
    now_ms: int,
    policy: AdmissionPolicy,
    tenant: TenantLedger | None = None,
    loop_rules: int = CURRENT_RULES,
) -> tuple[Ledger, Plan]:
    """Admit a new run (RunAccepted + StepGranted(1)), queue it behind the tenant's running runs
    (RunQueued), or refuse it (RunRejected).

    `tenant` is the tenant's ledger on this lane when the submit carries tenant limits (it is
    updated in place); without it the run is admitted as far as its own caps allow. `loop_rules`
    is the loop guard's rules version the run is judged by to its end (an auditor passes the
    version the run's RunAccepted names).
    """
    if ":" in run_id:
        raise ProtocolViolation("BAD_RUN_ID", f"run id {run_id!r} must not contain ':'")
    if loop_rules not in LOOP_RULES:
        raise UnknownLoopRules(loop_rules)
    ledger = Ledger(
        run_id=run_id,
        tenant_id=tenant_id,
        principal_id=submit.principal_id,
        request_id=submit.request_id,
        partition=partition,
        submit_event_id=event_id,
        loop=LoopGuardState(rules=loop_rules),
    )
    problem = _admission_problem(submit, policy)
    if problem is not None:
        return ledger, _reject(ledger, submit, *problem, now_ms)
    if tenant is None or submit.tenant_limits is None:
        return ledger, _accept(ledger, submit, now_ms, None)
    tenant.apply_limits(submit.tenant_limits)
    if no_limits(tenant.limits):
        return ledger, _accept(ledger, submit, now_ms, None)  # not tracked: nothing to enforce

    ledger.tenant_tracked = True
    over = tenant.spend_breach(now_ms)
    if over is not None:
        return ledger, _reject(ledger, submit, Reason.TENANT_SPEND_CAP, over, now_ms)
    if tenant.has_free_slot() and not tenant.queue:
        _take_slot(ledger, tenant)
        return ledger, _accept(ledger, submit, now_ms, tenant)
    limits = tenant.limits
    if tenant.queue_full():
        if limits.max_queued_runs <= 0:
            detail = f"tenant {tenant_id} runs {tenant.running} of {limits.max_concurrent_runs} at once here"
            return ledger, _reject(ledger, submit, Reason.TENANT_CONCURRENCY_CAP, detail, now_ms)
        detail = (f"tenant {tenant_id} has {len(tenant.queue)} runs queued (the most allowed here) and "
                  f"{tenant.running} of {limits.max_concurrent_runs} running")
        return ledger, _reject(ledger, submit, Reason.TENANT_QUEUE_FULL, detail, now_ms)
    position = tenant.enqueue(ledger.run_id)
    ledger.status = RunStatus.QUEUED
    ledger.queued_at_ms = now_ms
    ledger.queued_submit = submit.to_avro()
    queued = RunQueued(
        principal_id=submit.principal_id,
        request_id=submit.request_id,
        goal=submit.goal,
        agent=submit.agent,
        position=position,
        running=tenant.running,
        max_concurrent_runs=limits.max_concurrent_runs,
    )
    return ledger, Plan([Decide(queued, ("RunQueued",))])


def admit_queued(ledger: Ledger, tenant: TenantLedger, *, now_ms: int) -> Plan:
    """A slot freed and this run was first in the tenant's queue: accept it now (or reject it if
    the tenant reached its spend cap while it waited). The tenant already took it off the queue."""
    if not ledger.queued or ledger.queued_submit is None:
        raise ProtocolViolation("NOT_QUEUED", f"run {ledger.run_id} is {ledger.status}, not queued")
    submit = SubmitRun.from_avro(ledger.queued_submit)
    ledger.queued_submit = None
    over = tenant.spend_breach(now_ms)
    if over is not None:
        return _reject(ledger, submit, Reason.TENANT_SPEND_CAP, over, now_ms)
    ledger.status = RunStatus.ACTIVE
    _take_slot(ledger, tenant)
    return _accept(ledger, submit, now_ms, tenant)


def _take_slot(ledger: Ledger, tenant: TenantLedger) -> None:
    """The run takes one of its tenant's concurrency slots until it ends (handlers release it)."""
    tenant.take_slot()
    ledger.holds_tenant_slot = True


def _reject(ledger: Ledger, submit: SubmitRun, reason: Reason, detail: str, now_ms: int) -> Plan:
    ledger.end(RunStatus.REJECTED, reason, now_ms)
    ledger.tombstone()
    rejected = RunRejected(request_id=submit.request_id, reason_code=reason, detail=detail)
    return Plan([Decide(rejected, ("RunRejected",))])


def _accept(ledger: Ledger, submit: SubmitRun, now_ms: int, tenant: TenantLedger | None) -> Plan:
    caps = submit.caps
    ledger.caps = caps
    ledger.accepted_at_ms = now_ms
    ledger.deadline_ms = now_ms + caps.max_wall_clock_ms
    ledger.tools = {
        t.name: ToolFacts(pollable=t.pollable, idempotent=t.idempotent, risk_class=t.risk_class.value)
        for t in submit.tools
    }
    accepted = RunAccepted(
        principal_id=submit.principal_id,
        request_id=submit.request_id,
        goal=submit.goal,
        agent=submit.agent,
        tools=submit.tools,
        caps=caps,
        tenant_grants=submit.tenant_grants,
        delegated_scope=submit.delegated_scope,
        deadline_ms=ledger.deadline_ms,
        loop_guard_version=ledger.loop.rules,
    )
    return Plan([Decide(accepted, ("RunAccepted",))]).extend(_grant_or_stop(ledger, now_ms, tenant))


def resubmit(ledger: Ledger, submit: SubmitRun, *, event_id: str) -> Plan:
    """A SubmitRun for a run that already has a ledger: a duplicate of its submit, or a conflict."""
    if event_id == ledger.submit_event_id or submit.request_id == ledger.request_id:
        return Plan(dropped="DUPLICATE_SUBMIT")
    raise RunAlreadyExists(ledger.run_id, ledger.request_id)


def cancel(ledger: Ledger, command: CancelRun, *, tenant_id: str, now_ms: int) -> Plan:
    """CancelRun from the submitter or anyone in the run's tenant → RunTerminated(CANCELLED)."""
    if tenant_id != ledger.tenant_id:
        raise CancelForbidden(ledger.run_id, tenant_id)
    if not ledger.open:
        return Plan(dropped="RUN_ENDED")
    who = "the submitter" if command.principal_id == ledger.principal_id else "a member of the tenant"
    detail = f"cancelled by {command.principal_id} ({who})" + (f": {command.reason}" if command.reason else "")
    return _terminate(ledger, Reason.CANCELLED, detail, now_ms)


# -- caps ------------------------------------------------------------------------------------


def _remaining(ledger: Ledger, now_ms: int) -> Remaining:
    caps = ledger.caps
    if caps is None:
        raise ProtocolViolation("NOT_ADMITTED", f"run {ledger.run_id} has no caps")
    return Remaining(
        steps=max(0, caps.max_steps - ledger.step),
        tokens=max(0, caps.max_tokens - ledger.tokens_used),
        cost_usd_micros=max(0, caps.max_cost_usd_micros - ledger.usage.cost_usd_micros),
        wall_clock_ms=max(0, ledger.deadline_at(now_ms) - now_ms),
    )


def _wall_clock_breach(ledger: Ledger, now_ms: int) -> tuple[Reason, str] | None:
    if now_ms >= ledger.deadline_at(now_ms):
        limit = ledger.caps.max_wall_clock_ms if ledger.caps else 0
        waited = f" (+{ledger.human_wait_ms} ms waiting for humans)" if ledger.human_wait_ms else ""
        return Reason.WALL_CLOCK_CAP, f"deadline passed after {now_ms - ledger.accepted_at_ms} ms of {limit} ms{waited}"
    return None


def _usage_exceeded(ledger: Ledger) -> tuple[Reason, str] | None:
    caps = ledger.caps
    if caps is None:
        return None
    if ledger.tokens_used > caps.max_tokens:
        return Reason.TOKEN_CAP, f"{ledger.tokens_used} tokens used, cap {caps.max_tokens}"
    if ledger.usage.cost_usd_micros > caps.max_cost_usd_micros:
        return Reason.COST_CAP, f"{ledger.usage.cost_usd_micros} µUSD spent, cap {caps.max_cost_usd_micros}"
    return None


def _grant_breach(ledger: Ledger, step: int, now_ms: int) -> tuple[Reason, str] | None:
    """Checked before every grant: the step must fit under every cap, with something left."""
    caps = ledger.caps
    if caps is None:
        raise ProtocolViolation("NOT_ADMITTED", f"run {ledger.run_id} has no caps")
    if step > caps.max_steps:
        return Reason.STEP_CAP, f"all {caps.max_steps} steps used"
    if ledger.tokens_used >= caps.max_tokens:
        return Reason.TOKEN_CAP, f"{ledger.tokens_used} of {caps.max_tokens} tokens used; none left for step {step}"
    if ledger.usage.cost_usd_micros >= caps.max_cost_usd_micros:
        return (
            Reason.COST_CAP,
            f"{ledger.usage.cost_usd_micros} of {caps.max_cost_usd_micros} µUSD spent; none left for step {step}",
        )
    return _wall_clock_breach(ledger, now_ms)


def _tenant_breach(tenant: TenantLedger | None, now_ms: int) -> tuple[Reason, str] | None:
    over = tenant.spend_breach(now_ms) if tenant is not None else None
    return (Reason.TENANT_SPEND_CAP, over) if over is not None else None


def _tool_call_breach(ledger: Ledger, now_ms: int, tenant: TenantLedger | None) -> tuple[Reason, str] | None:
    """Checked before every tool call is budgeted."""
    caps = ledger.caps
    if caps is None:
        raise ProtocolViolation("NOT_ADMITTED", f"run {ledger.run_id} has no caps")
    if ledger.tool_calls_budgeted >= caps.max_tool_calls:
        return Reason.TOOL_CALL_CAP, f"all {caps.max_tool_calls} tool calls used"
    return _usage_exceeded(ledger) or _wall_clock_breach(ledger, now_ms) or _tenant_breach(tenant, now_ms)


# -- grants and termination ------------------------------------------------------------------


def _terminate(ledger: Ledger, reason: Reason, detail: str, now_ms: int) -> Plan:
    report = termination_report(ledger, reason, detail)
    ledger.end(RunStatus.TERMINATED, reason, now_ms)
    return Plan([Decide(RunTerminated(reason_code=reason, report=report), ("RunTerminated",))])


def _grant_or_stop(ledger: Ledger, now_ms: int, tenant: TenantLedger | None, *, first_in_line: bool = False) -> Plan:
    step = ledger.step + 1
    breach = _grant_breach(ledger, step, now_ms) or _tenant_breach(tenant, now_ms)
    if breach is not None:
        return _terminate(ledger, *breach, now_ms)
    wait = tenant.grant_wait(now_ms) if tenant is not None else None
    if tenant is not None and ((tenant.deferred and not first_in_line) or wait is not None):
        # Deferred, not denied: the budget grants it when the tenant's bucket refills. Behind
        # runs already deferred it waits too, whatever the bucket holds: a run finishing a step
        # between two ticks must not take the refill the longest waiting run is owed (the
        # handlers serve the line, in order, as soon as the bucket allows).
        tenant.defer(ledger.run_id)
        ledger.deferred_step = step
        reason = wait or ("TENANT_TOKEN_RATE" if tenant.limits.tokens_per_minute > 0 else "TENANT_SPEND_CAP")
        deferred = StepDeferred(step=step, reason_code=reason,
                                tokens_available=int(min(tenant.rate_room(now_ms), 2**62)),
                                not_before_ms=tenant.refill_at(now_ms))
        return Plan([Decide(deferred, ("StepDeferred", step))])
    if tenant is not None:
        tokens, cost = tenant.reserve(now_ms)
        ledger.rate_reserved += tokens
        ledger.spend_reserved += cost
    ledger.deferred_step = None
    ledger.step = step
    ledger.current = StepEntry(step=step, granted_at_ms=now_ms)
    warning, ledger.pending_warning = ledger.pending_warning, None
    granted = StepGranted(step=step, remaining=_remaining(ledger, now_ms), loop_warning=warning)
    return Plan([Decide(granted, ("StepGranted", step))])


def _sign_step(ledger: Ledger) -> StepSignature:
    """The finished step's signature, from the signatures its calls got with their outcomes. The
    calls drop theirs: the guard's history keeps what later steps are compared with."""
    calls = sorted(ledger.step_calls(), key=lambda c: c.call_index)
    signature = StepSignature(step=ledger.step, calls=[c.signature for c in calls])
    for c in calls:
        ledger.update_call(c, signature=None)
    return signature


def grant_deferred(ledger: Ledger, tenant: TenantLedger, *, now_ms: int) -> Plan:
    """The tenant's bucket has room again and this run's grant waited longest: grant (or stop) now."""
    if not ledger.active or ledger.deferred_step is None:
        return Plan(dropped="NOT_DEFERRED")
    return _grant_or_stop(ledger, now_ms, tenant, first_in_line=True)


def _finish_step(ledger: Ledger, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None) -> Plan:
    """Every call of the step has an outcome: look for a loop, then grant the next step or stop."""
    warned_before = ledger.loop.warned
    verdict, detection = guard.observe(ledger.loop, _sign_step(ledger))
    ledger.fold_old_steps()
    if verdict is Verdict.TERMINATE and detection is not None:
        first = f" First warning: {warned_before.summary()}." if warned_before else ""
        detail = f"Loop detected after a warning: {detection.summary()}.{first}"
        plan = _terminate(ledger, Reason.LOOP_DETECTED, detail, now_ms)
        plan.detection = detection
        return plan
    if verdict is Verdict.WARN and detection is not None:
        ledger.pending_warning = detection.warning()
    plan = _grant_or_stop(ledger, now_ms, tenant)
    plan.detection = detection
    return plan


# -- intake records on an active run ---------------------------------------------------------


def _current_step(ledger: Ledger, step: int) -> StepEntry:
    cur = ledger.current
    if cur is None or cur.step != step:
        granted = cur.step if cur else "none"
        raise ProtocolViolation("STEP_MISMATCH", f"record for step {step}, step granted: {granted}")
    return cur


def _call(ledger: Ledger, step: int, call_id: str, key: str) -> CallEntry:
    call = ledger.calls.get(call_id)
    if call is None:
        raise ProtocolViolation("UNKNOWN_CALL", f"call {call_id} was never requested")
    if call.step != step:
        raise ProtocolViolation("STEP_MISMATCH", f"call {call_id} belongs to step {call.step}, record says {step}")
    if call.idem_key != key:
        raise ProtocolViolation("BAD_IDEM_KEY", f"call {call_id} has idem_key {call.idem_key}, record says {key}")
    return call


def _model_call_completed(
    ledger: Ledger, ev: ModelCallCompleted, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    cur = _current_step(ledger, ev.step)
    if cur.model_done:
        raise ProtocolViolation("DUPLICATE_MODEL_CALL", f"step {ev.step} already has a model call outcome")
    if ev.tool_call_count < 0:
        raise ProtocolViolation("BAD_TOOL_CALL_COUNT", f"tool_call_count {ev.tool_call_count}")
    ledger.add_usage(ev.usage)
    ledger.steps_done += 1
    cur.model_done, cur.tool_call_count = True, ev.tool_call_count
    if ev.tool_call_count == 0 and ev.assistant_text:
        cur.text_hash = hashlib.sha256(ev.assistant_text.encode()).hexdigest()[:16]
    plan = Plan([APPEND])
    exceeded = _usage_exceeded(ledger)
    if exceeded is not None:
        plan.extend(_terminate(ledger, *exceeded, now_ms))
    return plan


def _model_call_failed(
    ledger: Ledger, ev: ModelCallFailed, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    cur = _current_step(ledger, ev.step)
    if cur.model_done:
        raise ProtocolViolation("DUPLICATE_MODEL_CALL", f"step {ev.step} already has a model call outcome")
    ledger.add_usage(ev.usage)
    ledger.steps_done += 1
    cur.model_done, cur.tool_call_count = True, 0
    ledger.last_error = capped_error(f"step {ev.step} model call {ev.error_code}: {ev.detail}")
    reason = Reason.CONTEXT_OVERFLOW if ev.error_code == "CONTEXT_OVERFLOW" else Reason.MODEL_FAILED
    detail = f"the model call of step {ev.step} failed after {ev.attempts} attempt(s): {ev.error_code}"
    return Plan([APPEND]).extend(_terminate(ledger, reason, detail, now_ms))


def _tool_call_requested(
    ledger: Ledger, ev: ToolCallRequested, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    cur = _current_step(ledger, ev.step)
    call = ev.call
    if not cur.model_done or cur.tool_call_count is None:
        raise ProtocolViolation("UNEXPECTED_TOOL_CALL", f"step {ev.step} has no completed model call yet")
    if not 0 <= call.call_index < cur.tool_call_count:
        raise ProtocolViolation(
            "CALL_INDEX_OUT_OF_RANGE", f"call index {call.call_index}, the model proposed {cur.tool_call_count}"
        )
    if call.call_id != f"{ev.step}.{call.call_index}":
        raise ProtocolViolation("BAD_CALL_ID", f"call id {call.call_id!r} for step {ev.step} index {call.call_index}")
    if call.call_id in ledger.calls:
        raise ProtocolViolation("DUPLICATE_CALL", f"call {call.call_id} was already requested")
    if call.idem_key != idem_key(ledger.run_id, ev.step, call.call_index):
        raise ProtocolViolation("BAD_IDEM_KEY", f"call {call.call_id} idem_key does not match H(run, step, index)")
    if call.args_hash != args_hash(call.args_json):
        raise ProtocolViolation("BAD_ARGS_HASH", f"call {call.call_id} args_hash is not sha256(args_json)")

    entry = CallEntry(
        call_id=call.call_id,
        step=ev.step,
        call_index=call.call_index,
        idem_key=call.idem_key,
        tool_name=call.tool_name,
        args_hash=call.args_hash,
        args_json=call.args_json,
        status=CallStatus.BUDGETED,
    )
    breach = _tool_call_breach(ledger, now_ms, tenant)
    ledger.calls[call.call_id] = entry
    cur.call_ids.append(call.call_id)
    if breach is not None:
        ledger.update_call(entry, status=CallStatus.NOT_BUDGETED, args_json=None)
        return Plan([APPEND]).extend(_terminate(ledger, *breach, now_ms))
    ledger.tool_calls_budgeted += 1
    budgeted = ToolCallBudgeted(
        step=ev.step, call_id=call.call_id, idem_key=call.idem_key, remaining=_remaining(ledger, now_ms)
    )
    return Plan([APPEND, Decide(budgeted, ("ToolCallBudgeted", call.call_id))])


Outcome = ToolCallCompleted | ToolCallFailed | ToolCallDenied


def _finish_call(ledger: Ledger, call: CallEntry, status: CallStatus, *, observation: str, error: str | None) -> None:
    """A call's final outcome. The ledger is checkpointed whole after every record, so the call
    keeps no text: its arguments go (their hash stays), and `observation` (the result JSON or
    error text, any size) only goes into the signature its step will be signed with (hashes
    and excerpts). An ended run signs no more steps."""
    signature = call_signature(
        call.tool_name,
        call.args_json or "",
        observation=observation,
        error=error,
        pollable=ledger.tools.get(call.tool_name, ToolFacts()).pollable,
        rules=ledger.loop.rules,
    ) if ledger.active else None
    ledger.update_call(call, status=status, error=error, signature=signature, args_json=None)


def _record_outcome(ledger: Ledger, call: CallEntry, ev: Outcome) -> None:
    if isinstance(ev, ToolCallCompleted):
        observation = ev.result_json if ev.result_json is not None else (
            f"blob:{ev.result_ref.sha256}" if ev.result_ref else ""
        )
        _finish_call(ledger, call, CallStatus.COMPLETED, observation=observation, error=None)
    elif isinstance(ev, ToolCallFailed):
        _finish_call(ledger, call, CallStatus.FAILED, observation=ev.detail, error=ev.error_code)
        ledger.last_error = capped_error(f"{call.call_id} {call.tool_name} failed {ev.error_code}: {ev.detail}")
    else:
        _finish_call(ledger, call, CallStatus.DENIED, observation=ev.detail, error=f"denied:{ev.reason_code}")
        ledger.last_error = capped_error(f"{call.call_id} {call.tool_name} denied {ev.reason_code}: {ev.detail}")


def _tool_call_outcome(ledger: Ledger, ev: Outcome, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None) -> Plan:
    call = _call(ledger, ev.step, ev.call_id, ev.idem_key)
    if call.status not in OPEN:
        code = "DUPLICATE_OUTCOME" if call.status in TERMINAL else "CALL_NOT_BUDGETED"
        raise ProtocolViolation(code, f"call {call.call_id} is {call.status}")
    _record_outcome(ledger, call, ev)
    plan = Plan([APPEND])
    if ledger.step_finished():
        plan.extend(_finish_step(ledger, guard, now_ms, tenant))
    return plan


def _tool_call_outcome_unknown(
    ledger: Ledger, ev: ToolCallOutcomeUnknown, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    call = _call(ledger, ev.step, ev.call_id, ev.idem_key)
    if call.status not in _MAY_EXECUTE:
        raise ProtocolViolation("UNEXPECTED_OUTCOME_UNKNOWN", f"call {call.call_id} is {call.status}")
    ledger.update_call(call, status=CallStatus.OUTCOME_UNKNOWN)
    ledger.last_error = capped_error(f"{call.call_id} {call.tool_name} outcome unknown: {ev.detail}")
    return Plan([APPEND])  # the step cannot finish: the run is parked until a human decides


def _tool_call_deferred(
    ledger: Ledger, ev: ToolCallDeferred, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    # The gateway's rate limiter made an allowed call wait: a recorded decision, not an outcome.
    call = _call(ledger, ev.step, ev.call_id, ev.idem_key)
    if call.status not in _MAY_EXECUTE:
        raise ProtocolViolation("UNEXPECTED_DEFERRAL", f"call {call.call_id} is {call.status}")
    return Plan([APPEND])


def _tool_call_authorized(
    ledger: Ledger, ev: ToolCallAuthorized, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    # The gateway's policy let a budgeted call run without a human: the decision goes on the
    # record before the effect's outcome. The call stays BUDGETED; its outcome finishes it.
    call = _call(ledger, ev.step, ev.call_id, ev.idem_key)
    _check_authorization(call, ev)
    return Plan([APPEND])


def _check_authorization(call: CallEntry, ev: ToolCallAuthorized) -> None:
    if call.status is not CallStatus.BUDGETED:
        raise ProtocolViolation("UNEXPECTED_AUTHORIZATION", f"call {call.call_id} is {call.status}")
    if ev.tool_name != call.tool_name or ev.args_hash != call.args_hash:
        raise ProtocolViolation("AUTHORIZATION_MISMATCH", f"the authorization of {call.call_id} is for another call")


def _approval_requested(
    ledger: Ledger, ev: ApprovalRequested, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    call = _call(ledger, ev.step, ev.call_id, ev.idem_key)
    if ev.args_hash != call.args_hash:
        raise ProtocolViolation("APPROVAL_MISMATCH", f"approval {ev.approval_id} is bound to other arguments")
    if call.status is CallStatus.BUDGETED:
        status = CallStatus.APPROVAL_PENDING
    elif call.status is CallStatus.OUTCOME_UNKNOWN:
        status = call.status
    else:
        raise ProtocolViolation("UNEXPECTED_APPROVAL", f"call {call.call_id} is {call.status}")
    ledger.update_call(call, status=status, approval_id=ev.approval_id)
    return Plan([APPEND])


def _approval_decided(
    ledger: Ledger, ev: ApprovalDecided, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    call = ledger.calls.get(ev.call_id)
    if call is None:
        raise ProtocolViolation("UNKNOWN_CALL", f"call {ev.call_id} was never requested")
    if call.approval_id is not None and call.approval_id != ev.approval_id:
        raise ProtocolViolation("APPROVAL_MISMATCH", f"call {call.call_id} awaits approval {call.approval_id}")
    if ev.args_hash != call.args_hash:
        raise ProtocolViolation("APPROVAL_MISMATCH", f"approval {ev.approval_id} is bound to other arguments")
    approved = ev.outcome is ApprovalOutcome.APPROVED
    if call.status is CallStatus.APPROVAL_PENDING:
        # The gateway acts on the decision next: executes, or records the refusal as a denial.
        ledger.update_call(call, status=CallStatus.APPROVED if approved else CallStatus.DECLINED)
        return Plan([APPEND])
    if call.status is not CallStatus.OUTCOME_UNKNOWN:
        raise ProtocolViolation("UNEXPECTED_DECISION", f"call {call.call_id} is {call.status}")
    # A decision on an unknown outcome: APPROVED lets the run go on as if the call had finished;
    # REJECTED stops the run (OUTCOME_UNKNOWN); EXPIRED stops it (APPROVAL_TIMEOUT).
    plan = Plan([APPEND])
    if approved:
        _finish_call(ledger, call, CallStatus.RESOLVED, error=call.error,
                     observation=f"outcome unknown; {ev.approver_id} let the run continue: {ev.comment}")
        if ledger.step_finished():
            plan.extend(_finish_step(ledger, guard, now_ms, tenant))
        return plan
    what = f"{call.call_id} {call.tool_name}"
    if ev.outcome is ApprovalOutcome.EXPIRED:
        return plan.extend(
            _terminate(ledger, Reason.APPROVAL_TIMEOUT, f"no decision on the unknown outcome of {what} in time", now_ms)
        )
    detail = f"{ev.approver_id} declined to continue after the unknown outcome of {what}"
    detail += f": {ev.comment}" if ev.comment else ""
    return plan.extend(_terminate(ledger, Reason.OUTCOME_UNKNOWN, detail, now_ms))


def _approval_decision_refused(
    ledger: Ledger, ev: ApprovalDecisionRefused, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    """A human's decision the approval service refused because the approval had already expired.
    A record of what did not happen: it changes nothing, so it is appended whatever the run's state
    and step (by the time it is read the expiry has usually ended the step, often the run), as long
    as the ledger still knows the call (not once the ended run is a tombstone)."""
    if ledger.tombstoned:
        return Plan(dropped="RUN_ENDED")  # it no longer remembers the event ids it appended
    call = ledger.calls.get(ev.call_id)
    if call is None:
        raise ProtocolViolation("UNKNOWN_CALL", f"call {ev.call_id} was never requested")
    if call.approval_id != ev.approval_id:
        raise ProtocolViolation("APPROVAL_MISMATCH", f"call {call.call_id} has approval {call.approval_id}")
    return Plan([APPEND])


def _run_completed(
    ledger: Ledger, ev: RunCompleted, guard: LoopGuard, now_ms: int, tenant: TenantLedger | None
) -> Plan:
    cur = _current_step(ledger, ev.step)
    if not cur.model_done or cur.tool_call_count != 0:
        raise ProtocolViolation("UNEXPECTED_COMPLETION", f"step {ev.step} did not end with a final answer")
    ledger.end(RunStatus.COMPLETED, "COMPLETED", now_ms)
    return Plan([APPEND])


_ACTIVE: dict[type[AvroRecord], Callable[[Ledger, Any, LoopGuard, int, TenantLedger | None], Plan]] = {
    ModelCallCompleted: _model_call_completed,
    ModelCallFailed: _model_call_failed,
    ToolCallRequested: _tool_call_requested,
    ToolCallCompleted: _tool_call_outcome,
    ToolCallFailed: _tool_call_outcome,
    ToolCallDenied: _tool_call_outcome,
    ToolCallOutcomeUnknown: _tool_call_outcome_unknown,
    ToolCallDeferred: _tool_call_deferred,
    ToolCallAuthorized: _tool_call_authorized,
    ApprovalRequested: _approval_requested,
    ApprovalDecided: _approval_decided,
    ApprovalDecisionRefused: _approval_decision_refused,
    RunCompleted: _run_completed,
}

INTAKE_TYPES = tuple(_ACTIVE)


# -- intake records after the run ended ------------------------------------------------------


def _after_end(ledger: Ledger, record: AvroRecord) -> Plan:
    """Only facts that really happened are still appended: the outcome of a call that was
    budgeted and still open (and the gateway's go for it, which precedes the outcome), and the
    model call of the granted step (it cost money)."""
    ended = Plan(dropped="RUN_ENDED")
    if isinstance(record, ToolCallAuthorized):
        # The gateway decided before it saw the end; the call is running and its outcome follows.
        call = ledger.calls.get(record.call_id)
        if call is None or call.step != record.step or call.idem_key != record.idem_key \
                or call.status is not CallStatus.BUDGETED:
            return ended
        _check_authorization(call, record)
        return Plan([APPEND])
    if isinstance(record, ToolCallCompleted | ToolCallFailed | ToolCallDenied | ToolCallOutcomeUnknown):
        call = ledger.calls.get(record.call_id)
        if call is None or call.step != record.step or call.idem_key != record.idem_key or call.status not in OPEN:
            return ended
        if isinstance(record, ToolCallOutcomeUnknown):
            if call.status not in _MAY_EXECUTE:
                return ended
            ledger.update_call(call, status=CallStatus.OUTCOME_UNKNOWN)
        else:
            _record_outcome(ledger, call, record)
        return Plan([APPEND])
    if isinstance(record, ModelCallCompleted | ModelCallFailed):
        cur = ledger.current
        if cur is None or cur.step != record.step or cur.model_done:
            return ended
        ledger.add_usage(record.usage)
        ledger.steps_done += 1
        cur.model_done = True
        cur.tool_call_count = record.tool_call_count if isinstance(record, ModelCallCompleted) else 0
        return Plan([APPEND])
    return ended


def _step_of(record: AvroRecord) -> int | None:
    """The step an intake record belongs to (an approval decision names it in its call id)."""
    step = getattr(record, "step", None)
    if isinstance(step, int):
        return step
    head, _, index = str(getattr(record, "call_id", "")).partition(".")
    return int(head) if head.isdigit() and index.isdigit() else None


def fold(ledger: Ledger, record: AvroRecord, *, event_id: str, tenant_id: str, guard: LoopGuard, now_ms: int,
         tenant: TenantLedger | None = None) -> Plan:
    """Sequence one intake record into the run: append it (or drop a duplicate / late request) and
    append the decisions it triggers. `tenant` is the run's tenant ledger when the run holds a
    tenant slot (grants and budgets then also check the tenant's spend and token rate)."""
    if tenant_id != ledger.tenant_id:
        raise ProtocolViolation("TENANT_MISMATCH", f"record of tenant {tenant_id} for a run of {ledger.tenant_id}")
    handler = _ACTIVE.get(type(record))
    if handler is None:
        raise ProtocolViolation("UNEXPECTED_RECORD", f"{record.AVRO_NAME} is not an intake record")
    if event_id in ledger.seen_event_ids:
        return Plan(dropped="DUPLICATE_EVENT")
    if isinstance(record, ApprovalDecisionRefused):
        return handler(ledger, record, guard, now_ms, tenant)  # neither the run's end nor its step matters
    if ledger.queued:
        raise ProtocolViolation("RUN_QUEUED", f"run {ledger.run_id} waits in its tenant's queue; nothing was granted")
    if not ledger.active:
        return _after_end(ledger, record)
    step = _step_of(record)
    if step is not None and ledger.is_stale(step):
        return Plan(dropped="STALE_STEP")
    plan = handler(ledger, record, guard, now_ms, tenant)
    if ledger.active:
        ledger.track_human_wait(now_ms)
    return plan


# -- timers ----------------------------------------------------------------------------------


@dataclass
class TickResult:
    """What a timer check did to a ledger."""

    plan: Plan = field(default_factory=Plan)
    changed: bool = False
    forget: bool = False


def tick(ledger: Ledger, *, now_ms: int, retention: Retention) -> TickResult:
    """Timers: the wall-clock cap of an active run (paused while it waits for a human), and the
    retention of an ended run's ledger (full → tombstone → forgotten). A queued run has no timer:
    its wall clock starts when it is accepted."""
    if ledger.queued:
        return TickResult()
    if ledger.active:
        if ledger.waiting_for_human:
            return TickResult()
        breach = _wall_clock_breach(ledger, now_ms)
        if breach is None:
            return TickResult()
        return TickResult(plan=_terminate(ledger, *breach, now_ms), changed=True)
    ended = ledger.ended_at_ms or 0
    if now_ms >= ended + retention.tombstone_ms:
        return TickResult(forget=True)
    if not ledger.tombstoned and now_ms >= ended + retention.ended_ledger_ms:
        ledger.tombstone()
        return TickResult(changed=True)
    return TickResult()


def tick_due(ledger: Ledger, *, now_ms: int, retention: Retention) -> bool:
    """Whether `tick` would change anything (a cheap read-only check of a run `wake_at` says is due)."""
    if ledger.queued:
        return False
    if ledger.active:
        return not ledger.waiting_for_human and now_ms >= ledger.deadline_at(now_ms)
    ended = ledger.ended_at_ms or 0
    return now_ms >= ended + retention.tombstone_ms or (
        not ledger.tombstoned and now_ms >= ended + retention.ended_ledger_ms
    )


def wake_at(ledger: Ledger, *, retention: Retention) -> int | None:
    """The earliest clock value at which `tick_due` holds, or None while nothing can become due
    before the ledger changes (queued, waiting for a human). The loop indexes ledgers by it, so
    a tick looks only at runs whose timer is due, not at every run parked on a human."""
    if ledger.queued:
        return None
    if ledger.active:
        if ledger.waiting_for_human:
            return None
        deadline = ledger.deadline_ms + ledger.human_wait_ms
        if ledger.waiting_since_ms is None:
            return deadline
        # A human-wait clock still running (see `Ledger.deadline_at`): the deadline moves with
        # the clock from `waiting_since_ms` on, so it is reached only if it came before that.
        return deadline if ledger.waiting_since_ms >= deadline else None
    ended = ledger.ended_at_ms or 0
    forget = ended + retention.tombstone_ms
    return forget if ledger.tombstoned else min(forget, ended + retention.ended_ledger_ms)
