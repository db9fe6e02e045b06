"""The budget processor on the in-memory driver: admission, sequencing, grants, caps, cancel, parking."""

from __future__ import annotations

import pytest

from tether_budget.domain.ledger import CallStatus, RunStatus
from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    CancelRun,
    DecideApproval,
    ModelRef,
    RiskClass,
    RunAccepted,
    RunCompleted,
    RunRejected,
    RunTerminated,
    StepGranted,
    SubmitRun,
    ToolCall,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallDeferred,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
    Usage,
)
from tether_messaging.envelopes import derived_id
from tether_messaging.errors import Unprocessable
from tether_messaging.topics import COMMANDS, RUN_INTAKE


def _types(records) -> list[str]:
    return [type(r).__name__ for r in records]


# -- the happy path --------------------------------------------------------------------------


def test_a_full_run_is_accepted_granted_budgeted_and_completed(harness) -> None:
    h = harness
    out = h.submit()
    assert _types(out) == ["RunAccepted", "StepGranted"]
    accepted, granted = out
    assert accepted.deadline_ms == h.driver.now_ms + 600_000
    assert granted.step == 1 and granted.remaining.steps == 9 and granted.loop_warning is None

    assert _types(h.model(1, 3, tokens=1_000, cost=2_000)) == ["ModelCallCompleted"]
    for i in range(3):
        out = h.request(1, i)
        assert _types(out) == ["ToolCallRequested", "ToolCallBudgeted"]
        assert out[1].call_id == f"1.{i}" and out[1].remaining.tokens == 99_000
    assert _types(h.done("1.0")) == ["ToolCallCompleted"]
    assert _types(h.failed("1.1")) == ["ToolCallFailed"]
    out = h.denied("1.2")
    assert _types(out) == ["ToolCallDenied", "StepGranted"]
    assert out[1].step == 2 and out[1].remaining.cost_usd_micros == 998_000

    assert _types(h.model(2, 0, text="Cheapest is X")) == ["ModelCallCompleted"]
    assert _types(h.complete(step=2)) == ["RunCompleted"]

    log = h.log()
    assert [e.seq for e in log] == list(range(1, 16))
    assert [e.producer for e in log][:2] == ["budget", "budget"]
    assert {e.producer for e in log} == {"budget", "planner", "tool-gateway"}
    ledger = h.ledger()
    assert ledger.status is RunStatus.COMPLETED and ledger.steps_done == 2
    assert h.metric("tether_budget_runs_accepted_total") == 1
    assert h.metric("tether_budget_steps_granted_total") == 2
    assert h.metric("tether_budget_tool_calls_budgeted_total") == 3
    assert h.metric("tether_budget_runs_completed_total") == 1


def test_budget_decisions_are_caused_by_their_inputs_and_have_deterministic_ids(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    log = h.log()
    requested, budgeted = log[-2], log[-1]
    assert budgeted.causation_id == requested.event_id
    other = type(h)()
    other.submit()
    other.model(1, 1)
    other.request(1, 0)
    assert [e.event_id for e in other.log()] == [e.event_id for e in log]
    assert [e.hash for e in other.log()] == [e.hash for e in log]  # same inputs + clock → same chain


# -- rejection and duplicates ----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad,reason",
    [
        (dict(max_steps=0), "INVALID_CAPS"),
        (dict(max_tokens=-1), "INVALID_CAPS"),
        (dict(max_wall_clock_ms=10**12), "CAPS_ABOVE_CEILING"),
    ],
)
def test_invalid_caps_are_rejected(harness, bad: dict, reason: str) -> None:
    out = harness.submit(run_caps=harness.caps(**bad))
    assert _types(out) == ["RunRejected"]
    assert out[0].reason_code == reason and out[0].request_id == "req-r1"
    assert harness.log()[0].seq == 1
    assert harness.metric("tether_budget_runs_rejected_total", reason=reason) == 1
    assert harness.ledger().status is RunStatus.REJECTED


def test_duplicate_tool_names_are_rejected(harness) -> None:
    h = harness
    out = h.submit(tools=[h.tool("search"), h.tool("search")])
    assert _types(out) == ["RunRejected"] and out[0].reason_code == "INVALID_TOOLS"


