"""Approvals through the real services: approve, reject (a tool result for the model), refusals with
clear reasons (wrong tenant, wrong role, stale args hash), and a decision made while the rest is down."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from tether_api.v1 import approval_service_pb2 as approvals_pb, run_service_pb2 as runs_pb
from tether_contracts.records import ApprovalDecided, ApprovalOutcome, ToolCallCompleted, ToolCallDenied
from tether_messaging.serde import open_payload
from tether_run_api.cli.client import reason
from tether_testing.system import ApiClient

pytestmark = pytest.mark.e2e

GOAL = "[scenario:e2e-approvals] Tell the on-call."
OTHERS = ("budget", "planner", "tool-gateway", "approval", "projector")


def _pending(system, run_id: str, timeout_s: float = 120.0) -> approvals_pb.Approval:
    """The run's approval once the read model lists it as pending (ListApprovals, then GetApproval)."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = system.approver.approvals.ListApprovals(approvals_pb.ListApprovalsRequest(run_id=run_id),
                                                         metadata=system.approver.metadata, timeout=30).approvals
        if listed:
            got = system.approver.approvals.GetApproval(
                approvals_pb.GetApprovalRequest(approval_id=listed[0].approval_id),
                metadata=system.approver.metadata, timeout=30).approval
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"no pending approval for run {run_id} after {timeout_s:.0f}s")
        time.sleep(0.3)


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), reason(info.value)


def _mails(system, run_id: str) -> list[dict]:
    return [m for m in system.sink_records("smtp") if m.get("subject") == f"apr {run_id}"]


def test_approve_after_refusals_for_wrong_tenant_wrong_role_and_stale_args(tether_system, runs, event_log):
    system = tether_system
    run_id = system.client.submit(GOAL)
    approval = _pending(system, run_id)
    assert approval.tool_name == "send_email" and "RISK_CLASS" in approval.reasons

    other = system.bootstrap_tenant("other-tenant", principal_id="eve", approver_id="eve-approver")
    outsider = ApiClient(system.address, other.approver_key)
    try:
        code, why = _refusal(lambda: outsider.approvals.DecideApproval(approvals_pb.DecideApprovalRequest(
            approval_id=approval.approval_id, args_hash=approval.args_hash, approve=True),
            metadata=outsider.metadata, timeout=30))
    finally:
        outsider.close()
    assert (code, why) == (grpc.StatusCode.NOT_FOUND, "APPROVAL_NOT_FOUND")  # another tenant's: not even seen

    code, why = _refusal(lambda: system.client.approvals.DecideApproval(approvals_pb.DecideApprovalRequest(
        approval_id=approval.approval_id, args_hash=approval.args_hash, approve=True),
        metadata=system.client.metadata, timeout=30))
    assert (code, why) == (grpc.StatusCode.PERMISSION_DENIED, "MISSING_ROLE")  # the submitter is no approver

    code, why = _refusal(lambda: system.approver.approvals.DecideApproval(approvals_pb.DecideApprovalRequest(
        approval_id=approval.approval_id, args_hash="0" * 64, approve=True),
        metadata=system.approver.metadata, timeout=30))
    assert (code, why) == (grpc.StatusCode.FAILED_PRECONDITION, "STALE_ARGS_HASH")
    assert _mails(system, run_id) == []

    system.approver.decide(approval.approval_id, approval.args_hash, approve=True)
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
    assert len(_mails(system, run_id)) == 1
    payloads = [open_payload(e) for e in event_log.run(run_id)]
    decided = [p for p in payloads if isinstance(p, ApprovalDecided)]
    assert [(d.outcome, d.approver_id) for d in decided] == [(ApprovalOutcome.APPROVED, system.config.approver_id)]
    assert any(isinstance(p, ToolCallCompleted) and p.tool_name == "send_email" for p in payloads)


def test_a_rejection_goes_back_to_the_model_and_the_run_continues(tether_system, runs, event_log):
    system = tether_system
    run_id = system.client.submit(GOAL)
    approval = _pending(system, run_id)
    system.approver.decide(approval.approval_id, approval.args_hash, approve=False, comment="not today")
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
    payloads = [open_payload(e) for e in event_log.run(run_id)]
    denied = [p for p in payloads if isinstance(p, ToolCallDenied)]
    assert [d.reason_code for d in denied] == ["APPROVAL_REJECTED"]
    assert _mails(system, run_id) == []
    # The model's next turn quoted the tool result it got: the rejection.
    assert "APPROVAL_REJECTED" in run.answer or "not today" in run.answer, run.answer
    code, why = _refusal(lambda: system.approver.approvals.DecideApproval(approvals_pb.DecideApprovalRequest(
        approval_id=approval.approval_id, args_hash=approval.args_hash, approve=True),
        metadata=system.approver.metadata, timeout=30))
    assert (code, why) == (grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_NOT_PENDING")


def test_a_decision_made_while_the_services_are_down_is_acted_on_after_they_restart(tether_system, runs, event_log):
    system = tether_system
    run_id = system.client.submit(GOAL)
    approval = _pending(system, run_id)
    for name in OTHERS:
        system.kill(name, signal.SIGTERM)
    try:
        # Only run-api is up: it records the decision on the command topic.
        system.approver.decide(approval.approval_id, approval.args_hash, approve=True, comment="while down")
        system.kill("run-api", signal.SIGTERM)
        assert _mails(system, run_id) == []
    finally:
        for name in ("run-api", *OTHERS):
            system.restart(name)
    run = runs.wait_for_end(run_id, timeout_s=180)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
    assert len(_mails(system, run_id)) == 1
    decided = [p for p in (open_payload(e) for e in event_log.run(run_id)) if isinstance(p, ApprovalDecided)]
    assert [(d.outcome, d.comment) for d in decided] == [(ApprovalOutcome.APPROVED, "while down")]
