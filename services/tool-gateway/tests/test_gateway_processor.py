"""The gateway processor in memory: decisions, approvals, execution via the ledger, outcomes, recovery."""

from __future__ import annotations

import json
import time

import pytest

from tether_contracts.records import (
    ApprovalOutcome,
    ApprovalRequested,
    RiskClass,
    RunTerminated,
    TerminationReport,
    ToolCallAuthorized,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    Usage,
)
from tether_messaging.errors import Unprocessable
from tether_tool_gateway.domain.canonical import canonical_json
from tether_tool_gateway.domain.errors import ToolError
from tether_tool_gateway.domain.policy import DEFAULT_APPROVAL_TTL_MS, approval_id_for
from tether_tool_gateway.domain.results import ResultLimits
from tether_tool_gateway.domain.state import CallStatus
from tether_tool_gateway.execution import tool_spec_json
from tether_tool_gateway.handlers import authorized_event_id, outcome_event_id
from tether_tool_gateway.ledger import Intent, Owner, Resolution, ResolutionStatus

KV_ARGS = {"key": "greeting", "value": {"text": "hi"}}
EMAIL_ARGS = {"to": "ops@example.test", "subject": "Hello", "body": "It works."}


def only(emitted, kind):
    payloads = [e.payload for e in emitted]
    assert [type(p) for p in payloads] == [kind], payloads
    return payloads[0]


# -- decisions ---------------------------------------------------------------------------------
def test_unknown_tool_is_denied(gw):
    gw.accept()
    call = gw.request("rm_rf", {"path": "/"})
    denied = only(gw.budget(call), ToolCallDenied)
    assert denied.reason_code == "UNKNOWN_TOOL"
    assert denied.policy_version == gw.policy.version and denied.policy_version.startswith("default/4@")
    assert len(denied.inputs_hash) == 64
    assert gw.executor.requests == [] and gw.driver.pending == {}


@pytest.mark.parametrize("grants,allowlist", [(["kv_get"], None), (None, ["kv_get"])])
def test_tool_outside_grants_and_allowlist_is_not_allowed(gw, grants, allowlist):
    gw.accept(grants=grants, allowlist=allowlist)
    denied = only(gw.budget(gw.request("kv_put", KV_ARGS)), ToolCallDenied)
    assert denied.reason_code == "TOOL_NOT_ALLOWED"
    assert gw.driver.pending == {}


def test_arguments_that_fail_the_schema_are_invalid(gw):
    gw.accept()
    denied = only(gw.budget(gw.request("kv_put", {"key": "a"})), ToolCallDenied)
    assert denied.reason_code == "INVALID_ARGS"
    assert "value" in denied.detail and "required" in denied.detail


def test_args_hash_must_match_args(gw):
    gw.accept()
    call = gw.request("kv_get", {"key": "a"})
    call.args_json = '{"key":"b"}'  # the hash in the log no longer matches what it claims
    state = gw.driver.states["run-1"]
    state.calls["1.0"].args_json = call.args_json
    denied = only(gw.budget(call), ToolCallDenied)
    assert denied.reason_code == "INVALID_ARGS" and "args_hash" in denied.detail


def test_decisions_are_a_pure_function_of_recorded_inputs(make_harness):
    denials = []
    for _ in range(2):
        h = make_harness()
        h.accept()
        denials.append(only(h.budget(h.request("kv_put", {"key": 1, "value": 2})), ToolCallDenied))
    assert denials[0] == denials[1]
    h.driver.now_ms += 1  # a different recorded time is a different decision input
    h.accept(run_id="run-2")
    later = only(h.budget(h.request("kv_put", {"key": 1, "value": 2}, run_id="run-2")), ToolCallDenied)
    assert later.inputs_hash != denials[0].inputs_hash


# -- approvals ---------------------------------------------------------------------------------
def test_irreversible_tool_requests_approval_bound_to_the_args(gw):
    gw.accept()
    call = gw.request("send_email", EMAIL_ARGS)
    req = only(gw.budget(call), ApprovalRequested)
    assert req.approval_id == approval_id_for("run-1", call.idem_key, call.args_hash)
    assert req.args_hash == call.args_hash and req.args_json == call.args_json
    assert req.expires_at_ms == gw.driver.now_ms + DEFAULT_APPROVAL_TTL_MS
    assert req.reasons == ["RISK_CLASS"] and req.risk_class is RiskClass.IRREVERSIBLE
    assert gw.executor.requests == [] and gw.driver.pending == {}
    assert gw.call_state(call).status is CallStatus.AWAITING_APPROVAL


