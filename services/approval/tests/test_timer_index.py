"""The approval service's timer index: a run is due exactly when expiry or a stale early decision has work."""

from __future__ import annotations

from tether_approval.domain.decisions import ApprovalPolicy, drop_stale_early, expire_due, wake_at
from tether_approval.domain.state import Approval, EarlyDecision, RunApprovals
from tether_contracts.records import ApprovalOutcome, DecideApproval

POLICY = ApprovalPolicy(early_decision_ttl_ms=10_000, expiry_grace_ms=500)


def _approval(approval_id: str, expires_at_ms: int, **fields) -> Approval:
    return Approval(approval_id=approval_id, step=1, call_id=f"1.{approval_id}", idem_key=approval_id,
                    tool_name="send_email", args_hash="h", expires_at_ms=expires_at_ms, **fields)


def _early(approval_id: str, decided_at_ms: int) -> EarlyDecision:
    command = DecideApproval(approval_id=approval_id, call_id="1.9", args_hash="h", approver_id="a",
                             approver_roles=["approver"], approve=True)
    return EarlyDecision(command=command, tenant_id="t1", decided_at_ms=decided_at_ms, event_id="e")


def _has_work(run: RunApprovals, now_ms: int) -> bool:
    copy = run.model_copy(deep=True)
    # Caught up (read through the clock): the earliest the tick can act, which the timer must not pass.
    return bool(expire_due(copy, now_ms, POLICY, now_ms=now_ms)) or bool(drop_stale_early(copy, now_ms, POLICY))


def test_a_run_is_due_exactly_from_its_wake_time() -> None:
    runs = [
        RunApprovals(run_id="r1", approvals={"a": _approval("a", 5_000), "b": _approval("b", 3_000)}),
        RunApprovals(run_id="r2", approvals={"a": _approval("a", 5_000)}, early={"x": _early("x", 1_000)}),
        RunApprovals(run_id="r3", early={"x": _early("x", 1_000)}),
    ]
    for run in runs:
        wake = wake_at(run, POLICY)
        for now in (0, 2_999, 3_000, 3_001, 3_499, 3_500, 3_501, 4_999, 5_000, 5_001, 5_499, 5_500, 5_501,
                    10_999, 11_000, 11_001, 10**9):
            assert _has_work(run, now) == (now >= wake), (run.run_id, now, wake)


def test_a_run_with_nothing_pending_has_no_timer() -> None:
    decided = _approval("a", 5_000, outcome=ApprovalOutcome.APPROVED)
    withdrawn = _approval("b", 5_000, withdrawn_by="ToolCallCompleted")
    assert wake_at(RunApprovals(run_id="r1", approvals={"a": decided, "b": withdrawn}), POLICY) is None
    assert wake_at(RunApprovals(run_id="r2"), POLICY) is None
