"""A tool-gateway SIGKILLed after a tool's effect and before its result event: an idempotent call is not
applied twice (its recorded result is replayed, or the re-execution with the same key changes nothing);
a non-idempotent one (send_email) is never re-run: ToolCallOutcomeUnknown, and the run waits for a human.

These tests run their own system, whose KV and SMTP sinks record each effect at once and answer
4 s later, so a kill lands between the effect and the gateway learning of it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalRequested,
    RunCompleted,
    RunTerminated,
    StepGranted,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
)
from tether_messaging.chain import verify_chain
from tether_messaging.serde import open_payload
from tether_testing.system import SystemConfig, TetherSystem

pytestmark = pytest.mark.e2e

SCENARIOS = Path(__file__).parent / "scenarios"
SINK_DELAY_MS = 6_000  # the window to read the ledger and kill in: ample on a loaded machine, under kv_put's 10 s timeout
OUTCOMES = (ToolCallCompleted, ToolCallFailed, ToolCallDenied, ToolCallOutcomeUnknown)
#: The ledger trigger's notification channel (see `resolutions`).
CHANNEL = "tether_e2e_resolved"


@pytest.fixture(scope="module")
def tether_system(kafka_bootstrap: str, pg_dsn: str, redis_url: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[TetherSystem]:
    """This module's own system (it overrides the session's): KV and SMTP sinks answer late."""
    system = TetherSystem(SystemConfig(
        kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, redis_url=redis_url,
        workdir=tmp_path_factory.mktemp("tether-gateway-crash"), partitions=2, scenarios=[SCENARIOS],
        sink_delay_ms={"kv": SINK_DELAY_MS, "smtp": SINK_DELAY_MS},
    ))
    try:
        system.start()
        yield system
    finally:
        system.stop()
        leftovers = [name for name, proc in system.processes.items() if proc.running]
        system.drop_data()
    assert not leftovers, f"processes of the system still running after stop(): {leftovers}"


def idem_key(run_id: str, step: int, call_index: int) -> str:
    return hashlib.sha256(f"{run_id}\x1f{step}\x1f{call_index}".encode()).hexdigest()


def wait_until(what: str, found: Callable[[], object], runs, timeout_s: float = 90.0, poll_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while not (value := found()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f}s\n{runs.logs()}")
        time.sleep(poll_s)
    return value


def ledger_row(system: TetherSystem, pg_dsn: str, key: str) -> dict | None:
    with psycopg.connect(pg_dsn, row_factory=dict_row) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {}.tool_calls WHERE idem_key = %s").format(
            sql.Identifier(system.names.gateway_schema)), (key,)).fetchone()


def check_log(log) -> list:
    assert [e.seq for e in log] == list(range(1, len(log) + 1)) and verify_chain(log) == []
    assert len({e.event_id for e in log}) == len(log)
    return [open_payload(e) for e in log]


def crash_gateway(system: TetherSystem) -> None:
    status = system.kill("tool-gateway")
    assert status == -9, f"the gateway was not SIGKILLed (exit status {status})"
    system.restart("tool-gateway")


@pytest.fixture
def resolutions(tether_system: TetherSystem, pg_dsn: str) -> Iterator[psycopg.Connection]:
    """A connection LISTENing to a trigger on the gateway's ledger that notifies each result as it is
    committed, so a test can kill the gateway in the moment between its recorded result and the
    Kafka transaction that carries the result event. Test-only instrumentation of this system's schema."""
    table = sql.Identifier(tether_system.names.gateway_schema, "tool_calls")
    function = sql.Identifier(tether_system.names.gateway_schema, "e2e_notify_resolved")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_notify({}, NEW.idem_key); RETURN NEW; END $$").format(function, sql.Literal(CHANNEL)))
        conn.execute(sql.SQL(
            "CREATE OR REPLACE TRIGGER e2e_notify_resolved AFTER UPDATE OF status ON {} FOR EACH ROW "
            "WHEN (OLD.status IS NULL AND NEW.status IS NOT NULL) EXECUTE FUNCTION {}()").format(table, function))
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
        try:
            yield conn
        finally:
            conn.execute(sql.SQL("DROP TRIGGER IF EXISTS e2e_notify_resolved ON {}").format(table))


