"""The approval processor on the in-memory driver: approve, reject, expiry, refusals, webhook, unknown outcomes."""

from __future__ import annotations

import pytest

from tether_approval.domain.decisions import ApprovalPolicy, unknown_outcome_approval_id
from tether_approval.domain.state import Notification
from tether_approval.handlers import decided_event_id, refused_event_id
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    Remaining,
    RiskClass,
    RunCompleted,
    RunTerminated,
    StepGranted,
    TerminationReport,
    ToolCallCompleted,
    ToolCallOutcomeUnknown,
    Usage,
)
from tether_messaging.topics import RUN_INTAKE


def only_refusal(emitted):
    assert [e.topic for e in emitted] == [RUN_INTAKE]
    assert isinstance(emitted[0].payload, ApprovalDecisionRefused)
    return emitted[0]


def only_decision(emitted) -> ApprovalDecided:
    assert [e.topic for e in emitted] == [RUN_INTAKE]
    decided = emitted[0].payload
    assert isinstance(decided, ApprovalDecided)
    return decided


# -- decisions -------------------------------------------------------------------------------


def test_approve(h):
    assert h.requested() == []  # parking emits nothing
    h.driver.now_ms += 5_000
    out = h.decide(approve=True, comment="ok")
    decided = only_decision(out)
    assert decided == ApprovalDecided(
        approval_id="apr_1", call_id="1.0", args_hash=h.ARGS_HASH, outcome=ApprovalOutcome.APPROVED,
        approver_id="bob", comment="ok", decided_at_ms=h.T0 + 5_000,
    )
    env = out[0].envelope
    assert (env.run_id, env.tenant_id, env.producer, out[0].partition) == ("r1", "t1", "approval", 0)
    assert env.event_id == decided_event_id("r1", "apr_1")
    assert env.causation_id == h.last_command_id
    assert h.state().approvals["apr_1"].outcome is ApprovalOutcome.APPROVED
    assert h.decisions("APPROVED") == 1


def test_reject(h):
    h.requested()
    decided = only_decision(h.decide(approve=False, comment="no mail to the ceo"))
    assert (decided.outcome, decided.comment) == (ApprovalOutcome.REJECTED, "no mail to the ceo")
    assert h.decisions("REJECTED") == 1


def test_expiry_on_tick(h):
    grace = ApprovalPolicy().expiry_grace_ms
    h.requested(expires_in_ms=60_000)
    assert h.driver.tick() == []
    h.driver.now_ms += 60_000 + grace
    assert h.driver.tick() == []  # a decision made in time may still be unread (see below)
    h.driver.now_ms += 1
    decided = only_decision(h.driver.tick())
    assert (decided.outcome, decided.approver_id, decided.decided_at_ms) == (
        ApprovalOutcome.EXPIRED, "system", h.T0 + 60_000 + grace + 1)
    assert h.driver.tick() == []  # expired once
    assert h.decide() == []  # too late, and logged as not pending
    assert h.refusals("APPROVAL_NOT_PENDING") == 1
    assert h.decisions("EXPIRED") == 1


def test_a_decision_made_in_time_but_read_after_the_expiry_is_applied(h):
    # run-api records a decision before its record is readable on the commands topic, so a tick past
    # the expiry can come before a decision run-api recorded in time (and answered APPROVED).
    h.requested(expires_in_ms=60_000)
    expires_at = h.T0 + 60_000
    h.driver.now_ms = expires_at + 1
    assert h.driver.tick() == []  # not yet: within the grace
    decided = only_decision(h.decide(recorded_at_ms=expires_at - 100))
    assert (decided.outcome, decided.decided_at_ms) == (ApprovalOutcome.APPROVED, expires_at - 100)
    h.driver.now_ms = expires_at + ApprovalPolicy().expiry_grace_ms + 1
    assert h.driver.tick() == []
    assert h.decisions("EXPIRED") == 0 and h.refusals("APPROVAL_NOT_PENDING") == 0


