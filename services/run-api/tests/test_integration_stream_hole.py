"""On the real stack: a permanent hole in the read model is DATA_LOSS / STREAM_HOLE, distinct from the
retryable wait for a seq seen live (UNAVAILABLE / STREAM_RESUME_REQUIRED); the facts stored after the
terminal event are streamed too."""

from __future__ import annotations

import json
import uuid

import grpc
import pytest
from google.rpc import error_details_pb2
from psycopg import sql

from tether_api.v1 import run_service_pb2 as runs_pb, run_service_pb2_grpc as runs_grpc
from tether_run_api import admin
from tether_run_api.adapters.live import stream_key
from tether_run_api.api.status import error_info
from tether_run_api.domain.auth import ROLE_MEMBER
from tether_run_api.domain.runs import new_run_id

pytestmark = pytest.mark.integration


def md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def a_run(stack, status: str, last_seq: int) -> tuple[str, str]:
    """A tenant's key and a run the read model has (the projector's rows)."""
    tenant_id = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(stack.app.store, tenant_id, spread=1)
    key = admin.issue_key(stack.app.store, tenant_id, "alice", (ROLE_MEMBER,)).api_key
    run_id = new_run_id(1_700_000_000_000, uuid.uuid4().bytes[:10])
    with stack.pg() as conn:
        conn.execute(sql.SQL("INSERT INTO {}.runs (run_id, tenant_id, status, agent_id, agent_version, goal, "
                             "principal_id, created_at_ms, updated_at_ms, last_seq, last_hash, state) "
                             "VALUES (%s, %s, %s, 'helper', 1, 'g', 'alice', 1, 1, %s, '', '{{}}')").format(
            sql.Identifier(stack.settings.read_model_schema)), (run_id, tenant_id, status, last_seq))
    return run_id, key


def store_events(stack, tenant_id_of_run: str, run_id: str, seqs: list[int], terminal: int = 0) -> None:
    with stack.pg() as conn:
        for seq in seqs:
            etype = "tether.v1.RunCompleted" if seq == terminal else "tether.v1.StepGranted"
            conn.execute(sql.SQL("INSERT INTO {}.events (tenant_id, run_id, seq, event_id, event_type, "
                                 "recorded_at_ms, payload, hash, prev_hash, producer) "
                                 "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 'budget')").format(
                sql.Identifier(stack.settings.read_model_schema)),
                (tenant_id_of_run, run_id, seq, f"ev-{seq}", etype, 1_700_000_000_000 + seq, json.dumps({"step": seq}),
                 f"h{seq}", f"h{seq - 1}"))


def tenant_of(stack, run_id: str) -> str:
    with stack.pg() as conn:
        return conn.execute(sql.SQL("SELECT tenant_id FROM {}.runs WHERE run_id = %s").format(
            sql.Identifier(stack.settings.read_model_schema)), (run_id,)).fetchone()[0]


def stream(stack, key: str, run_id: str, from_seq: int) -> tuple[list[int], grpc.RpcError | None]:
    runs = runs_grpc.RunServiceStub(stack.channel)
    seen: list[int] = []
    try:
        for msg in runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=from_seq),
                                        metadata=md(key), timeout=30):
            seen.append(msg.event.seq)
    except grpc.RpcError as err:
        return seen, err
    return seen, None


def test_a_hole_in_the_read_model_is_data_loss_with_the_next_stored_seq_and_no_retry(stack) -> None:
    run_id, key = a_run(stack, "COMPLETED", last_seq=6)
    store_events(stack, tenant_of(stack, run_id), run_id, [1, 2, 5, 6], terminal=6)  # 3 and 4 never stored
    for from_seq, sent_before in ((1, [1, 2]), (3, [])):  # the same answer on a resume at the hole
        seen, err = stream(stack, key, run_id, from_seq)
        assert seen == sent_before and err is not None
        assert err.code() is grpc.StatusCode.DATA_LOSS
        info, details = error_info(err)
        assert info is not None and info.reason == "STREAM_HOLE" and info.domain == "tether.dev"
        assert dict(info.metadata) == {"run_id": run_id, "next_seq": "3", "next_stored_seq": "5"}
        assert not [d for d in details if isinstance(d, error_details_pb2.RetryInfo)]  # not retryable as is
    # The client skips ahead to the next stored seq and gets the rest.
    assert stream(stack, key, run_id, 5) == ([5, 6], None)


def test_a_seq_seen_live_but_not_yet_stored_stays_the_retryable_stream_resume_required(stack) -> None:
    run_id, key = a_run(stack, "RUNNING", last_seq=1)
    store_events(stack, tenant_of(stack, run_id), run_id, [1])
    # The feed announces seq 2 before the projector stored it (and it never does within STREAM_GAP_WAIT_S).
    live = stream_key(run_id, stack.settings.live_key_prefix)

    runs = runs_grpc.RunServiceStub(stack.channel)
    calls = runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=1), metadata=md(key),
                                 timeout=30)
    seen = [next(calls).event.seq]
    stack.redis.xadd(live, {"seq": 2})
    with pytest.raises(grpc.RpcError) as err:
        for msg in calls:
            seen.append(msg.event.seq)
    assert seen == [1]
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    info, details = error_info(err.value)
    assert info is not None and info.reason == "STREAM_RESUME_REQUIRED" and dict(info.metadata)["next_seq"] == "2"
    assert [d for d in details if isinstance(d, error_details_pb2.RetryInfo)]


def test_the_facts_stored_after_the_terminal_event_are_streamed_after_it(stack) -> None:
    # A run cancelled while its send_mail call was executing: the budget still records the call's
    # outcome after RunTerminated (services/budget decisions._after_end). The client must see it.
    run_id, key = a_run(stack, "TERMINATED", last_seq=5)
    tenant_id = tenant_of(stack, run_id)
    types = {1: "RunAccepted", 2: "ToolCallAuthorized", 3: "RunTerminated", 4: "ToolCallCompleted",
             5: "ModelCallCompleted"}
    with stack.pg() as conn:
        for seq, etype in types.items():
            conn.execute(sql.SQL("INSERT INTO {}.events (tenant_id, run_id, seq, event_id, event_type, "
                                 "recorded_at_ms, payload, hash, prev_hash, producer) "
                                 "VALUES (%s, %s, %s, %s, %s, %s, '{{}}', %s, %s, 'budget')").format(
                sql.Identifier(stack.settings.read_model_schema)),
                (tenant_id, run_id, seq, f"ev-{seq}", f"tether.v1.{etype}", 1_700_000_000_000 + seq, f"h{seq}",
                 f"h{seq - 1}"))
    runs = runs_grpc.RunServiceStub(stack.channel)
    calls = runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=1), metadata=md(key),
                                 timeout=30)
    got = [(msg.event.seq, msg.event.event_type.rsplit(".", 1)[-1], msg.event.terminal) for msg in calls]
    assert got == [(1, "RunAccepted", False), (2, "ToolCallAuthorized", False), (3, "RunTerminated", True),
                   (4, "ToolCallCompleted", False), (5, "ModelCallCompleted", False)]
    # A resume after the terminal event gets the rest too, and one past the last seq ends at once.
    assert stream(stack, key, run_id, 4) == ([4, 5], None)
    assert stream(stack, key, run_id, 6) == ([], None)
