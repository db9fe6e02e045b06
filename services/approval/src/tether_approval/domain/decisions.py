"""Pure decisions of the approval service: validate an approver's decision, expire approvals, and ask a
human about a tool call whose outcome is unknown. Functions of recorded inputs only (no clock, no I/O)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tether_approval.domain.errors import (
    ApprovalExpired,
    ApprovalNotFound,
    ApprovalNotPending,
    CallMismatch,
    DecisionAfterExpiry,
    EarlyDecisionExists,
    NotAnApprover,
    SelfApproval,
    StaleArgsHash,
    SubmitterUnknown,
    TooManyEarlyDecisions,
    WrongTenant,
)
from tether_approval.domain.state import Approval, EarlyDecision, Notification, OpenCall, RunApprovals
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalOutcome,
    ApprovalRequested,
    DecideApproval,
    RiskClass,
    ToolCallOutcomeUnknown,
)

#: approver_id of decisions the service makes itself (expiry).
SYSTEM_APPROVER = "system"
#: Version of the rules below, recorded in the approvals this service requests.
POLICY_VERSION = "approval-v1"
OUTCOME_UNKNOWN_REASON = "OUTCOME_UNKNOWN"
DAY_MS = 24 * 3_600_000


@dataclass(frozen=True)
class ApprovalPolicy:
    """Who may decide an approval, and the service's time limits."""

    #: Role an approver must hold in the tenant (DecideApproval.approver_roles).
    approver_role: str = "approver"
    #: Separation of duties: the run's submitter may not approve its calls (rejecting stays allowed).
    forbid_self_approval: bool = True
    #: How long a human has to decide about a call whose outcome is unknown.
    outcome_unknown_ttl_ms: int = 7 * DAY_MS
    #: Decisions kept per run while their ApprovalRequested has not been read yet.
    max_early_decisions: int = 32
    #: How long such an early decision waits for its request before it is refused.
    early_decision_ttl_ms: int = DAY_MS
    #: The longest a decision run-api recorded at `decided_at_ms` (and answered APPROVED) may take
    #: to be on the commands topic: its produce (run-api's delivery timeout) and the two
    #: hosts' clocks. Expiry waits until the commands partition is read through `expires_at_ms` +
    #: this (`expire_due`), so a decision recorded by `expires_at_ms` has been read and wins.
    expiry_grace_ms: int = 30_000