def test_a_service_behind_on_its_commands_expires_nothing_until_it_has_read_through_the_grace(h):
    # Running, not restarted, but behind: the clock is past the expiry and the grace while the commands
    # partition is read only through a time before it (the loop's inputs_read_through_ms). A decision
    # run-api recorded in time may be in what is unread: no expiry yet, however often it ticks.
    grace = ApprovalPolicy().expiry_grace_ms
    h.requested(expires_in_ms=60_000)
    expires_at = h.T0 + 60_000
    h.driver.inputs_read_through_ms = expires_at + grace  # not after it
    h.driver.now_ms = expires_at + grace + 3_600_000
    assert h.driver.tick() == [] and h.driver.tick() == []
    decided = only_decision(h.decide(recorded_at_ms=expires_at - 100))  # read now, an hour late: it wins
    assert (decided.outcome, decided.decided_at_ms) == (ApprovalOutcome.APPROVED, expires_at - 100)
    h.driver.inputs_read_through_ms = None  # caught up
    assert h.driver.tick() == []
    assert (h.decisions("EXPIRED"), h.refusals("DECISION_AFTER_EXPIRY")) == (0, 0)


def test_a_service_behind_on_its_commands_expires_once_it_has_read_through_the_grace(h):
    grace = ApprovalPolicy().expiry_grace_ms
    h.requested(expires_in_ms=60_000)
    expires_at = h.T0 + 60_000
    h.driver.now_ms = expires_at + grace + 10_000
    h.driver.inputs_read_through_ms = expires_at + grace
    assert h.driver.tick() == []
    h.driver.inputs_read_through_ms = expires_at + grace + 1  # every decision recorded in time is read: none came
    decided = only_decision(h.driver.tick())
    assert (decided.outcome, decided.approver_id, decided.decided_at_ms) == (
        ApprovalOutcome.EXPIRED, "system", h.driver.now_ms)  # decided at the clock of the tick that saw it


def test_a_service_behind_expires_each_approval_as_its_commands_are_read_through_its_grace(h):
    grace = ApprovalPolicy().expiry_grace_ms
    h.accepted("r2")
    h.requested("apr_1", expires_in_ms=60_000)
    h.requested("apr_2", run_id="r2", expires_in_ms=120_000)
    h.driver.now_ms = h.T0 + 120_000 + grace + 3_600_000  # both due by the clock
    h.driver.inputs_read_through_ms = h.T0 + 60_000 + grace + 1  # read through only the first's grace
    assert only_decision(h.driver.tick()).approval_id == "apr_1"
    assert h.driver.tick() == []
    h.driver.inputs_read_through_ms = h.T0 + 120_000 + grace + 1
    assert only_decision(h.driver.tick()).approval_id == "apr_2"


def test_a_decision_made_in_time_but_read_after_the_grace_is_refused_as_such_and_expired_stands(h):
    # A decision whose record became readable later than the grace allows (run-api's produce took
    # longer, or the clocks differ by more) is read after the expiry decided: EXPIRED stays the
    # approval's one decision, but the human's decision run-api took in time is refused with its own
    # reason and counted by what it decided, not lost among duplicates (APPROVAL_NOT_PENDING).
    h.requested(expires_in_ms=60_000)
    expires_at = h.T0 + 60_000
    h.driver.now_ms = expires_at + ApprovalPolicy().expiry_grace_ms + 1
    assert only_decision(h.driver.tick()).outcome is ApprovalOutcome.EXPIRED
    # Each is put on the log as what it was (budget sequences it): a human's decision that did not
    # take effect belongs to the run's record, not only to this service's log lines.
    bob = only_refusal(h.decide(recorded_at_ms=expires_at - 100, comment="go ahead"))
    assert bob.payload == ApprovalDecisionRefused(
        approval_id="apr_1", call_id="1.0", approver_id="bob", approve=True, comment="go ahead",
        reason="DECISION_AFTER_EXPIRY", detail=bob.payload.detail, decided_at_ms=expires_at - 100,
        expires_at_ms=expires_at,
    )
    assert (bob.envelope.run_id, bob.envelope.tenant_id, bob.envelope.producer) == ("r1", "t1", "approval")
    assert bob.envelope.event_id == refused_event_id("r1", h.last_command_id)
    assert bob.envelope.causation_id == h.last_command_id
    carol = only_refusal(h.decide(approver="carol", approve=False, recorded_at_ms=expires_at))  # at expiry: in time
    assert (carol.payload.approver_id, carol.payload.approve) == ("carol", False)
    assert carol.envelope.event_id != bob.envelope.event_id  # one record per command
    late = h.registry.get_sample_value
    assert (late("tether_approval_decisions_after_expiry_total", {"decision": "approve"}),
            late("tether_approval_decisions_after_expiry_total", {"decision": "reject"})) == (1, 1)
    assert (h.refusals("DECISION_AFTER_EXPIRY"), h.refusals("APPROVAL_NOT_PENDING")) == (2, 0)
    # Recorded after the expiry, or one that would have been refused anyway: refused as before.
    assert h.decide(approver="dave") == []
    assert h.decide(approver="erin", roles=("viewer",), recorded_at_ms=expires_at - 1) == []
    assert h.decide(approver="frank", args_hash="0" * 64, recorded_at_ms=expires_at - 1) == []
    assert [h.refusals(r) for r in ("APPROVAL_NOT_PENDING", "NOT_AN_APPROVER", "STALE_ARGS_HASH")] == [1, 1, 1]
    assert h.refusals("DECISION_AFTER_EXPIRY") == 2
    assert h.state().approvals["apr_1"].outcome is ApprovalOutcome.EXPIRED
    assert h.driver.tick() == []