def test_approved_call_executes(gw):
    gw.accept()
    call = gw.request("send_email", EMAIL_ARGS)
    req = only(gw.budget(call), ApprovalRequested)
    assert gw.decide(call, req.approval_id, ApprovalOutcome.APPROVED) == []
    done = only(gw.driver.run_work(), ToolCallCompleted)
    assert json.loads(done.result_json)["args"] == EMAIL_ARGS
    assert [r.idem_key for r in gw.executor.requests] == [call.idem_key]


@pytest.mark.parametrize("outcome,code", [(ApprovalOutcome.REJECTED, "APPROVAL_REJECTED"),
                                          (ApprovalOutcome.EXPIRED, "APPROVAL_EXPIRED")])
def test_rejected_or_expired_approval_denies(gw, outcome, code):
    gw.accept()
    call = gw.request("send_email", EMAIL_ARGS)
    req = only(gw.budget(call), ApprovalRequested)
    denied = only(gw.decide(call, req.approval_id, outcome, comment="no"), ToolCallDenied)
    assert denied.reason_code == code
    assert gw.driver.pending == {} and gw.executor.requests == []


def test_approval_for_other_arguments_or_too_late_does_not_execute(gw):
    gw.accept()
    call = gw.request("send_email", EMAIL_ARGS)
    req = only(gw.budget(call), ApprovalRequested)
    denied = only(gw.decide(call, req.approval_id, ApprovalOutcome.APPROVED, args_hash="0" * 64), ToolCallDenied)
    assert denied.reason_code == "APPROVAL_REJECTED"
    gw.accept(run_id="run-2")
    late = gw.request("send_email", EMAIL_ARGS, run_id="run-2")
    req2 = only(gw.budget(late), ApprovalRequested)
    denied2 = only(gw.decide(late, req2.approval_id, ApprovalOutcome.APPROVED,
                             decided_at_ms=req2.expires_at_ms + 1), ToolCallDenied)
    assert denied2.reason_code == "APPROVAL_EXPIRED"
    assert gw.executor.requests == []


# -- execution ---------------------------------------------------------------------------------
def test_allowed_call_executes_off_the_loop_and_completes(gw):
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    # The decision is recorded while handling the record; nothing runs yet.
    decided = gw.budget(call)
    authorized = only(decided, ToolCallAuthorized)
    assert decided[0].envelope.event_id == authorized_event_id("run-1", call.idem_key)
    assert decided[0].topic == "tether.run-intake.v1"
    assert (authorized.call_id, authorized.idem_key, authorized.tool_name, authorized.args_hash) == (
        call.call_id, call.idem_key, "kv_put", call.args_hash)
    assert authorized.risk_class is RiskClass.WRITE and authorized.tool_version == 1
    # kv_put is egress (a tainted run would need a human to write); this run is untainted.
    assert authorized.reasons == ["GRANTED", "ARGS_VALID", "RISK_CLASS_NEEDS_NO_APPROVAL", "EGRESS_UNTAINTED"]
    assert authorized.policy_version == gw.policy.version and len(authorized.inputs_hash) == 64
    # No argument values: only their hash (ToolCallRequested holds the arguments).
    assert "greeting" not in authorized.model_dump_json() and "hi" not in authorized.model_dump_json()
    assert gw.executor.requests == [] and list(gw.driver.pending) == [f"call:{call.idem_key}"]
    emitted = gw.driver.run_work()
    done = only(emitted, ToolCallCompleted)
    assert emitted[0].envelope.event_id == outcome_event_id("run-1", call.idem_key)
    assert emitted[0].topic == "tether.run-intake.v1"
    assert done.idem_key == call.idem_key and done.tool_name == "kv_put" and not done.replayed
    assert json.loads(done.result_json) == {"ok": True, "args": KV_ARGS}
    assert gw.executor.requests[0].idem_key == call.idem_key
    rec = gw.ledger.get(call.idem_key)
    assert rec.resolution.status is ResolutionStatus.COMPLETED and rec.intent.args_hash == call.args_hash
    assert gw.call_state(call).status is CallStatus.RESOLVED


def test_replayed_budget_record_does_not_execute_twice(gw):
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    first = gw.budget(call)
    # Held input re-delivered while the work still runs: the decision stands, not re-recorded.
    assert gw.budget(call) == [] and [type(e.payload) for e in first] == [ToolCallAuthorized]
    assert len(gw.driver.pending) == 1
    gw.driver.run_work()
    assert gw.budget(call) == [] and gw.driver.pending == {}
    assert len(gw.executor.requests) == 1


