"""On the real stack: a finished run whose last seq the read model holds under another tenant (the
projector's TENANT_MISMATCH rows) ends StreamRunEvents with DATA_LOSS / STREAM_HOLE, on a resume past the
caller's last visible event too, instead of polling PostgreSQL until the client hangs up."""

from __future__ import annotations

import uuid

import grpc
import pytest
from psycopg import sql

from tether_api.v1 import run_service_pb2 as runs_pb, run_service_pb2_grpc as runs_grpc
from tether_run_api import admin
from tether_run_api.api.status import error_info
from tether_run_api.domain.auth import ROLE_MEMBER
from tether_run_api.domain.runs import new_run_id

pytestmark = pytest.mark.integration


def a_run_ending_in_another_tenants_event(stack) -> tuple[str, str]:
    """A TERMINATED run with last_seq 5: seqs 1-4 its tenant's (RunTerminated at 3, a late fact at 4),
    seq 5 stored under another tenant, as the projector stores an event naming another tenant."""
    tenant_id = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(stack.app.store, tenant_id, spread=1)
    key = admin.issue_key(stack.app.store, tenant_id, "alice", (ROLE_MEMBER,)).api_key
    run_id = new_run_id(1_700_000_000_000, uuid.uuid4().bytes[:10])
    schema = sql.Identifier(stack.settings.read_model_schema)
    rows = [(tenant_id, 1, "RunAccepted"), (tenant_id, 2, "StepGranted"), (tenant_id, 3, "RunTerminated"),
            (tenant_id, 4, "ToolCallCompleted"), (f"t-{uuid.uuid4().hex[:10]}", 5, "ApprovalRequested")]
    with stack.pg() as conn:
        conn.execute(sql.SQL("INSERT INTO {}.runs (run_id, tenant_id, status, agent_id, agent_version, goal, "
                             "principal_id, created_at_ms, updated_at_ms, last_seq, last_hash, state, chain_ok) "
                             "VALUES (%s, %s, 'TERMINATED', 'helper', 1, 'g', 'alice', 1, 1, 5, 'h5', '{{}}', "
                             "false)").format(schema), (run_id, tenant_id))
        for tenant, seq, etype in rows:
            conn.execute(sql.SQL("INSERT INTO {}.events (tenant_id, run_id, seq, event_id, event_type, "
                                 "recorded_at_ms, payload, hash, prev_hash, producer) "
                                 "VALUES (%s, %s, %s, %s, %s, %s, '{{}}', %s, %s, 'budget')").format(schema),
                         (tenant, run_id, seq, f"ev-{seq}", f"tether.v1.{etype}", 1_700_000_000_000 + seq, f"h{seq}",
                          f"h{seq - 1}"))
    return run_id, key


def stream(stack, key: str, run_id: str, from_seq: int) -> tuple[list[int], grpc.RpcError | None]:
    runs = runs_grpc.RunServiceStub(stack.channel)
    seen: list[int] = []
    try:
        # The deadline only bounds the test if the stream never ends (it polled until the client left).
        for msg in runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=from_seq),
                                        metadata=[("authorization", f"Bearer {key}")], timeout=20):
            seen.append(msg.event.seq)
    except grpc.RpcError as err:
        return seen, err
    return seen, None


def test_a_finished_run_whose_last_seq_is_another_tenants_event_ends_the_stream_with_a_hole(stack) -> None:
    run_id, key = a_run_ending_in_another_tenants_event(stack)
    for from_seq, sent_before in ((5, []), (4, [4]), (1, [1, 2, 3, 4])):  # resumes, and the whole stream
        seen, err = stream(stack, key, run_id, from_seq)
        assert seen == sent_before and err is not None
        assert err.code() is grpc.StatusCode.DATA_LOSS, err.details()
        info, _ = error_info(err)
        assert info is not None and info.reason == "STREAM_HOLE"
        assert dict(info.metadata) == {"run_id": run_id, "next_seq": "5", "next_stored_seq": "6"}
    # Going on from next_stored_seq, as a client does past any hole, ends the stream with OK.
    assert stream(stack, key, run_id, 6) == ([], None)