def test_a_duplicate_of_a_human_decision_is_not_pending_whenever_it_was_recorded(h):
    h.requested(expires_in_ms=60_000)
    only_decision(h.decide())
    assert h.decide(approver="carol", recorded_at_ms=h.T0 + 1) == []
    assert (h.refusals("APPROVAL_NOT_PENDING"), h.refusals("DECISION_AFTER_EXPIRY")) == (1, 0)


def test_the_expiry_grace_is_a_setting(make_harness):
    h = make_harness(ApprovalPolicy(expiry_grace_ms=0))
    h.requested(expires_in_ms=60_000)
    h.driver.now_ms += 60_000
    assert h.driver.tick() == []
    h.driver.now_ms += 1
    assert only_decision(h.driver.tick()).outcome is ApprovalOutcome.EXPIRED


def test_decision_recorded_after_expiry_is_refused_even_within_the_grace(h):
    h.requested(expires_in_ms=1_000)
    h.driver.now_ms += 1_001
    assert h.decide() == []
    assert h.refusals("APPROVAL_EXPIRED") == 1
    assert h.driver.tick() == []
    h.driver.now_ms += ApprovalPolicy().expiry_grace_ms
    assert only_decision(h.driver.tick()).outcome is ApprovalOutcome.EXPIRED


def test_wrong_tenant(h):
    h.requested()
    assert h.decide(tenant="t2") == []
    assert h.refusals("WRONG_TENANT") == 1
    assert h.state().approvals["apr_1"].pending
    assert only_decision(h.decide()).outcome is ApprovalOutcome.APPROVED  # the right tenant still can


def test_wrong_tenant_for_an_approval_not_requested_yet(h):
    assert h.decide(tenant="t2", approval_id="apr_9") == []
    assert h.refusals("WRONG_TENANT") == 1
    assert h.state().early == {}


def test_wrong_role(h):
    h.requested()
    assert h.decide(roles=("viewer", "admin")) == []
    assert h.refusals("NOT_AN_APPROVER") == 1
    assert h.state().approvals["apr_1"].pending


def test_approver_role_is_configurable(make_harness):
    h = make_harness(ApprovalPolicy(approver_role="release-manager"))
    h.requested()
    assert h.decide(roles=("approver",)) == []
    assert only_decision(h.decide(roles=("release-manager",))).outcome is ApprovalOutcome.APPROVED


def test_stale_args_hash(h):
    h.requested()
    assert h.decide(args_hash="f" * 64) == []
    assert h.refusals("STALE_ARGS_HASH") == 1
    assert h.state().approvals["apr_1"].pending


def test_call_mismatch(h):
    h.requested()
    assert h.decide(call_id="1.1") == []
    assert h.refusals("CALL_MISMATCH") == 1


def test_submitter_may_not_approve_own_run(h):
    h.requested()
    assert h.decide(approver="alice") == []
    assert h.refusals("SELF_APPROVAL") == 1
    assert only_decision(h.decide(approver="alice", approve=False)).outcome is ApprovalOutcome.REJECTED


def test_self_approval_allowed_when_the_policy_allows_it(make_harness):
    h = make_harness(ApprovalPolicy(forbid_self_approval=False))
    h.requested()
    assert only_decision(h.decide(approver="alice")).outcome is ApprovalOutcome.APPROVED


def test_duplicate_decision(h):
    h.requested()
    first = only_decision(h.decide(approver="bob"))
    assert h.decide(approver="bob") == []
    assert h.decide(approver="carol", approve=False) == []
    assert h.refusals("APPROVAL_NOT_PENDING") == 2
    # Our decision comes back sequenced; still decided, still refusing.
    h.event(first, what="decided")
    assert h.decide(approver="carol") == []
    assert h.refusals("APPROVAL_NOT_PENDING") == 3
    assert h.decisions("APPROVED") == 1