def test_untrusted_source_marks_the_result(gw):
    gw.accept()
    gw.budget(gw.request("http_get", {"url": "http://127.0.0.1/x"}))
    assert only(gw.driver.run_work(), ToolCallCompleted).untrusted is True


def test_large_result_goes_to_the_blob_store(make_harness):
    gw = make_harness(limits=ResultLimits(inline_max_bytes=100, max_bytes=10_000))
    gw.executor.behaviour = lambda r: {"data": "x" * 500}
    gw.accept()
    gw.budget(gw.request("kv_get", {"key": "a"}))
    done = only(gw.driver.run_work(), ToolCallCompleted)
    assert done.result_json is None and done.result_ref.size > 100
    assert json.loads(gw.blobs.get(done.result_ref.sha256)) == {"data": "x" * 500}


@pytest.mark.parametrize("value,code", [({"data": "x" * 20_000}, "OVERSIZED_RESULT"),
                                        ({"n": float("nan")}, "INVALID_RESULT"),
                                        ({"s": {1, 2}}, "INVALID_RESULT")])
def test_oversized_or_invalid_result_fails(make_harness, value, code):
    gw = make_harness(limits=ResultLimits(inline_max_bytes=100, max_bytes=10_000))
    gw.executor.behaviour = lambda r: value
    gw.accept()
    gw.budget(gw.request("kv_get", {"key": "a"}))
    failed = only(gw.driver.run_work(), ToolCallFailed)
    assert failed.error_code == code and not failed.retryable


@pytest.mark.parametrize("value,code", [({"data": "x" * 20_000}, "OVERSIZED_RESULT"),
                                        ({"n": float("nan")}, "INVALID_RESULT")])
def test_a_non_idempotent_tools_unrecordable_result_completes_the_call(make_harness, value, code):
    # The tool returned, so its effect took place: reported as a failure, the model would do it again.
    gw = make_harness(limits=ResultLimits(inline_max_bytes=100, max_bytes=10_000))
    gw.tools = [t.model_copy(update={"idempotent": False}) if t.name == "kv_get" else t for t in gw.tools]
    gw.executor.behaviour = lambda r: value
    gw.accept()
    gw.budget(gw.request("kv_get", {"key": "a"}))
    done = only(gw.driver.run_work(), ToolCallCompleted)
    result = json.loads(done.result_json)
    assert result["result_unrecorded"]["code"] == code and result["result_unrecorded"]["detail"]


def test_tool_error_and_unexpected_exception_fail_the_call(gw):
    def boom(r):
        if r.args["key"] == "a":
            raise ToolError("TOOL_ERROR", "the KV store answered HTTP 503", retryable=True)
        raise RuntimeError("bug")

    gw.executor.behaviour = boom
    gw.accept()
    gw.budget(gw.request("kv_get", {"key": "a"}, call_index=0))
    gw.budget(gw.request("kv_get", {"key": "b"}, call_index=1))
    failed = sorted((e.payload for e in gw.driver.run_work()), key=lambda p: p.call_id)
    assert [(f.error_code, f.retryable) for f in failed] == [("TOOL_ERROR", True), ("TOOL_ERROR", True)]
    assert "503" in failed[0].detail and "RuntimeError: bug" in failed[1].detail


def test_timeout_fails_the_call(make_harness, release):
    gw = make_harness()
    gw.tools = [t.model_copy(update={"timeout_ms": 50}) if t.name == "kv_get" else t for t in gw.tools]
    gw.executor.behaviour = lambda r: release.wait(30) and {"late": True}
    gw.accept()
    call = gw.request("kv_get", {"key": "a"})
    gw.budget(call)
    failed = only(gw.driver.run_work(), ToolCallFailed)
    assert failed.error_code == "TIMEOUT" and failed.retryable  # kv_get is idempotent
    assert gw.ledger.get(call.idem_key).resolution.error_code == "TIMEOUT"
    # The abandoned execution finishes later: kept as a late resolution, the outcome stays TIMEOUT.
    release.set()
    for _ in range(500):
        if gw.ledger.get(call.idem_key).late_resolution is not None:
            break
        time.sleep(0.01)
    rec = gw.ledger.get(call.idem_key)
    assert rec.resolution.error_code == "TIMEOUT"
    assert rec.late_resolution.status is ResolutionStatus.COMPLETED and rec.late_resolution.result_json == '{"late":true}'


