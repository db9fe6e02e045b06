"""A run with three tool calls through all six real processes: the log, the read model and the sinks tell one story."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import RunCompleted, ToolCallCompleted, ToolCallRequested
from tether_messaging.chain import verify_chain
from tether_messaging.serde import open_payload

pytestmark = pytest.mark.e2e

EXPECTED_CALLS = {"1.0": "http_get", "1.1": "kv_put", "2.0": "send_email"}


def idem_key(run_id: str, step: int, call_index: int) -> str:
    return hashlib.sha256(f"{run_id}\x1f{step}\x1f{call_index}".encode()).hexdigest()


def test_three_tool_calls_complete_and_log_read_model_and_sinks_agree(tether_system, runs, event_log, pg_dsn):
    system = tether_system
    run_id, url = runs.submit()

    # Follow the run live; the email needs a human, so approve it as the tenant's approver.
    streamed = []
    for event in system.client.follow(run_id, timeout_s=180):
        streamed.append(event)
        if event.event_type == "tether.v1.ApprovalRequested":
            request = json.loads(event.payload_json)
            assert request["tool_name"] == "send_email"
            system.approver.decide(request["approval_id"], request["args_hash"], approve=True)
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()

    # -- the log: one partition, seq 1..N, an intact hash chain, each outcome once --------------
    records = [(p, o, env) for p, o, env in event_log.read_all() if env.run_id == run_id]
    log = [env for _, _, env in records]
    assert len({p for p, _, _ in records}) == 1, "a run's events share one partition"
    assert [env.seq for env in log] == list(range(1, len(log) + 1))
    assert verify_chain(log) == []
    assert len({env.event_id for env in log}) == len(log)
    assert all(env.tenant_id == system.bootstrap.tenant_id for env in log)
    payloads = [open_payload(env) for env in log]
    kinds = Counter(type(p).__name__ for p in payloads)
    assert kinds["ToolCallRequested"] == 3 and kinds["ToolCallBudgeted"] == 3 and kinds["ToolCallCompleted"] == 3
    assert kinds["ApprovalRequested"] == 1 and kinds["ApprovalDecided"] == 1 and kinds["RunCompleted"] == 1
    assert isinstance(payloads[-1], RunCompleted)
    requested = {p.call.call_id: p.call for p in payloads if isinstance(p, ToolCallRequested)}
    completed = {p.call_id: p for p in payloads if isinstance(p, ToolCallCompleted)}
    assert {cid: call.tool_name for cid, call in requested.items()} == EXPECTED_CALLS
    assert set(completed) == set(EXPECTED_CALLS)
    for cid, call in requested.items():
        step, index = (int(x) for x in cid.split("."))
        assert call.idem_key == idem_key(run_id, step, index)
        assert call.args_hash == hashlib.sha256(call.args_json.encode()).hexdigest()

    # -- the live stream delivered exactly the log ----------------------------------------------
    assert [(e.seq, e.event_id, e.event_type) for e in streamed] == [(e.seq, e.event_id, e.event_type) for e in log]
    assert streamed[-1].terminal

    # -- run-api's view of the read model -------------------------------------------------------
    answer = payloads[-1].answer
    assert run.answer == answer and run_id in answer
    assert run.last_seq == len(log)
    assert run.steps == 3
    trace = system.client.runs.GetRunTrace(runs_pb.GetRunTraceRequest(run_id=run_id), metadata=system.client.metadata,
                                           timeout=30)
    assert not trace.truncated
    assert [(t.seq, t.event_id, t.event_type) for t in trace.events] == [(e.seq, e.event_id, e.event_type) for e in log]
    steps = system.client.runs.ListRunSteps(runs_pb.ListRunStepsRequest(run_id=run_id),
                                            metadata=system.client.metadata, timeout=30).steps
    assert [s.step for s in steps] == [1, 2, 3]
    calls = {c.call_id: c for s in steps for c in s.tool_calls}
    assert {cid: c.tool_name for cid, c in calls.items()} == EXPECTED_CALLS
    for cid, c in calls.items():
        assert c.status == "COMPLETED", (cid, c.status)
        assert c.args_hash == requested[cid].args_hash
        assert c.result_json == completed[cid].result_json
    assert calls["2.0"].approval_id

    # -- the read model's tables, directly ------------------------------------------------------
    schema = system.names.read_model_schema
    with psycopg.connect(pg_dsn, row_factory=dict_row) as conn:
        rows = conn.execute(sql.SQL("SELECT * FROM {}.events WHERE run_id = %s ORDER BY seq").format(
            sql.Identifier(schema)), (run_id,)).fetchall()
        run_row = conn.execute(sql.SQL("SELECT * FROM {}.runs WHERE run_id = %s").format(sql.Identifier(schema)),
                               (run_id,)).fetchone()
    fields = ("seq", "event_id", "event_type", "recorded_at_ms", "producer", "hash", "prev_hash", "tenant_id")
    assert [tuple(r[f] for f in fields) for r in rows] == [tuple(getattr(e, f) for f in fields) for e in log]
    assert [r["causation_id"] for r in rows] == [e.causation_id for e in log]
    assert run_row["status"] == "COMPLETED" and run_row["answer"] == answer
    assert run_row["last_seq"] == len(log) and run_row["last_hash"] == log[-1].hash
    assert run_row["chain_ok"] is True

    # -- every side effect landed exactly once, where it lands ----------------------------------
    fetched = [r for r in system.sink_records("http") if r["path"] == urlsplit(url).path]
    assert len(fetched) == 1 and fetched[0]["method"] == "GET"
    writes = [r for r in system.sink_records("kv") if r["idempotency_key"] == requested["1.1"].idem_key]
    assert len(writes) == 1 and writes[0]["applied"] is True and writes[0]["key"] == system.kv_store_key(f"e2e/{run_id}")
    mails = [r for r in system.sink_records("smtp") if r["idempotency_key"] == requested["2.0"].idem_key]
    assert len(mails) == 1 and mails[0]["subject"] == f"e2e {run_id}"

    # -- the model answered each model call of each step once -----------------------------------
    calls_by_step = Counter(
        (r["headers"].get("x-tether-step"), r["headers"].get("x-tether-call"))
        for r in system.model_requests()
        if r["headers"].get("x-tether-run") == run_id and r["status"] == 200
    )
    assert calls_by_step == {("1", "0"): 1, ("2", "0"): 1, ("3", "0"): 1}