def test_a_decision_on_the_log_closes_the_approval(h):
    h.requested()
    h.event(ApprovalDecided(approval_id="apr_1", call_id="1.0", args_hash=h.ARGS_HASH,
                            outcome=ApprovalOutcome.REJECTED, approver_id="dave", decided_at_ms=h.T0), what="d")
    assert h.state().approvals["apr_1"].outcome is ApprovalOutcome.REJECTED
    assert h.decide() == []
    assert h.driver.tick() == []


def test_approvals_are_per_run(h):
    h.accepted("r2", principal="erin")
    h.requested("apr_1")
    h.requested("apr_2", run_id="r2")
    assert only_decision(h.decide(approval_id="apr_2", run_id="r2")).approval_id == "apr_2"
    assert h.state("r1").approvals["apr_1"].pending
    assert h.decide(approval_id="apr_1", run_id="r2") == []  # no such approval in r2: kept as early, then refused


# -- decisions that overtake their request ------------------------------------------------------


def test_decision_before_its_request_is_applied_when_the_request_arrives(h):
    assert h.decide(approval_id="apr_1") == []
    assert "apr_1" in h.state().early
    decided = only_decision(h.requested("apr_1"))
    assert (decided.outcome, decided.decided_at_ms) == (ApprovalOutcome.APPROVED, h.T0)
    assert h.state().early == {}


def test_early_decision_is_still_validated(h):
    h.decide(approval_id="apr_1", approver="alice")
    assert h.requested("apr_1") == []
    assert h.refusals("SELF_APPROVAL") == 1


def test_decision_for_a_run_never_seen_waits_then_is_refused(make_harness):
    h = make_harness(ApprovalPolicy(early_decision_ttl_ms=10_000))
    assert h.decide(run_id="r9") == []
    assert h.state("r9") is not None
    h.driver.now_ms += 10_001
    assert h.driver.tick() == []
    assert h.refusals("APPROVAL_NOT_FOUND") == 1
    assert h.state("r9") is None  # nothing left of the unknown run


def test_early_decisions_are_bounded(make_harness):
    h = make_harness(ApprovalPolicy(max_early_decisions=2))
    for i in range(3):
        h.decide(approval_id=f"apr_{i}")
    assert len(h.state().early) == 2
    assert (h.refusals("TOO_MANY_EARLY_DECISIONS"), h.refusals("APPROVAL_NOT_FOUND")) == (1, 0)


def test_a_second_early_decision_for_the_same_approval_is_refused_as_such(h):
    assert h.decide(approver="bob") == []
    assert h.decide(approver="carol", approve=False) == []
    assert (h.refusals("EARLY_DECISION_EXISTS"), h.refusals("APPROVAL_NOT_FOUND")) == (1, 0)
    decided = only_decision(h.requested())  # the first one kept is the one applied
    assert (decided.outcome, decided.approver_id) == (ApprovalOutcome.APPROVED, "bob")


# -- the run's end ---------------------------------------------------------------------------------


def test_state_dropped_when_the_run_completes(h):
    h.requested()
    h.event(RunCompleted(step=2, answer="done", usage=Usage()), what="completed")
    assert h.state() is None
    assert h.driver.tick() == []


def test_state_dropped_when_the_run_is_terminated(h):
    h.requested(expires_in_ms=1)
    report = TerminationReport(reason_code="CANCELLED", detail="", steps_done=1, tool_calls_done=[],
                               pending=["apr_1"], usage=Usage())
    h.event(RunTerminated(reason_code="CANCELLED", report=report), what="terminated")
    assert h.state() is None
    h.driver.now_ms += 10
    assert h.driver.tick() == []  # nothing expires for an ended run


@pytest.mark.parametrize("end", ["completed", "terminated"])
def test_a_request_redelivered_after_the_run_ended_changes_nothing(make_harness, end):
    # The request's webhook is still running (its input held) when the approver decides and the
    # run ends; the end is committed, then the process dies (or hands over while the webhook
    # retries past revoke_drain_ms) before the webhook is delivered: the loop re-delivers only
    # the held request, against no state.
    h = make_harness(webhook=True)
    request = h.approval_request(expires_in_ms=60_000)
    h.event(request, what=("approval", "apr_1"))
    assert list(h.driver.pending) == ["notify:apr_1"]
    assert only_decision(h.decide()).outcome is ApprovalOutcome.APPROVED
    h.event(_run_end(end), what=end)
    assert h.state() is None
    h.driver.pending.clear()
    assert h.event(request, what=("approval", "apr_1")) == []
    assert h.driver.pending == {}  # no webhook for an ended run
    assert h.state() is None
    h.driver.now_ms += 3_600_000  # long past the approval's expiry
    assert h.driver.tick() == []  # nothing to expire
    assert h.state() is None and h.notifier.sent == [] and h.decisions("EXPIRED") == 0


