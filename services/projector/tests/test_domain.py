"""The pure projection: log events → run fold and row writes, on scenario and generated run logs."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tether_contracts.records import ApprovalOutcome, CancelRun, Envelope, Usage
from tether_messaging.chain import event_hash, seal
from tether_messaging.envelopes import make_envelope
from tether_messaging.serde import encode, open_payload
from tether_projector.domain.errors import UnsealedEvent
from tether_projector.domain.live import hot_state, stream_fields
from tether_projector.domain.project import call_index_of, derive_status, event_row, is_duplicate, problem_kind, project
from tether_projector.domain.rows import Json, Upsert, merge
from tether_projector.domain.state import CallStatus, RunFold, RunStatus, StepStatus
from tether_projector.testing import (
    RunLog,
    cancelled_while_waiting,
    expired_with_a_late_decision,
    happy_run,
    random_run,
    rejected_run,
    troubled_run,
)

Tables = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


def apply(writes: list[Upsert], tables: Tables) -> None:
    """Reference semantics of row writes (what the adapters implement)."""
    for w in writes:
        table = tables.setdefault(w.table, {})
        values = {k: v.value if isinstance(v, Json) else v for k, v in w.row().items()}
        if w.key not in table:
            table[w.key] = values
        elif not w.only_insert:
            table[w.key].update({k: v for k, v in values.items()})


def fold_log(events: list[Envelope], fold: RunFold | None = None, tables: Tables | None = None) -> tuple[RunFold, Tables]:
    tables = {} if tables is None else tables
    for env in events:
        if is_duplicate(fold, env):
            continue
        projected = project(fold, env, open_payload(env))
        assert projected.chain_problems == []
        apply(projected.writes, tables)
        fold = projected.fold
    assert fold is not None
    return fold, tables


def statuses_after_each_event(log: RunLog) -> list[str]:
    fold, out = None, []
    for env in log.events:
        fold = project(fold, env, open_payload(env)).fold
        out.append(fold.status)
    return out


# -- scenarios ---------------------------------------------------------------------------------
def test_happy_run_rows() -> None:
    log = happy_run("run-1")
    fold, t = fold_log(log.events)

    run = t["runs"][("run-1",)]
    assert run["status"] == RunStatus.COMPLETED
    assert run["answer"] == "42"
    assert run["reason_code"] == "COMPLETED"
    assert (run["agent_id"], run["agent_version"], run["principal_id"]) == ("agent-1", 3, "alice")
    assert (run["input_tokens"], run["output_tokens"], run["cost_usd_micros"]) == (300, 30, 150)
    assert (run["steps"], run["current_step"], run["tool_calls"]) == (2, 2, 2)
    assert run["last_seq"] == len(log.events) == fold.last_seq
    assert run["last_hash"] == log.events[-1].hash
    assert run["created_at_ms"] == log.events[0].recorded_at_ms
    assert run["updated_at_ms"] == run["ended_at_ms"] == log.events[-1].recorded_at_ms
    assert run["termination"]["tool_calls_done"] == ["1.0 search COMPLETED", "1.1 send_mail COMPLETED"]
    assert run["termination"]["pending"] == []
    assert run["chain_ok"] is True and run["chain_problems"] == []

    assert sorted(t["events"]) == [("run-1", s) for s in range(1, len(log.events) + 1)]
    first = t["events"][("run-1", 1)]
    assert first["event_type"] == "tether.v1.RunAccepted"
    assert first["payload"]["agent"]["agent_id"] == "agent-1"
    assert first["prev_hash"] == "0" * 64 and first["hash"] == log.events[0].hash

    step1, step2 = t["steps"][("run-1", 1)], t["steps"][("run-1", 2)]
    assert step1["status"] == StepStatus.COMPLETED and step1["tool_call_count"] == 2
    assert step1["ended_at_ms"] == log.events[10].recorded_at_ms  # the last call's outcome closed it
    assert step2["status"] == StepStatus.COMPLETED and step2["assistant_text"] == "the answer is 42"
    assert step2["finish_reason"] == "stop" and step2["input_tokens"] == 200

    call = t["tool_calls"][("run-1", "1.1")]
    assert call["status"] == CallStatus.COMPLETED
    assert call["approval_id"] == "apr-run-1-1.1"
    assert call["result_json"] == '{"sent":true}'
    assert call["call_index"] == 1 and call["args_json"] == '{"q":"1.1"}'

    approval = t["approvals"][("apr-run-1-1.1",)]
    assert approval["status"] == "APPROVED" and approval["decided_by"] == "bob"
    assert approval["reasons"] == ["RISK_CLASS"] and approval["risk_class"] == "IRREVERSIBLE"
    assert approval["tenant_id"] == "tenant-a" and approval["run_id"] == "run-1"


def test_run_status_follows_the_run() -> None:
    assert statuses_after_each_event(happy_run("r")) == [
        "ACCEPTED", "RUNNING", "RUNNING", "RUNNING", "RUNNING", "RUNNING", "RUNNING", "RUNNING",
        "WAITING_APPROVAL", "RUNNING", "RUNNING", "RUNNING", "RUNNING", "COMPLETED",
    ]
    statuses = statuses_after_each_event(troubled_run("r"))
    # ToolCallOutcomeUnknown (seq 12) parks the run; its approval keeps it parked until decided.
    assert statuses[11:14] == ["OUTCOME_UNKNOWN", "OUTCOME_UNKNOWN", "RUNNING"]
    assert statuses[-1] == "TERMINATED"


def test_troubled_run_outcomes() -> None:
    _, t = fold_log(troubled_run("run-2").events)
    calls = {k[1]: v for k, v in t["tool_calls"].items()}
    assert calls["1.0"]["status"] == CallStatus.DENIED and calls["1.0"]["error_code"] == "TOOL_NOT_ALLOWED"
    assert calls["1.1"]["status"] == CallStatus.FAILED and calls["1.1"]["retryable"] is True
    assert calls["1.2"]["status"] == CallStatus.RESOLVED and calls["1.2"]["detail"] == "crashed mid-call"
    assert t["steps"][("run-2", 1)]["status"] == StepStatus.COMPLETED
    step2 = t["steps"][("run-2", 2)]
    assert step2["status"] == StepStatus.FAILED and step2["error_code"] == "PROVIDER_ERROR"
    assert step2["loop_warning"] == "you repeat yourself"
    run = t["runs"][("run-2",)]
    assert run["status"] == RunStatus.TERMINATED and run["reason_code"] == "MODEL_FAILED"
    # The budget's recorded cumulative usage wins over the projector's own sum.
    assert (run["input_tokens"], run["output_tokens"], run["cost_usd_micros"]) == (107, 10, 53)
    assert run["termination"]["suggested_next_action"] == "retry later"


def test_cancel_withdraws_a_pending_approval() -> None:
    log = cancelled_while_waiting("run-3")
    fold, t = fold_log(log.events)
    assert t["approvals"][("apr-run-3-1.0",)]["status"] == "WITHDRAWN"
    assert t["approvals"][("apr-run-3-1.0",)]["withdrawn_at_ms"] == log.events[-1].recorded_at_ms
    assert fold.pending_approvals == {}
    assert t["runs"][("run-3",)]["status"] == RunStatus.TERMINATED
    assert t["runs"][("run-3",)]["reason_code"] == "CANCELLED"
    assert t["tool_calls"][("run-3", "1.0")]["status"] == CallStatus.WAITING_APPROVAL


def test_rejected_run_gets_a_termination_report() -> None:
    _, t = fold_log(rejected_run("run-4").events)
    run = t["runs"][("run-4",)]
    assert run["status"] == RunStatus.REJECTED and run["reason_code"] == "INVALID_CAPS"
    assert run["termination"]["reason_code"] == "INVALID_CAPS" and run["termination"]["steps_done"] == 0
    assert run["ended_at_ms"] == run["created_at_ms"]
    assert run["agent_id"] is None


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [(ApprovalOutcome.REJECTED, "APPROVAL_REJECTED"), (ApprovalOutcome.EXPIRED, "APPROVAL_EXPIRED")],
)
def test_declined_approval_denies_the_call_and_closes_the_step(outcome: ApprovalOutcome, reason: str) -> None:
    log = RunLog("run-5")
    log.accepted()
    log.step(1)
    log.model(1, 1)
    log.request(1, 0, "send_mail")
    log.budgeted(1, 0)
    log.approval_requested(1, 0)
    log.approval_decided(1, 0, outcome)
    fold, t = fold_log(log.events)
    call = t["tool_calls"][("run-5", "1.0")]
    assert call["status"] == CallStatus.DENIED and call["error_code"] == reason
    assert t["steps"][("run-5", 1)]["status"] == StepStatus.COMPLETED
    assert t["approvals"][("apr-run-5-1.0",)]["status"] == outcome.value
    assert fold.status == RunStatus.RUNNING

    # The gateway's denial follows; it keeps the call denied and does not re-close the step.
    closed_at = t["steps"][("run-5", 1)]["ended_at_ms"]
    log.tool_denied(1, 0, "send_mail", reason)
    _, t = fold_log(log.events[-1:], fold, t)
    assert t["tool_calls"][("run-5", "1.0")]["status"] == CallStatus.DENIED
    assert t["tool_calls"][("run-5", "1.0")]["policy_version"] == "p1"
    assert t["steps"][("run-5", 1)]["ended_at_ms"] == closed_at


def test_a_decision_read_after_the_expiry_shows_on_the_expired_approval() -> None:
    log = expired_with_a_late_decision("run-8")
    fold, t = fold_log(log.events)
    refusal = next(e for e in log.events if e.event_type == "tether.v1.ApprovalDecisionRefused")
    approval = t["approvals"][("apr-run-8-1.0",)]
    assert (approval["status"], approval["decided_by"]) == ("EXPIRED", "system")  # EXPIRED stands
    assert approval["refused_decision"] == {
        "approver_id": "bob", "approve": True, "comment": "looks fine",
        "decided_at_ms": open_payload(refusal).decided_at_ms, "reason": "DECISION_AFTER_EXPIRY", "seq": refusal.seq,
    }
    assert t["tool_calls"][("run-8", "1.0")]["status"] == CallStatus.DENIED  # the call did not run
    assert t["events"][("run-8", refusal.seq)]["event_type"] == "tether.v1.ApprovalDecisionRefused"
    assert fold.status == RunStatus.COMPLETED


def test_an_authorized_call_shows_the_decision_until_its_outcome() -> None:
    log = RunLog("run-7")
    log.accepted()
    log.step(1)
    log.model(1, 1)
    log.request(1, 0)
    log.budgeted(1, 0)
    log.tool_authorized(1, 0)
    fold, t = fold_log(log.events)
    call = t["tool_calls"][("run-7", "1.0")]
    assert (call["status"], call["policy_version"], call["inputs_hash"]) == (CallStatus.AUTHORIZED, "p1", "ef" * 32)
    assert t["events"][("run-7", log.events[-1].seq)]["payload"]["reasons"][0] == "GRANTED"
    assert fold.status == RunStatus.RUNNING and t["steps"][("run-7", 1)]["status"] != StepStatus.COMPLETED
    log.tool_completed(1, 0)
    _, t = fold_log(log.events[-1:], fold, t)
    call = t["tool_calls"][("run-7", "1.0")]
    assert call["status"] == CallStatus.COMPLETED and call["policy_version"] == "p1"


def test_recovered_result_withdraws_the_unknown_outcome_approval() -> None:
    log = RunLog("run-6")
    log.accepted()
    log.step(1)
    log.model(1, 1)
    log.request(1, 0, "send_mail")
    log.budgeted(1, 0)
    log.tool_unknown(1, 0)
    log.approval_requested(1, 0, reasons=("OUTCOME_UNKNOWN",), approval_id="unk-1")
    assert fold_log(log.events)[0].status == RunStatus.OUTCOME_UNKNOWN
    log.tool_completed(1, 0, "send_mail")
    fold, t = fold_log(log.events)
    assert t["approvals"][("unk-1",)]["status"] == "WITHDRAWN"
    assert t["tool_calls"][("run-6", "1.0")]["status"] == CallStatus.COMPLETED
    assert fold.status == RunStatus.RUNNING


def test_late_outcome_after_the_end_is_recorded_but_the_run_stays_ended() -> None:
    log = RunLog("run-7")
    log.accepted()
    log.step(1)
    log.model(1, 1)
    log.request(1, 0)
    log.budgeted(1, 0)
    log.terminated("WALL_CLOCK_CAP", steps_done=1)
    log.tool_completed(1, 0)  # the side effect happened; the audit trail keeps it
    fold, t = fold_log(log.events)
    assert fold.status == RunStatus.TERMINATED and fold.reason_code == "WALL_CLOCK_CAP"
    assert fold.ended_at_ms == log.events[-2].recorded_at_ms
    assert t["tool_calls"][("run-7", "1.0")]["status"] == CallStatus.COMPLETED
    assert t["runs"][("run-7",)]["last_seq"] == 7


def test_unknown_event_types_are_recorded_and_advance_last_seq() -> None:
    log = happy_run("run-8")
    env = make_envelope(CancelRun(principal_id="alice"), run_id="run-8", tenant_id="tenant-a",
                        event_id="x", producer="budget", recorded_at_ms=log.now_ms + 5)
    log.events.append(seal(env, len(log.events) + 1, log.events[-1].hash or ""))
    fold, t = fold_log(log.events)
    assert fold.last_seq == 15 and fold.status == RunStatus.COMPLETED
    assert t["events"][("run-8", 15)]["event_type"] == "tether.v1.CancelRun"


# -- idempotence and the chain ---------------------------------------------------------------------
def test_duplicates_are_recognised_by_seq() -> None:
    log = happy_run("run-9")
    fold, _ = fold_log(log.events[:5])
    assert all(is_duplicate(fold, e) for e in log.events[:5])
    assert not is_duplicate(fold, log.events[5])
    assert not is_duplicate(None, log.events[0])


def test_unsealed_events_are_refused() -> None:
    env = make_envelope(CancelRun(principal_id="a"), run_id="r", tenant_id="t", event_id="e", producer="budget",
                        recorded_at_ms=1)
    with pytest.raises(UnsealedEvent) as err:
        project(None, env, CancelRun(principal_id="a"))
    assert err.value.reason == "UNSEALED_EVENT"
    with pytest.raises(UnsealedEvent):
        is_duplicate(None, env)


def test_projection_does_not_change_its_input_fold() -> None:
    log = happy_run("run-10")
    fold, _ = fold_log(log.events[:8])
    before = fold.model_dump()
    project(fold, log.events[8], open_payload(log.events[8]))
    assert fold.model_dump() == before


def test_chain_defects_are_flagged_and_projection_goes_on() -> None:
    log = happy_run("run-11")
    fold, _ = fold_log(log.events[:3])
    # A tampered payload: the recorded hash no longer matches the content.
    tampered = log.events[3].model_copy(update={"payload": encode(open_payload(log.events[4]))})
    p = project(fold, tampered, open_payload(tampered))
    assert [problem_kind(x) for x in p.chain_problems] == ["HASH_MISMATCH"]
    assert p.fold.chain_ok is False and p.fold.last_seq == 4

    # A gap: seq 5 follows seq 3.
    p = project(fold, log.events[4], open_payload(log.events[4]))
    assert [problem_kind(x) for x in p.chain_problems] == ["GAP"]
    assert p.fold.chain_problems == p.chain_problems

    # Another tenant's event on this run.
    foreign = seal(log.events[3].model_copy(update={"tenant_id": "tenant-b"}), 4, log.events[2].hash or "")
    p = project(fold, foreign, open_payload(foreign))
    assert [problem_kind(x) for x in p.chain_problems] == ["TENANT_MISMATCH"]
    # Recorded under the tenant it names, and nothing else of it applied to tenant-a's run.
    assert [(w.table, w.values.get("tenant_id")) for w in p.writes] == [("events", "tenant-b"), ("runs", "tenant-a")]
    assert p.fold.last_seq == 4 and p.fold.tool_calls == fold.tool_calls


def test_wrong_prev_hash_is_flagged() -> None:
    log = happy_run("run-12")
    fold, _ = fold_log(log.events[:3])
    relinked = seal(log.events[3], 4, "f" * 64)
    p = project(fold, relinked, open_payload(relinked))
    assert [problem_kind(x) for x in p.chain_problems] == ["PREV_HASH_MISMATCH"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("prev_hash", "é" * 64), ("prev_hash", "ab" * 32 + "\n"), ("prev_hash", "AB" * 32), ("seq", 0)],
)
def test_a_malformed_seal_is_a_hash_mismatch_even_when_hashed_over(field: str, value: object) -> None:
    # The rule of tether_messaging.chain.verify_chain: seal() refuses such a seq/prev_hash, so an
    # event carrying one was not sealed by the budget, whatever hash was computed over it.
    log = happy_run("run-13")
    fold, _ = fold_log(log.events[:3])
    if field == "seq":  # the run's first event at seq 0, after the genesis hash
        fold, odd = None, log.events[0].model_copy(update={"seq": value})
    else:  # seq 4 after a malformed prev_hash (which also does not follow seq 3's hash)
        odd = log.events[3].model_copy(update={field: value})
    odd = odd.model_copy(update={"hash": event_hash(odd)})
    p = project(fold, odd, open_payload(odd))
    kinds = ["HASH_MISMATCH"] if field == "seq" else ["HASH_MISMATCH", "PREV_HASH_MISMATCH"]
    assert [problem_kind(x) for x in p.chain_problems] == kinds
    assert p.chain_problems[0].startswith(f"seq {odd.seq} HASH_MISMATCH: malformed: {field}")
    assert p.fold.chain_ok is False and p.fold.chain_problems == p.chain_problems

    # After a gap, where prev_hash is not compared, a malformed one is still flagged.
    if field == "prev_hash":
        late = log.events[5].model_copy(update={"prev_hash": value})
        late = late.model_copy(update={"hash": event_hash(late)})
        p = project(fold, late, open_payload(late))
        assert [problem_kind(x) for x in p.chain_problems] == ["HASH_MISMATCH", "GAP"]


# -- generated runs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_generated_runs_keep_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    log = random_run(f"gen-{seed}", rng)
    fold, t = fold_log(log.events)
    run = t["runs"][(log.run_id,)]
    assert run["last_seq"] == len(log.events) == len(t["events"])
    assert fold.ended and run["ended_at_ms"] is not None and run["termination"] is not None
    assert fold.pending_approvals == {}  # every approval was decided or withdrawn
    assert all(a["status"] != "PENDING" for a in t.get("approvals", {}).values())
    assert run["tool_calls"] == len(t.get("tool_calls", {}))
    for (_, step), row in t.get("steps", {}).items():
        calls = [c for c in t.get("tool_calls", {}).values() if c["step"] == step]
        finished = all(c["status"] in CallStatus.TERMINAL for c in calls)
        if row["status"] == StepStatus.COMPLETED:
            assert finished and len(calls) == row["tool_call_count"]
            assert row["ended_at_ms"] is not None
        elif row["status"] == StepStatus.TOOL_CALLS:
            assert not finished or len(calls) < row["tool_call_count"]
    assert derive_status(fold) == fold.status


@pytest.mark.parametrize("seed", range(10))
def test_replaying_any_prefix_twice_changes_nothing(seed: int) -> None:
    """At-least-once delivery: re-delivering every prefix of the log leaves the same rows."""
    rng = random.Random(1000 + seed)
    log = random_run(f"dup-{seed}", rng)
    once_fold, once = fold_log(log.events)
    fold, tables = None, {}
    for n in range(1, len(log.events) + 1):
        fold, tables = fold_log(log.events[: n], fold, tables)
        fold, tables = fold_log(log.events[: rng.randint(1, n)], fold, tables)  # redelivered prefix
    assert tables == once and fold == once_fold


@pytest.mark.parametrize("seed", range(10))
def test_merged_batches_write_the_same_rows_as_single_events(seed: int) -> None:
    rng = random.Random(2000 + seed)
    logs = [random_run(f"mix-{seed}-{i}", rng, tenant_id=f"t{i % 2}") for i in range(4)]
    # Interleave the runs' logs the way partitions interleave them, keeping each run in order.
    queues = [list(log.events) for log in logs]
    stream: list[Envelope] = []
    while any(queues):
        q = rng.choice([q for q in queues if q])
        stream.append(q.pop(0))

    single: Tables = {}
    folds: dict[str, RunFold] = {}
    for env in stream:
        p = project(folds.get(env.run_id), env, open_payload(env))
        folds[env.run_id] = p.fold
        apply(p.writes, single)

    batched: Tables = {}
    folds = {}
    for start in range(0, len(stream), 17):
        writes: list[Upsert] = []
        for env in stream[start:start + 17]:
            p = project(folds.get(env.run_id), env, open_payload(env))
            folds[env.run_id] = p.fold
            writes.extend(p.writes)
        apply(merge(writes), batched)
    assert batched == single


# -- rows and live values -------------------------------------------------------------------------
def test_merge_composes_partial_upserts_in_order() -> None:
    a = Upsert("tool_calls", ("r", "1.0"), {"tenant_id": "t", "status": "REQUESTED", "tool_name": "x", "step": 1})
    b = Upsert("tool_calls", ("r", "1.0"), {"tenant_id": "t", "status": "BUDGETED", "step": 1})
    event = {"tenant_id": "t", "event_type": "x", "recorded_at_ms": 1, "producer": "budget", "payload": Json({}),
             "hash": "h", "prev_hash": "p"}
    c = Upsert("events", ("r", 1), {**event, "event_id": "e1"}, only_insert=True)
    d = Upsert("events", ("r", 1), {**event, "event_id": "e2"}, only_insert=True)
    merged = merge([a, c, b, d])
    assert merged == [
        Upsert("tool_calls", ("r", "1.0"), {"tenant_id": "t", "status": "BUDGETED", "tool_name": "x", "step": 1}),
        Upsert("events", ("r", 1), {**event, "event_id": "e1"}, only_insert=True),
    ]
    with pytest.raises(ValueError):
        merge([c, Upsert("events", ("r", 1), {**event, "event_id": "e3"})])


def test_malformed_writes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown read-model table"):
        Upsert("nope", ("r",), {})
    with pytest.raises(ValueError, match="key needs"):
        Upsert("steps", ("r",), {"tenant_id": "t"})
    # PostgreSQL checks NOT NULL before ON CONFLICT turns an insert into an update.
    with pytest.raises(ValueError, match="tenant_id"):
        Upsert("approvals", ("a1",), {"status": "WITHDRAWN"})


def test_call_index_from_call_id() -> None:
    assert call_index_of("3.2") == 2
    assert call_index_of("weird") is None


def test_live_values() -> None:
    log = happy_run("run-13")
    fold, _ = fold_log(log.events)
    fields = stream_fields(log.events[0], open_payload(log.events[0]))
    assert fields["seq"] == "1" and fields["event_type"] == "tether.v1.RunAccepted"
    assert fields["hash"] == log.events[0].hash and fields["prev_hash"] == "0" * 64
    assert '"agent_id":"agent-1"' in fields["payload"]
    hot = hot_state(fold)
    assert hot["status"] == "COMPLETED" and hot["last_seq"] == "14" and hot["step"] == "2"
    assert hot["input_tokens"] == "300" and hot["ended_at_ms"] == str(fold.ended_at_ms)
    live = hot_state(fold_log(log.events[:3])[0])
    assert live["ended_at_ms"] == "" and live["status"] == "RUNNING"


def test_usage_sums_model_calls_until_a_recorded_total_arrives() -> None:
    log = RunLog("run-14")
    log.accepted()
    log.step(1)
    log.model(1, 0, Usage(input_tokens=10, output_tokens=1, cost_usd_micros=2))
    fold, _ = fold_log(log.events)
    assert (fold.input_tokens, fold.output_tokens, fold.cost_usd_micros) == (10, 1, 2)
    log.step(2)
    log.model_failed(2)
    fold, _ = fold_log(log.events)
    assert (fold.input_tokens, fold.output_tokens, fold.cost_usd_micros) == (17, 1, 5)


def test_rows_do_not_depend_on_how_the_fold_was_stored() -> None:
    """The fold comes back from jsonb with its keys reordered; the rows must not change."""
    log = RunLog("run-15")
    log.accepted()
    log.step(1)
    log.model(1, 12)
    for i in range(12):
        log.request(1, i)
        log.budgeted(1, i)
    for i in reversed(range(12)):
        log.tool_completed(1, i)
    log.step(2)
    log.model(2, 0)
    log.completed(2, "done", Usage(input_tokens=1))
    *head, last = log.events
    fold, _ = fold_log(head)
    stored = fold.model_dump(mode="json")
    # jsonb orders object keys by length, then bytewise: "10" comes after "9".
    reordered = RunFold.model_validate({**stored, "calls": dict(sorted(stored["calls"].items(), reverse=True))})
    assert list(reordered.calls) != list(fold.calls)
    a = project(fold, last, open_payload(last))
    b = project(reordered, last, open_payload(last))
    assert a.fold.termination == b.fold.termination
    assert a.fold.termination["tool_calls_done"][:3] == ["1.0 search COMPLETED", "1.1 search COMPLETED",
                                                         "1.2 search COMPLETED"]
    assert [w for w in a.writes if w.table != "runs"] == [w for w in b.writes if w.table != "runs"]


def test_event_rows_hold_the_payload_as_its_avro_datum_in_json() -> None:
    # event_row dumps the payload with pydantic's compiled dump, not the Python walk of
    # `to_avro()`; as JSON (what jsonb stores) the two are the same for every event type here.
    rng = random.Random(5)
    logs = [happy_run("a"), troubled_run("b"), cancelled_while_waiting("c"), rejected_run("d")]
    logs += [random_run(f"r{i}", rng) for i in range(10)]
    seen = set()
    for log in logs:
        for env in log.events:
            payload = open_payload(env)
            seen.add(type(payload).__name__)
            row = event_row(RunFold(run_id=env.run_id, tenant_id=env.tenant_id), env, payload)
            assert json.dumps(row.values["payload"].value, sort_keys=True) == json.dumps(payload.to_avro(), sort_keys=True)
    assert len(seen) >= 12