def test_a_non_idempotent_call_left_running_at_its_timeout_has_an_unknown_outcome(make_harness, release):
    # The email may still go out (its thread cannot be killed): a failure would invite the model to
    # send it again, so the run waits for a human, as after a crash mid-call.
    gw = make_harness()
    gw.tools = [t.model_copy(update={"timeout_ms": 50}) if t.name == "send_email" else t for t in gw.tools]
    gw.executor.behaviour = lambda r: release.wait(30) and {"sent": True}
    gw.accept()
    call = gw.request("send_email", EMAIL_ARGS)
    req = only(gw.budget(call), ApprovalRequested)
    gw.decide(call, req.approval_id, ApprovalOutcome.APPROVED)
    unknown = only(gw.driver.run_work(), ToolCallOutcomeUnknown)
    assert unknown.idem_key == call.idem_key
    assert "did not finish within 50 ms and was left running" in unknown.detail and "not idempotent" in unknown.detail
    assert gw.ledger.get(call.idem_key).resolution.status is ResolutionStatus.OUTCOME_UNKNOWN
    release.set()  # it did finish: kept for the human as the late resolution, the outcome stays unknown
    for _ in range(500):
        if gw.ledger.get(call.idem_key).late_resolution is not None:
            break
        time.sleep(0.01)
    rec = gw.ledger.get(call.idem_key)
    assert rec.resolution.status is ResolutionStatus.OUTCOME_UNKNOWN
    assert rec.late_resolution.status is ResolutionStatus.COMPLETED


@pytest.mark.parametrize("effect_unknown,expected", [(True, ToolCallOutcomeUnknown), (False, ToolCallFailed)])
def test_a_non_idempotent_tools_error_is_unknown_only_when_its_request_may_have_taken_effect(gw, effect_unknown,
                                                                                             expected):
    def cut(r):
        raise ToolError("TOOL_ERROR", "connection reset", retryable=False, effect_unknown=effect_unknown)

    gw.executor.behaviour = cut
    gw.accept()
    call = gw.request("send_email", EMAIL_ARGS)
    req = only(gw.budget(call), ApprovalRequested)
    gw.decide(call, req.approval_id, ApprovalOutcome.APPROVED)
    outcome = only(gw.driver.run_work(), expected)
    assert "connection reset" in outcome.detail


def test_unknown_executor_kind_fails(make_harness):
    gw = make_harness()
    gw.tools = [t.model_copy(update={"executor_kind": "mcp"}) if t.name == "kv_get" else t for t in gw.tools]
    gw.accept()
    gw.budget(gw.request("kv_get", {"key": "a"}))
    assert only(gw.driver.run_work(), ToolCallFailed).error_code == "EXECUTOR_UNAVAILABLE"


# -- the ledger decides re-execution -----------------------------------------------------------
def _intent_for(gw, call, tool_name, *, owner, lease_ms):
    tool = next(t for t in gw.tools if t.name == tool_name)
    intent = Intent(call.idem_key, call.run_id, "t1", 0, call.step, call.call_id, tool_name, call.args_json,
                    call.args_hash, tool_spec_json(tool), tool.idempotent)
    return gw.ledger.claim(intent, owner, lease_ms)


def test_recorded_result_is_replayed_without_executing(gw):
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    claim = _intent_for(gw, call, "kv_put", owner=gw.owner, lease_ms=60_000)
    gw.ledger.complete(call.idem_key, claim.token, Resolution(ResolutionStatus.COMPLETED, result_json='{"v":1}',
                                                              duration_ms=7))
    gw.budget(call)
    done = only(gw.driver.run_work(), ToolCallCompleted)
    assert done.replayed and done.result_json == '{"v":1}' and done.duration_ms == 7
    assert gw.executor.requests == []


def test_intent_without_result_idempotent_re_runs_with_the_same_key(gw):
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    _intent_for(gw, call, "kv_put", owner=Owner("tool-gateway-0", "previous-boot"), lease_ms=60_000)
    gw.budget(call)
    done = only(gw.driver.run_work(), ToolCallCompleted)
    assert not done.replayed
    (req,) = gw.executor.requests
    assert req.idem_key == call.idem_key and req.attempt == 2


def test_intent_without_result_non_idempotent_is_outcome_unknown(gw):
    gw.accept()
    call = gw.request("send_email", EMAIL_ARGS)
    req = only(gw.budget(call), ApprovalRequested)
    _intent_for(gw, call, "send_email", owner=Owner("tool-gateway-0", "previous-boot"), lease_ms=60_000)
    gw.decide(call, req.approval_id, ApprovalOutcome.APPROVED)
    unknown = only(gw.driver.run_work(), ToolCallOutcomeUnknown)
    assert unknown.idem_key == call.idem_key and "non-idempotent" in unknown.detail
    assert gw.executor.requests == []