def test_a_request_redelivered_after_the_run_ended_leaves_a_late_decision_to_its_ttl(make_harness):
    # Same, with a (late, duplicate) decision read after the run's end: kept as an early decision
    # in a state that never saw RunAccepted. The re-delivered request must not revive the run there.
    h = make_harness(ApprovalPolicy(early_decision_ttl_ms=10_000), webhook=True)
    request = h.approval_request(expires_in_ms=60_000)
    h.event(request, what=("approval", "apr_1"))
    only_decision(h.decide())
    h.event(_run_end("completed"), what="completed")
    assert h.decide(approver="carol") == []
    assert list(h.state().early) == ["apr_1"]
    h.driver.pending.clear()
    assert h.event(request, what=("approval", "apr_1")) == []
    assert h.driver.pending == {} and h.state().approvals == {}
    h.driver.now_ms += 10_001
    assert h.driver.tick() == []
    assert h.refusals("APPROVAL_NOT_FOUND") == 1  # the late decision, refused after its TTL
    h.driver.now_ms += 3_600_000
    assert h.driver.tick() == []
    assert h.state() is None and h.notifier.sent == [] and h.decisions("EXPIRED") == 0


def _run_end(end: str):
    if end == "completed":
        return RunCompleted(step=2, answer="done", usage=Usage())
    report = TerminationReport(reason_code="CANCELLED", detail="", steps_done=1, tool_calls_done=[],
                               pending=[], usage=Usage())
    return RunTerminated(reason_code="CANCELLED", report=report)


def test_other_records_are_ignored(h):
    before = h.state()
    assert h.event(StepGranted(step=1, remaining=Remaining(steps=1, tokens=1, cost_usd_micros=1, wall_clock_ms=1)),
                   what="granted") == []
    assert h.state() == before


# -- the approver webhook ------------------------------------------------------------------------


def test_webhook_notifies_off_the_loop_and_records_delivery(make_harness):
    h = make_harness(webhook=True)
    assert h.requested() == []
    assert list(h.driver.pending) == ["notify:apr_1"]
    assert h.notifier.sent == []  # nothing sent on the loop thread
    assert h.state().approvals["apr_1"].notification is Notification.SENDING
    assert h.driver.run_work() == []  # a notification never emits to the log
    [sent] = h.notifier.sent
    assert (sent.approval_id, sent.run_id, sent.tenant_id, sent.call_id, sent.tool_name) == (
        "apr_1", "r1", "t1", "1.0", "send_email")
    assert sent.args == h.ARGS
    assert (sent.reasons, sent.provenance, sent.risk_class) == (["RISK_CLASS"], {"to": "goal"}, "IRREVERSIBLE")
    assert sent.expires_at_ms == h.T0 + 60_000
    assert h.state().approvals["apr_1"].notification is Notification.DELIVERED
    assert h.webhook("delivered") == 1


def test_failed_webhook_never_blocks_the_run(make_harness):
    h = make_harness(webhook="failing")
    h.requested()
    assert h.driver.run_work() == []
    assert h.state().approvals["apr_1"].notification is Notification.FAILED
    assert h.webhook("failed") == 1
    assert only_decision(h.decide()).outcome is ApprovalOutcome.APPROVED


def test_webhook_restarted_when_its_input_is_redelivered(make_harness):
    h = make_harness(webhook=True)
    h.requested()
    h.driver.pending.clear()  # the worker died with the process; the loop re-delivers the held input
    request = h.approval_request()
    h.event(request, what=("approval", "apr_1"))
    assert list(h.driver.pending) == ["notify:apr_1"]
    h.driver.run_work()
    assert len(h.notifier.sent) == 1
    h.event(request, what=("approval", "apr_1"))  # delivered now: a further replay does not resend
    assert h.driver.pending == {}


def test_no_webhook_configured(h):
    h.requested()
    assert h.driver.pending == {}
    assert h.state().approvals["apr_1"].notification is Notification.NOT_NEEDED


# -- unknown outcomes ----------------------------------------------------------------------------