@pytest.mark.timeout(300)
def test_an_idempotent_call_with_a_recorded_result_is_replayed_not_executed_again(
        tether_system, resolutions, runs, event_log, pg_dsn):
    system = tether_system
    # The window between the ledger's commit and the gateway's Kafka commit is short: a notified kill
    # usually lands in it. When it lands after (the result event was already committed), that
    # attempt proves nothing and another run tries again.
    for attempt in range(1, 4):
        run_id = system.client.submit("[scenario:e2e-gateway-kv] Write a note.")
        key = idem_key(run_id, 1, 0)
        deadline = time.monotonic() + 90
        for note in resolutions.notifies(timeout=90):
            if note.payload == key:
                system.kill("tool-gateway")  # at once: the result is recorded, its event is not yet sent
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the ledger never recorded the result of {run_id} 1.0\n{runs.logs()}")
        else:
            pytest.fail(f"the ledger never recorded the result of {run_id} 1.0\n{runs.logs()}")
        system.restart("tool-gateway")
        run = runs.wait_for_end(run_id)
        assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
        payloads = check_log(event_log.run(run_id))
        completed = [p for p in payloads if isinstance(p, ToolCallCompleted) and p.call_id == "1.0"]
        assert len(completed) == 1 and not [p for p in payloads if isinstance(p, ToolCallOutcomeUnknown)]
        writes = [r for r in system.sink_records("kv") if r["idempotency_key"] == key]
        if completed[0].replayed:
            # The successor found the result in the ledger and sent it: no second execution at all.
            assert len(writes) == 1 and writes[0]["applied"], writes
            row = ledger_row(system, pg_dsn, key)
            assert row["attempt"] == 1 and row["status"] == "COMPLETED"
            assert json.loads(completed[0].result_json) == json.loads(row["result_json"])
            return
        assert len(writes) == 1, f"a call whose result event was sent ran again: {writes}"
        print(f"attempt {attempt}: the kill came after the result event was committed; trying again")
    pytest.fail("three kills in a row came after the result event was committed; the window was never hit")