def test_live_lease_elsewhere_waits_then_replays_the_other_instances_result(gw):
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    other = _intent_for(gw, call, "kv_put", owner=Owner("tool-gateway-1", "b"), lease_ms=60_000)
    gw.budget(call)
    assert gw.driver.run_work() == []  # busy elsewhere: nothing to say yet
    assert gw.call_state(call).status is CallStatus.EXECUTING
    gw.ledger.complete(call.idem_key, other.token, Resolution(ResolutionStatus.COMPLETED, result_json='{"o":1}'))
    gw.driver.tick()
    assert f"call:{call.idem_key}" not in gw.driver.pending  # not due yet: wait recheck_ms
    gw.driver.now_ms += 1_000
    gw.driver.tick()
    done = only(gw.driver.run_work(f"call:{call.idem_key}"), ToolCallCompleted)
    assert done.replayed and done.result_json == '{"o":1}'
    assert gw.executor.requests == []


def test_tick_sweeps_expired_leases(gw):
    gw.accept()
    kv = gw.request("kv_put", KV_ARGS, call_index=0)
    mail = gw.request("send_email", EMAIL_ARGS, call_index=1)
    dead = Owner("tool-gateway-7", "gone")
    _intent_for(gw, kv, "kv_put", owner=dead, lease_ms=0)
    _intent_for(gw, mail, "send_email", owner=dead, lease_ms=0)
    gw.driver.tick()
    assert list(gw.driver.pending) == ["sweep:0"]
    unknown = only(gw.driver.run_work("sweep:0"), ToolCallOutcomeUnknown)
    assert unknown.call_id == mail.call_id
    (key,) = gw.driver.pending
    assert key.startswith(f"recover:{kv.idem_key}:")
    done = only(gw.driver.run_work(key), ToolCallCompleted)
    assert done.call_id == kv.call_id
    assert [r.idem_key for r in gw.executor.requests] == [kv.idem_key]


def test_failover_restarts_executing_calls_from_the_state(gw, make_harness):
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    gw.budget(call)
    # Its worker wrote the intent and the instance died mid-execution; a new incarnation owns
    # the partition with the checkpointed state (the call EXECUTING) and the same ledger.
    _intent_for(gw, call, "kv_put", owner=gw.owner, lease_ms=60_000)
    successor = make_harness(ledger=gw.ledger, owner=Owner("tool-gateway-0", "boot-2"))
    successor.driver.states = gw.driver.states
    successor.driver.tick()
    assert f"call:{call.idem_key}" in successor.driver.pending
    done = only(successor.driver.run_work(f"call:{call.idem_key}"), ToolCallCompleted)
    assert not done.replayed and successor.executor.requests[0].attempt == 2


def test_outcome_seen_in_the_log_resolves_the_call(gw):
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    gw.budget(call)
    done = only(gw.driver.run_work(), ToolCallCompleted)
    gw.feed(done)  # sequenced back to us
    assert gw.call_state(call).status is CallStatus.RESOLVED


def test_run_end_drops_the_state(gw):
    gw.accept()
    gw.request("kv_put", KV_ARGS)
    report = TerminationReport(reason_code="CANCELLED", detail="", steps_done=1, tool_calls_done=[], pending=[],
                               usage=Usage())
    gw.feed(RunTerminated(reason_code="CANCELLED", report=report))
    assert "run-1" not in gw.driver.states


def test_records_for_unknown_runs_or_calls_are_unprocessable(gw):
    from tether_contracts.records import Remaining, ToolCallBudgeted

    with pytest.raises(Unprocessable) as exc:
        gw.feed(ToolCallBudgeted(step=1, call_id="1.0", idem_key="k", remaining=Remaining(
            steps=1, tokens=1, cost_usd_micros=1, wall_clock_ms=1)), run_id="nope")
    assert exc.value.reason == "UNKNOWN_RUN"
    gw.accept()
    with pytest.raises(Unprocessable) as exc:
        gw.feed(ToolCallBudgeted(step=1, call_id="9.9", idem_key="k", remaining=Remaining(
            steps=1, tokens=1, cost_usd_micros=1, wall_clock_ms=1)))
    assert exc.value.reason == "UNKNOWN_CALL"


def test_canonical_json_and_idem_key_follow_the_run_protocol():
    from tether_tool_gateway.domain.canonical import idem_key_for, sha256_hex

    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'
    assert idem_key_for("run-1", 2, 3) == sha256_hex("run-1\x1f2\x1f3")