def test_unknown_outcome_asks_a_human_and_the_answer_is_decided_like_any_approval(h):
    h.requested_call(call_id="1.0")
    idem = h.state().open_calls["1.0"].idem_key
    out = h.event(ToolCallOutcomeUnknown(step=1, call_id="1.0", idem_key=idem, tool_name="send_email",
                                         detail="crashed mid-call"), what="unknown")
    assert [e.topic for e in out] == [RUN_INTAKE]
    request = out[0].payload
    assert isinstance(request, ApprovalRequested)
    approval_id = unknown_outcome_approval_id("r1", idem)
    assert (request.approval_id, request.call_id, request.args_json, request.args_hash) == (
        approval_id, "1.0", h.ARGS_JSON, h.ARGS_HASH)
    assert (request.reasons, request.risk_class) == (["OUTCOME_UNKNOWN"], RiskClass.IRREVERSIBLE)
    assert request.expires_at_ms == h.T0 + ApprovalPolicy().outcome_unknown_ttl_ms
    # Asked once, however often the unknown outcome is read.
    assert h.event(ToolCallOutcomeUnknown(step=1, call_id="1.0", idem_key=idem, tool_name="send_email",
                                          detail="again"), what="unknown2") == []
    # Budget sequences the request; it comes back and is decided.
    h.event(request, what="unknown-approval")
    decided = only_decision(h.decide(approval_id=approval_id))
    assert decided.outcome is ApprovalOutcome.APPROVED
    h.event(decided, what="unknown-decided")
    assert "1.0" not in h.state().open_calls


def test_recovered_result_withdraws_the_unknown_outcome_approval(h):
    h.requested_call(call_id="1.0")
    idem = h.state().open_calls["1.0"].idem_key
    [out] = h.event(ToolCallOutcomeUnknown(step=1, call_id="1.0", idem_key=idem, tool_name="send_email",
                                           detail="?"), what="unknown")
    h.event(out.payload, what="unknown-approval")
    h.event(ToolCallCompleted(step=1, call_id="1.0", idem_key=idem, tool_name="send_email", result_json="{}",
                              duration_ms=3), what="completed")
    approval = h.state().approvals[out.payload.approval_id]
    assert approval.status == "WITHDRAWN"
    assert h.decide(approval_id=approval.approval_id) == []
    assert h.refusals("APPROVAL_NOT_PENDING") == 1
    h.driver.now_ms += ApprovalPolicy().outcome_unknown_ttl_ms + 1
    assert h.driver.tick() == []  # a withdrawn approval never expires into the log


def test_calls_of_idempotent_tools_are_not_remembered_and_cost_no_checkpoint(h):
    # The gateway re-runs an interrupted call of an idempotent tool, so its outcome is never
    # unknown: nothing to remember, no state to checkpoint for its request or its outcome.
    h.accepted("r2", tools=[h.tool("kv_get", RiskClass.READ_ONLY, idempotent=True), h.tool()])
    assert h.state("r2").unknown_outcome_tools == ["send_email"]
    puts = len(h.driver.puts)
    h.requested_call("r2", call_id="1.0", tool_name="kv_get")
    h.event(ToolCallCompleted(step=1, call_id="1.0", idem_key="k", tool_name="kv_get", result_json="{}",
                              duration_ms=1), "r2", what="completed-1.0")
    assert len(h.driver.puts) == puts and h.state("r2").open_calls == {}
    h.requested_call("r2", call_id="1.1")  # send_email is not idempotent: remembered
    assert list(h.state("r2").open_calls) == ["1.1"] and len(h.driver.puts) == puts + 1
    h.event(ToolCallCompleted(step=1, call_id="1.1", idem_key="k2", tool_name="send_email", result_json="{}",
                              duration_ms=1), "r2", what="completed-1.1")
    assert h.state("r2").open_calls == {} and len(h.driver.puts) == puts + 2


def test_state_without_the_tools_list_remembers_every_call(h):
    # A checkpoint of an older version (or a state begun before RunAccepted was read) does not
    # say which tools are idempotent: every call is remembered, as before.
    h.driver.states["r1"].unknown_outcome_tools = None
    h.requested_call(call_id="1.0", tool_name="kv_get")
    assert list(h.state().open_calls) == ["1.0"]


def test_unknown_outcome_of_a_call_never_seen_asks_nothing(h):
    assert h.event(ToolCallOutcomeUnknown(step=1, call_id="1.0", idem_key="x", tool_name="send_email",
                                          detail="?"), what="unknown") == []
