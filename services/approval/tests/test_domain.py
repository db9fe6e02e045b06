"""validate_decision and the state fold, as pure functions (what run-api can import to refuse early)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tether_approval.domain import errors
from tether_approval.domain.decisions import (
    ApprovalPolicy,
    call_finished,
    drop_stale_early,
    expire_due,
    park_early,
    record_decided,
    validate_decision,
)
from tether_approval.domain.state import Approval, Notification, RunApprovals
from tether_approval.entrypoint import ApprovalProcessor
from tether_contracts.records import ApprovalOutcome, DecideApproval

POLICY = ApprovalPolicy()
HASH = "a" * 64


def run(**approval_overrides) -> RunApprovals:
    approval = Approval(approval_id="apr_1", step=1, call_id="1.0", idem_key="k", tool_name="send_email",
                        args_hash=HASH, expires_at_ms=1_000, **approval_overrides)
    return RunApprovals(run_id="r1", tenant_id="t1", submitter_id="alice", approvals={"apr_1": approval})


def command(**over) -> DecideApproval:
    values = dict(approval_id="apr_1", call_id="1.0", args_hash=HASH, approver_id="bob",
                  approver_roles=["approver"], approve=True)
    values.update(over)
    return DecideApproval(**values)


def decide(cmd: DecideApproval, state: RunApprovals | None, *, tenant: str = "t1", at: int = 500,
           policy: ApprovalPolicy = POLICY):
    return validate_decision(cmd, state, tenant_id=tenant, decided_at_ms=at, policy=policy)


def test_valid_decision_is_bound_to_the_approval():
    decided = decide(command(approve=False, comment="no"), run())
    assert (decided.approval_id, decided.call_id, decided.args_hash, decided.outcome, decided.approver_id,
            decided.comment, decided.decided_at_ms) == ("apr_1", "1.0", HASH, ApprovalOutcome.REJECTED, "bob", "no", 500)


@pytest.mark.parametrize(
    ("cmd", "state", "kwargs", "error"),
    [
        (command(approval_id="apr_2"), run(), {}, errors.ApprovalNotFound),
        (command(), None, {}, errors.ApprovalNotFound),
        (command(), run(), {"tenant": "t2"}, errors.WrongTenant),
        (command(), run(outcome=ApprovalOutcome.APPROVED), {}, errors.ApprovalNotPending),
        (command(), run(withdrawn_by="tether.v1.ToolCallCompleted"), {}, errors.ApprovalNotPending),
        (command(call_id="1.1"), run(), {}, errors.CallMismatch),
        (command(approver_roles=["viewer"]), run(), {}, errors.NotAnApprover),
        (command(approver_roles=[]), run(), {}, errors.NotAnApprover),
        (command(approver_id="alice"), run(), {}, errors.SelfApproval),
        (command(args_hash="b" * 64), run(), {}, errors.StaleArgsHash),
        (command(), run(), {"at": 1_001}, errors.ApprovalExpired),
    ],
)
def test_refusals(cmd, state, kwargs, error):
    with pytest.raises(error) as refused:
        decide(cmd, state, **kwargs)
    assert refused.value.reason == error.reason
    assert refused.value.reason in str(refused.value)


def test_decided_exactly_at_expiry_is_in_time():
    assert decide(command(), run(), at=1_000).outcome is ApprovalOutcome.APPROVED


def test_tenant_is_checked_before_anything_about_the_approval_leaks():
    with pytest.raises(errors.WrongTenant):
        decide(command(args_hash="b" * 64), run(outcome=ApprovalOutcome.REJECTED), tenant="t2")


def test_submitter_unknown_fails_closed_for_approvals_only():
    state = run()
    state.submitter_id = None
    with pytest.raises(errors.SubmitterUnknown):
        decide(command(), state)
    assert decide(command(approve=False), state).outcome is ApprovalOutcome.REJECTED
    assert decide(command(), state, policy=ApprovalPolicy(forbid_self_approval=False)).outcome is ApprovalOutcome.APPROVED


def test_expire_due_marks_and_decides_once():
    state = run()
    policy = ApprovalPolicy(expiry_grace_ms=500)
    assert expire_due(state, 1_500, policy, now_ms=1_500) == []  # still within the grace
    [expired] = expire_due(state, 1_501, policy, now_ms=1_501)
    assert (expired.outcome, expired.approver_id, expired.decided_at_ms) == (ApprovalOutcome.EXPIRED, "system", 1_501)
    assert expire_due(state, 2_000, policy, now_ms=2_000) == []
    with pytest.raises(errors.DecisionAfterExpiry):  # recorded in time (500), read after the expiry: EXPIRED stands
        decide(command(), state)
    with pytest.raises(errors.ApprovalNotPending):  # recorded after the expiry
        decide(command(), state, at=1_001)


def test_expiry_goes_by_the_commands_read_through_not_by_the_clock():
    # The service is behind on its commands: the clock is far past the expiry and the grace, but the
    # commands partition is read only through a time within the grace. A decision recorded by the expiry
    # (at 1_000) may be readable as late as 1_000 + grace, unread: nothing expires.
    policy = ApprovalPolicy(expiry_grace_ms=500)
    state = run()
    assert expire_due(state, 1_500, policy, now_ms=10**9) == []
    assert state.approvals["apr_1"].pending
    # Read through 1_501: any decision recorded by the expiry has been read; none was, so it expires,
    # decided at the clock.
    [expired] = expire_due(state, 1_501, policy, now_ms=10**9)
    assert (expired.outcome, expired.decided_at_ms) == (ApprovalOutcome.EXPIRED, 10**9)


def test_a_stale_early_decision_goes_by_the_run_events_read_through():
    policy = ApprovalPolicy(early_decision_ttl_ms=1_000)
    state = run()
    park_early(state, command(approval_id="apr_9"), tenant_id="t1", decided_at_ms=500, event_id="e9", policy=policy)
    assert drop_stale_early(state, 1_500, policy) == []  # its request may still be unread
    [stale] = drop_stale_early(state, 1_501, policy)
    assert stale.command.approval_id == "apr_9" and state.early == {}


def test_first_decision_wins_but_the_log_beats_a_withdrawal():
    state = run()
    assert record_decided(state, decide(command(), state))
    assert not record_decided(state, decide(command(), run()))
    withdrawn = run()
    call_finished(withdrawn, "1.0", "tether.v1.ToolCallCompleted")
    assert withdrawn.approvals["apr_1"].status == "WITHDRAWN"
    assert record_decided(withdrawn, decide(command(), run()))
    assert withdrawn.approvals["apr_1"].status == "APPROVED"


def test_state_survives_its_changelog_codec():
    state = run(notification=Notification.SENDING)
    codec = ApprovalProcessor.state_codec
    assert codec.decode(codec.encode(state)) == state


def test_domain_imports_no_io_library():
    code = (
        "import sys, tether_approval.domain.decisions, tether_approval.domain.state; "
        "print(sorted(m for m in ('confluent_kafka', 'httpx', 'psycopg', 'redis', 'grpc', 'tether_messaging') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