def test_a_repeated_submit_is_dropped_and_a_conflicting_one_refused(harness) -> None:
    h = harness
    h.submit()
    assert h.submit() == []  # same event id
    assert h.submit(event_id="another-id") == []  # same request id
    with pytest.raises(Unprocessable) as err:
        h.submit(request_id="other-request", event_id="x")
    assert err.value.reason == "RUN_EXISTS"
    assert len(h.log()) == 2


def test_a_duplicate_intake_event_is_dropped(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 2)
    assert h.model(1, 2) == []
    h.request(1, 0)
    assert h.request(1, 0) == []
    assert h.metric("tether_budget_records_dropped_total", reason="DUPLICATE_EVENT") == 2
    assert _types(h.log_payloads()) == ["RunAccepted", "StepGranted", "ModelCallCompleted", "ToolCallRequested", "ToolCallBudgeted"]


# -- caps ------------------------------------------------------------------------------------


def test_step_cap_stops_the_run_before_granting_a_step_over_it(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_steps=2))
    assert _types(h.step(1, 1)) == ["ToolCallCompleted", "StepGranted"]
    out = h.step(2, 2)
    assert _types(out) == ["ToolCallCompleted", "RunTerminated"]
    report = out[1].report
    assert out[1].reason_code == "STEP_CAP" == report.reason_code
    assert report.steps_done == 2
    assert report.tool_calls_done == ["1.0 search COMPLETED", "2.0 search COMPLETED", "2.1 search COMPLETED"]
    assert report.pending == [] and report.usage.input_tokens == 100
    assert "max_steps" in report.suggested_next_action
    assert h.metric("tether_budget_runs_terminated_total", reason="STEP_CAP") == 1


def test_token_cap_exceeded_by_a_model_call_stops_the_run_at_once(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_tokens=1_000))
    out = h.model(1, 2, tokens=1_001)
    assert _types(out) == ["ModelCallCompleted", "RunTerminated"]
    assert out[1].reason_code == "TOKEN_CAP"
    assert out[1].report.pending == ["2 tool call(s) of step 1 not yet requested"]
    assert h.request(1, 0) == []  # a request after the end is dropped, not budgeted
    assert h.metric("tether_budget_records_dropped_total", reason="RUN_ENDED") == 1


def test_tokens_used_up_exactly_end_the_run_at_the_next_grant(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_tokens=1_000))
    out = h.step(1, 1, tokens=1_000)
    assert _types(out) == ["ToolCallCompleted", "RunTerminated"]
    assert out[1].reason_code == "TOKEN_CAP"


def test_cost_cap(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_cost_usd_micros=5_000))
    h.step(1, 1, cost=3_000)
    out = h.model(2, 1, cost=3_000)
    assert _types(out) == ["ModelCallCompleted", "RunTerminated"]
    assert out[1].reason_code == "COST_CAP" and out[1].report.usage.cost_usd_micros == 6_000


def test_tool_call_cap_refuses_the_call_over_it(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_tool_calls=2))
    h.model(1, 3)
    h.request(1, 0)
    h.request(1, 1)
    out = h.request(1, 2)
    assert _types(out) == ["ToolCallRequested", "RunTerminated"]
    report = out[1].report
    assert report.reason_code == "TOOL_CALL_CAP"
    assert report.tool_calls_done == ["1.2 search NOT_BUDGETED"]
    assert [p.split(" ")[0] for p in report.pending] == ["1.0", "1.1"]
    # The two budgeted calls may still run: their outcomes are facts and are still appended.
    assert _types(h.done("1.0")) == ["ToolCallCompleted"]


def test_wall_clock_cap_is_enforced_by_the_tick(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_wall_clock_ms=60_000))
    h.driver.now_ms += 59_999
    assert h.tick() == []
    h.driver.now_ms += 1
    out = h.tick()
    assert _types(out) == ["RunTerminated"]
    assert out[0].reason_code == "WALL_CLOCK_CAP"
    assert out[0].report.pending == ["model call for step 1"]
    assert h.tick() == []


