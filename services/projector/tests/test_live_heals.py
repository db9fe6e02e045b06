"""Live state that a Redis outage left behind heals, and another tenant's event on a run changes
nothing of it: real PostgreSQL and Redis (an outage is a client pointed at a port nobody serves)."""

from __future__ import annotations

import uuid

import pytest
import redis
from prometheus_client import CollectorRegistry

from tether_messaging.processor import Inbound
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.adapters.redis_live import RedisLiveState, run_key, stream_key, tenant_index_key
from tether_projector.entrypoint import ProjectorProcessor
from tether_projector.handlers import Deps, project_batch
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LogEvent
from tether_projector.testing import RunLog, cancelled_while_waiting, happy_run
from tether_testing.processes import free_port

pytestmark = pytest.mark.integration


def _deps(read_model: PostgresReadModel, live: RedisLiveState) -> Deps:
    return Deps(read_model, live, ProjectorMetrics(CollectorRegistry()))


class Outage:
    """A Redis client whose server goes away and comes back: while down, its connections go to a
    loopback port nobody serves (every command fails to connect, as in an outage)."""

    def __init__(self, redis_url: str) -> None:
        self.up = redis.ConnectionPool.from_url(redis_url)
        self.down = redis.ConnectionPool(port=free_port(), socket_connect_timeout=1, socket_timeout=1)
        self.client = redis.Redis(connection_pool=self.up)

    def __enter__(self) -> None:
        self.client.connection_pool = self.down

    def __exit__(self, *exc: object) -> None:
        self.client.connection_pool = self.up


def test_an_ended_run_whose_last_publish_failed_is_healed_by_the_next_batch(
    pg_read_model: PostgresReadModel, redis_url: str, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    redis_server = Outage(redis_url)
    deps = _deps(pg_read_model, RedisLiveState(redis_server.client, prefix=redis_prefix))
    u = uuid.uuid4().hex[:6]
    cancelled = cancelled_while_waiting(f"run-c-{u}").log_events()
    other = happy_run(f"run-o-{u}").log_events()
    run_id = cancelled[0].envelope.run_id
    project_batch(cancelled[:-1], deps=deps)
    # The batch with RunTerminated: PostgreSQL commits (and so would the offsets), Redis is away.
    with redis_server:
        project_batch(cancelled[-1:], deps=deps)
    assert pg_read_model.rows("runs")[0]["status"] == "TERMINATED"
    hot = run_key(run_id, redis_prefix)
    assert redis_client.hget(hot, "status") == b"WAITING_APPROVAL"

    # The next batch (another run's events) gets through and publishes the ended run too.
    project_batch(other[:2], deps=deps)
    assert redis_client.hget(hot, "status") == b"TERMINATED"
    assert redis_client.zscore(tenant_index_key("tenant-a", redis_prefix), run_id) is None
    assert redis_client.zscore(tenant_index_key("tenant-a", redis_prefix), other[0].envelope.run_id) is not None
    ids = [i.decode() for i, _ in redis_client.xrange(stream_key(run_id, redis_prefix))]
    assert ids == [f"{s}-0" for s in range(1, len(cancelled) + 1)]
    assert 0 < redis_client.ttl(hot) <= 24 * 3600  # the ended run's retention, not the live TTL


def test_the_projector_tick_republishes_while_no_event_arrives(
    pg_read_model: PostgresReadModel, redis_url: str, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    redis_server = Outage(redis_url)
    events = cancelled_while_waiting(f"run-t-{uuid.uuid4().hex[:6]}").log_events()
    processor = ProjectorProcessor(_deps(pg_read_model, RedisLiveState(redis_server.client, prefix=redis_prefix)),
                                   "unused-topic")
    with redis_server:
        for ev in events:
            processor.handle(_inbound(ev), None)  # type: ignore[arg-type]
        processor.before_commit()
    hot = run_key(events[0].envelope.run_id, redis_prefix)
    assert not redis_client.exists(hot)
    processor.on_tick(None)  # type: ignore[arg-type]  # the tick uses no context
    fields = redis_client.hgetall(hot)
    assert fields[b"status"] == b"TERMINATED" and int(fields[b"last_seq"]) == len(events)
    assert redis_client.xlen(stream_key(events[0].envelope.run_id, redis_prefix)) == len(events)


def _inbound(ev: LogEvent) -> Inbound:
    return Inbound("unused-topic", 0, ev.envelope.seq, ev.envelope, ev.payload)


def test_another_tenants_event_on_a_run_is_recorded_under_its_tenant_and_applies_nothing(
    pg_read_model: PostgresReadModel, redis_client: redis.Redis, redis_prefix: str,
) -> None:
    log = RunLog(f"run-x-{uuid.uuid4().hex[:6]}", "tenant-a")
    log.accepted()
    log.step(1)
    log.model(1, 1)
    log.request(1, 0, "send_mail")
    log.budgeted(1, 0)
    log.tenant_id = "tenant-b"  # a correctly chained event that names another tenant
    log.approval_requested(1, 0, tool="send_mail")
    project_batch(log.log_events(), deps=_deps(pg_read_model, RedisLiveState(redis_client, prefix=redis_prefix)))

    [run] = pg_read_model.rows("runs")
    assert (run["tenant_id"], run["status"], run["last_seq"], run["chain_ok"]) == ("tenant-a", "RUNNING", 6, False)
    assert [p.split(" ")[2] for p in run["chain_problems"]] == ["TENANT_MISMATCH:"]
    events = pg_read_model.rows("events")
    assert [(e["seq"], e["tenant_id"]) for e in events][-2:] == [(5, "tenant-a"), (6, "tenant-b")]
    # No pending approval appears for tenant-a (nor the call waiting for one).
    assert pg_read_model.rows("approvals") == []
    assert [c["status"] for c in pg_read_model.rows("tool_calls")] == ["BUDGETED"]
    # tenant-a's followers of the run's live stream do not get tenant-b's content either.
    ids = [i.decode() for i, _ in redis_client.xrange(stream_key(log.run_id, redis_prefix))]
    assert ids == [f"{s}-0" for s in range(1, 6)]
    assert redis_client.hget(run_key(log.run_id, redis_prefix), "last_seq") == b"6"