@pytest.mark.timeout(300)
def test_an_idempotent_call_killed_between_its_effect_and_its_answer_is_applied_once(
        tether_system, runs, event_log, pg_dsn):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-gateway-kv] Write a note.")
    key = idem_key(run_id, 1, 0)
    wait_until("the KV write did not land", lambda: [r for r in system.sink_records("kv")
                                                     if r["idempotency_key"] == key], runs)
    row = ledger_row(system, pg_dsn, key)
    assert row is not None and row["status"] is None, f"the write already has a result: {row}"
    crash_gateway(system)  # the value is written; the gateway was still waiting for the answer
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()

    payloads = check_log(event_log.run(run_id))
    completed = [p for p in payloads if isinstance(p, ToolCallCompleted)]
    assert [(p.call_id, p.replayed) for p in completed] == [("1.0", False)]
    assert not [p for p in payloads if isinstance(p, ToolCallOutcomeUnknown)]
    # The intent had no result: the successor re-executed with the same idempotency key, and the KV
    # store answered from its first write instead of applying a second one.
    writes = [r for r in system.sink_records("kv") if r["idempotency_key"] == key]
    assert [(r["applied"], r["duplicate"]) for r in writes] == [(True, False), (False, True)], writes
    assert {r["key"] for r in writes} == {system.kv_store_key(f"gw/{run_id}")}
    row = ledger_row(system, pg_dsn, key)
    assert row["attempt"] == 2 and row["status"] == "COMPLETED"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_a_non_idempotent_call_with_no_recorded_result_has_an_unknown_outcome_and_waits_for_a_human(
        decision, tether_system, runs, event_log, pg_dsn):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-gateway-email] Mail the on-call.")
    key = idem_key(run_id, 1, 0)
    events = system.client.follow(run_id, timeout_s=240)
    first = next(e for e in events if e.event_type == "tether.v1.ApprovalRequested")
    request = json.loads(first.payload_json)
    assert request["reasons"] == ["RISK_CLASS"] and request["tool_name"] == "send_email"
    system.approver.decide(request["approval_id"], request["args_hash"], approve=True)
    wait_until("the mail did not reach the SMTP sink", lambda: [r for r in system.sink_records("smtp")
                                                                if r["idempotency_key"] == key], runs)
    row = ledger_row(system, pg_dsn, key)
    assert row is not None and row["status"] is None, f"the send already has a result: {row}"
    crash_gateway(system)  # the mail was taken; the gateway never heard the SMTP server's 250

    # The successor finds the intent without a result and cannot know whether the mail went out.
    unknown = next(e for e in events if e.event_type == "tether.v1.ApprovalRequested")
    ask = json.loads(unknown.payload_json)
    assert ask["reasons"] == ["OUTCOME_UNKNOWN"] and ask["call_id"] == "1.0", ask
    wait_until("GetRun did not show the run waiting for a human",
               lambda: system.client.get_run(run_id).status == runs_pb.RUN_STATUS_WAITING, runs, poll_s=0.2)
    steps = system.client.runs.ListRunSteps(runs_pb.ListRunStepsRequest(run_id=run_id),
                                            metadata=system.client.metadata, timeout=30).steps
    call = next(c for s in steps for c in s.tool_calls if c.call_id == "1.0")
    assert call.status == "OUTCOME_UNKNOWN", call
    payloads = check_log(event_log.run(run_id))
    assert [type(p).__name__ for p in payloads if isinstance(p, OUTCOMES)] == ["ToolCallOutcomeUnknown"]
    assert not [p for p in payloads if isinstance(p, StepGranted) and p.step == 2], "the run went on unattended"
    assert ledger_row(system, pg_dsn, key)["status"] == "OUTCOME_UNKNOWN"

    # A human checks the mailbox and decides.
    system.approver.decide(ask["approval_id"], ask["args_hash"], approve=decision == "approve",
                           comment="checked the mailbox")
    list(events)  # to the terminal event
    run = runs.wait_for_end(run_id)
    payloads = check_log(event_log.run(run_id))
    decided = [p for p in payloads if isinstance(p, ApprovalDecided) and p.approval_id == ask["approval_id"]]
    assert len(decided) == 1
    if decision == "approve":
        # The call counts as done: step 2 runs and the run completes.
        assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
        assert isinstance(payloads[-1], RunCompleted)
        assert [p.step for p in payloads if isinstance(p, StepGranted)] == [1, 2, 3]
        after = [r for r in system.sink_records("kv") if r["idempotency_key"] == idem_key(run_id, 2, 0)]
        assert sum(bool(r["applied"]) for r in after) == 1
    else:
        assert run.status == runs_pb.RUN_STATUS_TERMINATED, runs.logs()
        assert isinstance(payloads[-1], RunTerminated) and payloads[-1].reason_code == "OUTCOME_UNKNOWN"
        assert run.termination.reason_code == "OUTCOME_UNKNOWN"
        assert "1.0 send_email" in " ".join(run.termination.pending), run.termination
        assert [p.step for p in payloads if isinstance(p, StepGranted)] == [1]
    approvals = Counter(tuple(p.reasons) for p in payloads if isinstance(p, ApprovalRequested))
    assert approvals == Counter({("RISK_CLASS",): 1, ("OUTCOME_UNKNOWN",): 1})
    # Whatever the human decided, the mail was never sent a second time.
    mails = [r for r in system.sink_records("smtp") if r["idempotency_key"] == key]
    assert len(mails) == 1 and mails[0]["subject"] == f"gw {run_id}", mails