def test_wall_clock_is_checked_before_budgeting_a_tool_call(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_wall_clock_ms=60_000))
    h.model(1, 1)
    h.driver.now_ms += 60_000
    out = h.request(1, 0)
    assert _types(out) == ["ToolCallRequested", "RunTerminated"]
    assert out[1].reason_code == "WALL_CLOCK_CAP"


def test_model_failures_end_the_run(harness) -> None:
    h = harness
    h.submit()
    out = h.model_failed(1, "PROVIDER_ERROR")
    assert _types(out) == ["ModelCallFailed", "RunTerminated"]
    assert out[1].reason_code == "MODEL_FAILED" and "PROVIDER_ERROR" in out[1].report.last_error
    h.submit("r2")
    out = h.model_failed(1, "CONTEXT_OVERFLOW", run_id="r2")
    assert out[1].reason_code == "CONTEXT_OVERFLOW"


# -- cancel and events after the end ---------------------------------------------------------


def test_cancel_by_the_tenant_terminates_with_a_report(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 2)
    h.request(1, 0)
    h.request(1, 1)
    h.done("1.0")
    out = h.cancel(principal="carol")
    assert _types(out) == ["RunTerminated"]
    report = out[0].report
    assert report.reason_code == "CANCELLED" and "carol" in report.detail
    assert report.tool_calls_done == ["1.0 search COMPLETED"]
    assert report.pending[0].startswith("1.1 search BUDGETED")
    assert h.cancel() == []  # already ended


def test_cancel_from_another_tenant_is_refused(harness) -> None:
    h = harness
    h.submit()
    with pytest.raises(Unprocessable) as err:
        h.cancel(tenant="t2")
    assert err.value.reason == "CANCEL_FORBIDDEN"
    assert h.ledger().status is RunStatus.ACTIVE


def test_after_termination_only_facts_of_side_effects_are_appended(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 3)
    h.request(1, 0)
    h.request(1, 1)
    h.cancel()
    # A call that was budgeted before the cancel finished: the audit needs it.
    assert _types(h.done("1.0")) == ["ToolCallCompleted"]
    assert h.done("1.0") == []  # its replay is still a duplicate
    # Requests are dropped: nothing new runs after RunTerminated.
    assert h.request(1, 2) == []
    assert h.complete() == []
    assert h.ledger().calls["1.0"].status is CallStatus.COMPLETED
    assert _types(h.unknown("1.1")) == ["ToolCallOutcomeUnknown"]
    assert h.log_payloads()[-1].__class__ is ToolCallOutcomeUnknown


def test_a_model_call_finishing_after_a_cancel_is_recorded_with_its_cost(harness) -> None:
    h = harness
    h.submit()
    h.cancel()
    assert _types(h.model(1, 2, cost=7_000)) == ["ModelCallCompleted"]
    assert h.ledger().usage.cost_usd_micros == 7_000
    assert h.request(1, 0) == []


# -- approvals and unknown outcomes ----------------------------------------------------------


def test_an_approved_call_runs_and_the_step_continues(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    assert _types(h.approval_requested("1.0")) == ["ApprovalRequested"]
    assert h.ledger().calls["1.0"].status is CallStatus.APPROVAL_PENDING
    assert _types(h.decided("1.0", ApprovalOutcome.APPROVED)) == ["ApprovalDecided"]
    assert _types(h.done("1.0")) == ["ToolCallCompleted", "StepGranted"]


def test_a_rejected_approval_becomes_a_denial_and_the_run_goes_on(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    h.approval_requested("1.0")
    h.decided("1.0", ApprovalOutcome.REJECTED)
    assert h.ledger().calls["1.0"].status is CallStatus.DECLINED
    assert _types(h.denied("1.0", reason="APPROVAL_REJECTED")) == ["ToolCallDenied", "StepGranted"]


def test_waiting_for_a_human_pauses_the_wall_clock(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_wall_clock_ms=60_000))
    h.model(1, 1)
    h.request(1, 0)
    h.driver.now_ms += 10_000
    h.approval_requested("1.0")
    h.driver.now_ms += 3_600_000  # an hour waiting for the approver
    assert h.tick() == []
    h.decided("1.0", ApprovalOutcome.APPROVED)
    out = h.done("1.0")
    assert out[-1].remaining.wall_clock_ms == 50_000
    h.driver.now_ms += 50_000
    assert _types(h.tick()) == ["RunTerminated"]


def test_an_unknown_outcome_parks_the_run_until_a_human_lets_it_continue(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_wall_clock_ms=60_000))
    h.model(1, 2)
    h.request(1, 0)
    h.request(1, 1)
    h.done("1.0")
    assert _types(h.unknown("1.1")) == ["ToolCallOutcomeUnknown"]
    h.driver.now_ms += 10 * 60_000
    assert h.tick() == []  # parked: no grant, no wall-clock termination
    assert h.ledger().waiting_for_human
    out = h.decided("1.1", ApprovalOutcome.APPROVED, approval_id="ou-1")
    assert _types(out) == ["ApprovalDecided", "StepGranted"]
    assert h.ledger().calls["1.1"].status is CallStatus.RESOLVED