def canonical_json(value: Any) -> str:
    """The run protocol's canonical JSON (sorted keys, no whitespace, UTF-8)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- an approver's decision ----------------------------------------------------------------------


def validate_decision(
    command: DecideApproval,
    run: RunApprovals | None,
    *,
    tenant_id: str,
    decided_at_ms: int,
    policy: ApprovalPolicy,
) -> ApprovalDecided:
    """The ApprovalDecided a DecideApproval stands for, or a DecisionRefused naming why not.

    `tenant_id` is the command's authenticated tenant (its envelope), `decided_at_ms` the time
    the decision was recorded (the command's `recorded_at_ms`), so a replay decides the same.
    run-api may call this with the read model's view of the run to refuse early.
    """
    approval = None if run is None else run.approvals.get(command.approval_id)
    if run is None or approval is None:
        raise ApprovalNotFound(f"approval {command.approval_id} is not known", approval_id=command.approval_id)
    if run.tenant_id != tenant_id:
        # Checked before anything else about the approval, so nothing leaks across tenants.
        raise WrongTenant(
            f"tenant {tenant_id} may not decide approvals of another tenant's run",
            approval_id=approval.approval_id, tenant_id=tenant_id,
        )
    # Recorded in time, read after the expiry (and its grace) decided the approval: refused with its
    # own reason once the other checks pass, so a human decision that was lost is told from a duplicate.
    after_expiry = approval.outcome is ApprovalOutcome.EXPIRED and decided_at_ms <= approval.expires_at_ms
    if not approval.pending and not after_expiry:
        raise ApprovalNotPending(
            f"approval {approval.approval_id} is already {approval.status}",
            approval_id=approval.approval_id, status=approval.status,
        )
    if command.call_id != approval.call_id:
        raise CallMismatch(
            f"approval {approval.approval_id} is for call {approval.call_id}, not {command.call_id}",
            approval_id=approval.approval_id, call_id=command.call_id,
        )
    if policy.approver_role not in command.approver_roles:
        raise NotAnApprover(
            f"{command.approver_id} lacks the role {policy.approver_role!r}",
            approver_id=command.approver_id, roles=list(command.approver_roles),
        )
    if command.approve and policy.forbid_self_approval:
        if run.submitter_id is None:
            raise SubmitterUnknown(
                f"the submitter of run {run.run_id} is unknown, so self-approval cannot be ruled out",
                approval_id=approval.approval_id,
            )
        if command.approver_id == run.submitter_id:
            raise SelfApproval(
                f"{command.approver_id} submitted run {run.run_id} and may not approve its calls",
                approval_id=approval.approval_id, approver_id=command.approver_id,
            )
    if command.args_hash != approval.args_hash:
        raise StaleArgsHash(
            f"the decision is for args {command.args_hash[:12]}…, the call awaits {approval.args_hash[:12]}…",
            approval_id=approval.approval_id,
        )
    if after_expiry:
        raise DecisionAfterExpiry(
            f"decided at {decided_at_ms}, in time for the expiry at {approval.expires_at_ms}, but read after the"
            " approval had expired (EXPIRED stands)",
            approval_id=approval.approval_id, recorded_at_ms=decided_at_ms, expires_at_ms=approval.expires_at_ms,
        )
    if decided_at_ms > approval.expires_at_ms:
        raise ApprovalExpired(
            f"decided at {decided_at_ms}, expired at {approval.expires_at_ms}",
            approval_id=approval.approval_id,
        )
    return ApprovalDecided(
        approval_id=approval.approval_id,
        call_id=approval.call_id,
        args_hash=approval.args_hash,
        outcome=ApprovalOutcome.APPROVED if command.approve else ApprovalOutcome.REJECTED,
        approver_id=command.approver_id,
        comment=command.comment,
        decided_at_ms=decided_at_ms,
    )


# -- folding the log -------------------------------------------------------------------------------


def record_request(run: RunApprovals, event: ApprovalRequested, *, event_id: str, notify: bool) -> Approval | None:
    """Park the call: add the pending approval (None if it was already known)."""
    if event.approval_id in run.approvals:
        return None
    approval = Approval(
        approval_id=event.approval_id,
        step=event.step,
        call_id=event.call_id,
        idem_key=event.idem_key,
        tool_name=event.tool_name,
        args_hash=event.args_hash,
        expires_at_ms=event.expires_at_ms,
        reasons=list(event.reasons),
        requested_event_id=event_id,
        notification=Notification.SENDING if notify else Notification.NOT_NEEDED,
    )
    run.approvals[approval.approval_id] = approval
    return approval


def record_decided(run: RunApprovals, decided: ApprovalDecided) -> bool:
    """Mark the approval decided (first decision wins); True if that changed anything."""
    approval = run.approvals.get(decided.approval_id)
    changed = False
    if approval is not None and approval.outcome is None:  # a decision on the log beats a local withdrawal
        approval.outcome = decided.outcome
        approval.decided_by = decided.approver_id
        changed = True
    call = run.open_calls.get(decided.call_id)
    if call is not None and call.outcome_unknown_approval_id == decided.approval_id:
        del run.open_calls[decided.call_id]  # the human settled the unknown outcome
        changed = True
    return changed


def expire_due(run: RunApprovals, read_through_ms: int, policy: ApprovalPolicy, *, now_ms: int) -> list[ApprovalDecided]:
    """EXPIRED decisions (decided at `now_ms`) for every pending approval whose expiry and grace
    (`ApprovalPolicy.expiry_grace_ms`) lie before `read_through_ms`, marked decided.

    `read_through_ms` is a time such that every command appended by then to the run's commands
    partition has been read (the loop's `inputs_read_through_ms`; ≤ `now_ms`). Expiry decides
    that no decision came in time; the rule that makes that true: a decision recorded by
    `expires_at_ms` is on the topic by `expires_at_ms + grace` (what the grace bounds), so once the
    partition is read through a later time it has been read, and applied. The wall clock alone
    (`now_ms`) is not enough: a service behind on its commands (a backlog after a restart, a slow
    or starved consumer, delayed fetches) would expire an approval whose decision waits unread.
    """
    expired = []
    for approval in run.pending():
        if read_through_ms > approval.expires_at_ms + policy.expiry_grace_ms:
            decided = ApprovalDecided(
                approval_id=approval.approval_id,
                call_id=approval.call_id,
                args_hash=approval.args_hash,
                outcome=ApprovalOutcome.EXPIRED,
                approver_id=SYSTEM_APPROVER,
                comment="no decision before the approval expired",
                decided_at_ms=now_ms,
            )
            record_decided(run, decided)
            expired.append(decided)
    return expired


# -- decisions that arrive before their request -----------------------------------------------------


def park_early(
    run: RunApprovals, command: DecideApproval, *, tenant_id: str, decided_at_ms: int, event_id: str,
    policy: ApprovalPolicy,
) -> None:
    """Keep a decision for an approval not requested yet, or refuse it: one already waits for
    that approval (`EarlyDecisionExists`), or the run keeps the most allowed (`TooManyEarlyDecisions`)."""
    if command.approval_id in run.early:
        raise EarlyDecisionExists(
            f"a decision for approval {command.approval_id} already waits for its request",
            approval_id=command.approval_id, waiting_event_id=run.early[command.approval_id].event_id,
        )
    if len(run.early) >= policy.max_early_decisions:
        raise TooManyEarlyDecisions(
            f"run {run.run_id} already keeps {len(run.early)} decisions waiting for their requests",
            approval_id=command.approval_id, limit=policy.max_early_decisions,
        )
    run.early[command.approval_id] = EarlyDecision(
        command=command, tenant_id=tenant_id, decided_at_ms=decided_at_ms, event_id=event_id
    )


def take_early(run: RunApprovals, approval_id: str) -> EarlyDecision | None:
    return run.early.pop(approval_id, None)


def drop_stale_early(run: RunApprovals, read_through_ms: int, policy: ApprovalPolicy) -> list[EarlyDecision]:
    """Early decisions whose request never came within the TTL (removed). By the run events read
    through (`read_through_ms`, as in `expire_due`), not the wall clock: run-api took the decision
    after it saw the request, so a request that exists was on the log long before the TTL ends."""
    stale = [e for e in run.early.values() if read_through_ms - e.decided_at_ms > policy.early_decision_ttl_ms]
    for e in stale:
        del run.early[e.command.approval_id]
    return stale


def wake_at(run: RunApprovals, policy: ApprovalPolicy) -> int | None:
    """The earliest clock value at which `expire_due` or `drop_stale_early` may have something to do
    (both act strictly after their limit, once the input is read through it, which is never later
    than the clock), or None: the loop's timer index for the run."""
    times = [a.expires_at_ms + policy.expiry_grace_ms + 1 for a in run.pending()]
    times += [e.decided_at_ms + policy.early_decision_ttl_ms + 1 for e in run.early.values()]
    return min(times, default=None)


# -- unknown outcomes -----------------------------------------------------------------------------


def unknown_outcome_approval_id(run_id: str, idem_key: str) -> str:
    """Deterministic id of the approval asked for after a call's outcome became unknown."""
    return "unk_" + sha256_hex(f"{run_id}\x1f{idem_key}\x1foutcome-unknown")[:32]


def request_for_unknown_outcome(
    run: RunApprovals, event: ToolCallOutcomeUnknown, *, now_ms: int, policy: ApprovalPolicy
) -> ApprovalRequested | None:
    """An ApprovalRequested asking a human whether the run may go on after a non-idempotent call's
    outcome became unknown (APPROVED = continue, REJECTED = stop). None when the call's arguments
    are not known here or a request was already made. Marks the call."""
    call = run.open_calls.get(event.call_id)
    if call is None or call.outcome_unknown_approval_id is not None:
        return None
    approval_id = unknown_outcome_approval_id(run.run_id, call.idem_key)
    inputs = {
        "kind": "outcome_unknown",
        "call_id": call.call_id,
        "idem_key": call.idem_key,
        "tool_name": call.tool_name,
        "args_hash": call.args_hash,
        "detail": event.detail,
        "requested_at_ms": now_ms,
        "ttl_ms": policy.outcome_unknown_ttl_ms,
    }
    call.outcome_unknown_approval_id = approval_id
    return ApprovalRequested(
        approval_id=approval_id,
        step=call.step,
        call_id=call.call_id,
        idem_key=call.idem_key,
        tool_name=call.tool_name,
        args_json=call.args_json,
        args_hash=call.args_hash,
        risk_class=run.tool_risk.get(call.tool_name, RiskClass.IRREVERSIBLE),
        reasons=[OUTCOME_UNKNOWN_REASON],
        provenance_json=call.provenance_json,
        expires_at_ms=now_ms + policy.outcome_unknown_ttl_ms,
        policy_version=POLICY_VERSION,
        inputs_hash=sha256_hex(canonical_json({"policy_version": POLICY_VERSION, "inputs": inputs})),
    )


def track_call(run: RunApprovals, call: OpenCall) -> bool:
    """Remember a requested call until its outcome is known, if its outcome can be unknown;
    False when there is nothing to remember (an idempotent tool's call, or already remembered)."""
    if run.unknown_outcome_tools is not None and call.tool_name not in run.unknown_outcome_tools:
        return False  # the gateway re-runs an interrupted call of an idempotent tool: never unknown
    if call.call_id in run.open_calls:
        return False
    run.open_calls[call.call_id] = call
    return True


def concerns_call(run: RunApprovals, call_id: str) -> bool:
    """True if the run's state holds anything about the call: its arguments or a pending approval."""
    return call_id in run.open_calls or any(a.call_id == call_id for a in run.pending())


def call_finished(run: RunApprovals, call_id: str, outcome_type: str) -> list[Approval]:
    """Forget a call that reached a terminal outcome (Completed, Failed, Denied); returns the
    approvals of that call still pending, now withdrawn because no decision can affect them
    (e.g. the gateway recovered the result of a call whose outcome had been unknown)."""
    run.open_calls.pop(call_id, None)
    moot = [a for a in run.pending() if a.call_id == call_id]
    for approval in moot:
        approval.withdrawn_by = outcome_type
    return moot