def test_an_unknown_outcome_that_a_human_rejects_ends_the_run(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    h.unknown("1.0")
    h.approval_requested("1.0", approval_id="ou-1")  # the approval service asks a human
    out = h.decided("1.0", ApprovalOutcome.REJECTED, approval_id="ou-1")
    assert _types(out) == ["ApprovalDecided", "RunTerminated"]
    report = out[1].report
    assert report.reason_code == "OUTCOME_UNKNOWN"
    assert report.pending[0].startswith("1.0 search OUTCOME_UNKNOWN")


def test_an_unknown_outcome_later_resolved_by_the_gateway_unparks_the_run(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    h.unknown("1.0")
    assert _types(h.done("1.0")) == ["ToolCallCompleted", "StepGranted"]


def test_an_expired_decision_on_an_unknown_outcome_is_an_approval_timeout(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    h.unknown("1.0")
    out = h.decided("1.0", ApprovalOutcome.EXPIRED, approval_id="ou-1")
    assert out[1].reason_code == "APPROVAL_TIMEOUT"


# -- loops -----------------------------------------------------------------------------------


def test_a_repeating_run_is_warned_once_then_terminated(harness) -> None:
    h = harness
    h.submit()
    grants = []
    for step in range(1, 6):
        h.model(step, 1)
        h.request(step, 0, args={"q": "same"})
        out = h.done(f"{step}.0", result='{"results": []}')
        grants.append(out[-1])
    warnings = [g.loop_warning for g in grants[:4]]
    assert warnings[:3] == [None, None, None]
    assert "R1_REPEAT" in warnings[3] and 'search({"q":"same"})' in warnings[3]
    stop = grants[4]
    assert isinstance(stop, RunTerminated) and stop.reason_code == "LOOP_DETECTED"
    assert "R1_REPEAT" in stop.report.detail and 'search({"q":"same"})' in stop.report.detail
    assert h.metric("tether_budget_loop_detections_total", rule="R1_REPEAT", effect="warn") == 1
    assert h.metric("tether_budget_loop_detections_total", rule="R1_REPEAT", effect="terminate") == 1


def test_the_warning_is_given_once(harness) -> None:
    h = harness
    h.submit()
    grants = []
    for step in range(1, 8):
        h.model(step, 1)
        h.request(step, 0, args={"q": "same" if step <= 4 else f"new {step}"})
        grants.append(h.done(f"{step}.0")[-1])
    assert [g.loop_warning is not None for g in grants] == [False, False, False, True, False, False, False]
    assert all(isinstance(g, StepGranted) for g in grants)


def test_polling_a_pollable_tool_is_not_a_loop(harness) -> None:
    h = harness
    h.submit(run_caps=h.caps(max_steps=30))
    for step in range(1, 16):
        h.model(step, 1)
        h.request(step, 0, tool_name="job_status", args={"job": "j1"})
        state = "pending" if step < 15 else "done"
        out = h.done(f"{step}.0", result=f'{{"state": "{state}"}}')
        assert isinstance(out[-1], StepGranted) and out[-1].loop_warning is None


# -- records that break the protocol ---------------------------------------------------------


def test_records_for_an_unknown_run_are_dead_lettered(harness) -> None:
    with pytest.raises(Unprocessable) as err:
        harness.model(1, 1, run_id="nope")
    assert err.value.reason == "UNKNOWN_RUN"


@pytest.mark.parametrize(
    "act,reason",
    [
        (lambda h: h.model(2, 1), "STEP_MISMATCH"),
        (lambda h: h.request(1, 0), "UNEXPECTED_TOOL_CALL"),
        (lambda h: (h.model(1, 1), h.request(1, 1)), "CALL_INDEX_OUT_OF_RANGE"),
        (lambda h: h.complete(step=1), "UNEXPECTED_COMPLETION"),
    ],
)
def test_out_of_protocol_records_are_refused_and_leave_the_ledger_alone(harness, act, reason: str) -> None:
    h = harness
    h.submit()
    before = h.ledger().model_dump()
    with pytest.raises(Unprocessable) as err:
        act(h)
    assert err.value.reason == reason
    if reason != "CALL_INDEX_OUT_OF_RANGE":
        assert h.ledger().model_dump() == before


def test_a_tool_call_with_a_forged_idem_key_is_refused(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    call = ToolCall(call_id="1.0", call_index=0, idem_key="f" * 64, tool_name="search", args_json="{}",
                    args_hash="44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a")
    with pytest.raises(Unprocessable) as err:
        h.intake(ToolCallRequested(step=1, call=call), "r1", what=("x",), producer="planner")
    assert err.value.reason == "BAD_IDEM_KEY"


def test_intake_from_another_tenant_is_refused(harness) -> None:
    h = harness
    h.submit()
    with pytest.raises(Unprocessable) as err:
        h.intake(RunCompleted(step=1, answer="x", usage=Usage()), "r1", what=("z",), producer="planner", tenant="t2")
    assert err.value.reason == "TENANT_MISMATCH"


def test_log_events_fed_back_as_intake_are_refused(harness) -> None:
    h = harness
    h.submit()
    granted = h.log_payloads()[1]
    with pytest.raises(Unprocessable) as err:
        h.intake(granted, "r1", what=("again",), producer="planner")
    assert err.value.reason == "UNEXPECTED_RECORD"


def test_commands_are_only_accepted_on_the_commands_topic(harness) -> None:
    h = harness
    h.submit()
    with pytest.raises(Unprocessable) as err:
        h.send(RUN_INTAKE, CancelRun(principal_id="mallory"), "r1", event_id="c1", producer="planner")
    assert err.value.reason == "UNEXPECTED_RECORD"
    assert h.ledger().status is RunStatus.ACTIVE


def test_decide_approval_commands_are_left_to_the_approval_service(harness) -> None:
    h = harness
    h.submit()
    cmd = DecideApproval(approval_id="a", call_id="1.0", args_hash="x", approver_id="bob", approver_roles=[], approve=True)
    assert h.send(COMMANDS, cmd, "r1", event_id="d1", producer="run-api") == []


# -- retention -------------------------------------------------------------------------------


def test_an_ended_run_shrinks_to_a_tombstone_that_still_recognises_late_records(harness) -> None:
    h = harness  # retention: full ledger 60 s, tombstone 600 s
    h.submit()
    h.model(1, 2)
    h.request(1, 0)
    h.request(1, 1)
    h.done("1.0")
    h.cancel()
    h.driver.now_ms += 60_000
    assert h.tick() == []
    ledger = h.ledger()
    assert ledger.tombstoned and list(ledger.calls) == ["1.1"] and not ledger.seen_event_ids
    assert h.done("1.0") == []  # late duplicate of a settled call
    assert _types(h.done("1.1")) == ["ToolCallCompleted"]  # the open call's outcome is still a fact
    assert h.done("1.1") == []
    h.driver.now_ms += 600_000
    h.tick()
    assert h.ledger() is None
    with pytest.raises(Unprocessable):
        h.done("1.1")


def test_the_ledger_survives_its_changelog_codec_mid_run(harness) -> None:
    # The in-memory driver round-trips every checkpoint through the codec, as the loop does;
    # a run spanning every kind of record must keep working on restored state.
    h = harness
    h.submit()
    h.model(1, 2)
    h.request(1, 0)
    h.request(1, 1)
    h.approval_requested("1.0")
    h.decided("1.0", ApprovalOutcome.APPROVED)
    h.done("1.0")
    h.unknown("1.1")
    out = h.decided("1.1", ApprovalOutcome.APPROVED, approval_id="ou")
    assert _types(out) == ["ApprovalDecided", "StepGranted"]
    assert isinstance(h.log_payloads()[0], RunAccepted)
    assert not any(isinstance(p, (SubmitRun, RunRejected)) for p in h.log_payloads())
    assert {type(p) for p in h.log_payloads()} >= {ApprovalRequested, ApprovalDecided, ToolCallBudgeted,
                                                   ToolCallCompleted, ToolCallOutcomeUnknown}


def test_a_cancel_while_an_approval_is_pending_reports_it_and_the_late_decision_is_dropped(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    h.approval_requested("1.0", approval_id="ap-7")
    report = h.cancel()[0].report
    assert report.pending == ["1.0 search APPROVAL_PENDING approval ap-7"]
    # The gateway only executes on an ApprovalDecided in the log; after the end there is none.
    assert h.decided("1.0", ApprovalOutcome.APPROVED, approval_id="ap-7") == []


def _refused(h, call_id: str, *, approval_id: str = "ap1", command: str = "cmd-1", run_id: str = "r1") -> list:
    ev = ApprovalDecisionRefused(approval_id=approval_id, call_id=call_id, approver_id="bob", approve=True,
                                 reason="DECISION_AFTER_EXPIRY", decided_at_ms=h.driver.now_ms - 1_000,
                                 expires_at_ms=h.driver.now_ms - 500)
    return h.intake(ev, run_id, what=("refused", command), producer="approval")


def test_a_decision_refused_after_the_expiry_is_recorded_whatever_the_run_has_done_since(harness) -> None:
    # The approval service read a human's in-time decision only after EXPIRED had decided: the record of
    # it comes after the denial, the next step, even the run's end, and changes nothing in the ledger.
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    h.approval_requested("1.0")
    h.decided("1.0", ApprovalOutcome.EXPIRED)
    assert _types(h.denied("1.0", reason="APPROVAL_EXPIRED")) == ["ToolCallDenied", "StepGranted"]
    before = h.ledger().model_dump()
    assert _types(_refused(h, "1.0")) == ["ApprovalDecisionRefused"]  # step 1 is stale; the record is not
    assert _types(h.log_payloads())[-3:] == ["ToolCallDenied", "StepGranted", "ApprovalDecisionRefused"]
    chain = ("seen_event_ids", "seq", "last_hash")  # the append itself; nothing else changes
    after = h.ledger().model_dump()
    assert {k: v for k, v in after.items() if k not in chain} == {k: v for k, v in before.items() if k not in chain}
    assert _refused(h, "1.0") == []  # the same command re-read: once
    h.cancel()
    assert _types(_refused(h, "1.0", command="cmd-2")) == ["ApprovalDecisionRefused"]  # after the end too
    # One that names a call the run never had, or another approval than the call's, contradicts the log.
    with pytest.raises(Unprocessable) as err:
        _refused(h, "1.7", command="cmd-3")
    assert err.value.reason == "UNKNOWN_CALL"
    with pytest.raises(Unprocessable) as err:
        _refused(h, "1.0", approval_id="ap2", command="cmd-4")
    assert err.value.reason == "APPROVAL_MISMATCH"
    # A tombstone no longer knows which it appended: dropped rather than appended twice.
    h.driver.now_ms += 60_000
    h.tick()
    assert h.ledger().tombstoned
    assert _refused(h, "1.0", command="cmd-5") == []


# -- the gateway's rate-limit deferrals and delegated scope (added with the gateway's policy) ----


def test_a_deferred_call_is_recorded_and_the_step_waits_for_its_outcome(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    c = h._call("r1", "1.0")
    deferred = ToolCallDeferred(step=1, call_id="1.0", idem_key=c.idem_key, tool_name=c.tool_name,
                                reason_code="RATE_LIMITED", retry_after_ms=500, not_before_ms=h.driver.now_ms + 500,
                                attempt=1, decided_at_ms=h.driver.now_ms, policy_version="p1", inputs_hash="0" * 64)
    assert _types(h.intake(deferred, "r1", what=("deferred", "1.0", 1), producer="tool-gateway")) == ["ToolCallDeferred"]
    assert h.ledger().calls["1.0"].status is CallStatus.BUDGETED
    assert _types(h.done("1.0")) == ["ToolCallCompleted", "StepGranted"]
    # A deferral of a call that already has its outcome contradicts the log.
    with pytest.raises(Unprocessable) as err:
        h.intake(deferred, "r1", what=("deferred", "1.0", 2), producer="tool-gateway")
    assert err.value.reason == "UNEXPECTED_DEFERRAL"


def _authorized(h, call_id: str, run_id: str = "r1", **over) -> ToolCallAuthorized:
    c = h._call(run_id, call_id)
    fields = dict(step=int(call_id.split(".")[0]), call_id=call_id, idem_key=c.idem_key, tool_name=c.tool_name,
                  tool_version=1, args_hash=c.args_hash, risk_class=RiskClass.WRITE,
                  reasons=["GRANTED", "ARGS_VALID", "RISK_CLASS_NEEDS_NO_APPROVAL"], policy_version="p1",
                  inputs_hash="0" * 64)
    return ToolCallAuthorized(**(fields | over))


def test_the_gateways_authorization_is_sequenced_before_the_outcome(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 1)
    h.request(1, 0)
    go = _authorized(h, "1.0")
    assert _types(h.intake(go, "r1", what=("authorized", "1.0"), producer="tool-gateway")) == ["ToolCallAuthorized"]
    assert h.ledger().calls["1.0"].status is CallStatus.BUDGETED  # the outcome finishes the call
    assert h.intake(go, "r1", what=("authorized", "1.0"), producer="tool-gateway") == []  # a replay
    assert _types(h.done("1.0")) == ["ToolCallCompleted", "StepGranted"]
    assert _types(h.log_payloads())[-3:] == ["ToolCallAuthorized", "ToolCallCompleted", "StepGranted"]
    # An authorization of a finished call, or of other arguments, contradicts the log.
    with pytest.raises(Unprocessable) as err:
        h.intake(go, "r1", what=("authorized", "1.0", "again"), producer="tool-gateway")
    assert err.value.reason == "UNEXPECTED_AUTHORIZATION"
    h.model(2, 1)
    h.request(2, 0)
    with pytest.raises(Unprocessable) as err:
        h.intake(_authorized(h, "2.0", args_hash="f" * 64), "r1", what=("authorized", "2.0"), producer="tool-gateway")
    assert err.value.reason == "AUTHORIZATION_MISMATCH"


def test_an_authorization_decided_before_the_run_ended_is_still_appended(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 2)
    h.request(1, 0)
    h.request(1, 1)
    h.cancel()
    # The gateway allowed 1.0 before it saw the cancel: the call runs, so its go is evidence.
    assert _types(h.intake(_authorized(h, "1.0"), "r1", what=("authorized", "1.0"),
                           producer="tool-gateway")) == ["ToolCallAuthorized"]
    assert _types(h.done("1.0")) == ["ToolCallCompleted"]
    # After its outcome there is nothing left to authorize.
    assert h.intake(_authorized(h, "1.0"), "r1", what=("authorized", "1.0", "late"), producer="tool-gateway") == []


def test_the_delegated_scope_of_the_submit_is_copied_into_run_accepted(harness) -> None:
    h = harness
    accepted = next(p for p in h.submit() if type(p).__name__ == "RunAccepted")
    assert accepted.delegated_scope is None  # not delegated
    cmd = SubmitRun(request_id="req-r2", principal_id="alice", goal="g",
                    agent=AgentSpec(agent_id="a1", version=1, name="agent", instructions="i",
                                    model=ModelRef(provider="openai", name="gpt-test"), tool_allowlist=["search"],
                                    caps=h.caps()),
                    tools=[h.tool("search")], caps=h.caps(), tenant_grants=["search"], delegated_scope=["search"])
    out = h.send(COMMANDS, cmd, "r2", event_id=derived_id("r2", "SubmitRun"), producer="run-api")
    assert next(p for p in out if type(p).__name__ == "RunAccepted").delegated_scope == ["search"]
