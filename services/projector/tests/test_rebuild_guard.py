"""A rebuild never replaces the schema a running projector writes, never runs twice on one target,
fails only when it stops making progress, and never skips an event it cannot read yet: real
broker, PostgreSQL and Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence

import psycopg
import pytest
import redis
from confluent_kafka import Consumer, Producer
from prometheus_client import CollectorRegistry

from tether_messaging.partitioner import partition_for
from tether_messaging.serde import MAGIC, encode
from tether_messaging.topics import Topics
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.adapters.redis_live import RedisLiveState
from tether_projector.domain.rows import TABLE_KEYS
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LiveUpdate
from tether_projector.rebuild import RebuildFailed, RebuildReport, rebuild
from tether_projector.testing import happy_run, troubled_run

pytestmark = pytest.mark.integration

PARTITIONS = 2


def dump(dsn: str, schema: str) -> dict[str, list[dict]]:
    model = PostgresReadModel(dsn, schema)
    try:
        return {table: model.rows(table) for table in TABLE_KEYS}
    finally:
        model.close()


def schema_exists(dsn: str, schema: str) -> bool:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is not None


@pytest.fixture
def setup(kafka_bootstrap: str, kafka_topics, pg_dsn: str) -> Iterator[tuple[str, str, str]]:
    """(topic holding two runs' logs, the projector's group id, the schema it writes); schemas dropped after."""
    prefix = f"test-rbg-{uuid.uuid4().hex[:8]}."
    topic = kafka_topics.create("rebuild-guard", partitions=PARTITIONS)
    u = uuid.uuid4().hex[:6]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for log in (happy_run(f"run-a-{u}", "tenant-a"), troubled_run(f"run-b-{u}", "tenant-b")):
        for env in log.events:
            producer.produce(topic, encode(env), env.run_id.encode(),
                             partition=partition_for(env.tenant_id, env.run_id, PARTITIONS))
    assert producer.flush(30) == 0
    schema = f"test_rbg_{uuid.uuid4().hex[:10]}"
    yield topic, Topics(prefix).group_id("projector"), schema
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for s in (schema, f"{schema}_other"):
            for name in (s, f"{s}__rebuild"):
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def replay(kafka_bootstrap: str, pg_dsn: str, topic: str, group: str, live_schema: str, *,
           target: str | None = None, live: RedisLiveState | None = None, batch_size: int = 2_000,
           idle_timeout_s: float = 120.0) -> RebuildReport:
    return rebuild(bootstrap=kafka_bootstrap, topic=topic, dsn=pg_dsn, target_schema=target or live_schema,
                   group_id=f"{group}.rebuild", metrics=ProjectorMetrics(CollectorRegistry()), live=live,
                   batch_size=batch_size, idle_timeout_s=idle_timeout_s, projector_group=group,
                   live_schema=live_schema)


def join_group(bootstrap: str, group: str, topic: str) -> Consumer:
    """A real member of the projector's consumer group, holding partitions (as a running projector does)."""
    member = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                       "session.timeout.ms": 6000})
    member.subscribe([topic])
    deadline = time.monotonic() + 60
    while not member.assignment():
        if time.monotonic() > deadline:
            member.close()
            pytest.fail("the member got no partitions")
        member.poll(0.2)
    return member


class DuringRebuild(RedisLiveState):
    """The rebuild's live state on real Redis, running `action` once, at its first publish: in the
    middle of the rebuild, after it has started reading and before the swap."""

    def __init__(self, client: redis.Redis, prefix: str, action, delay_s: float = 0.0) -> None:
        super().__init__(client, prefix=prefix)
        self.action = action
        self.delay_s = delay_s
        self.publishes = 0

    def publish(self, updates: Sequence[LiveUpdate]) -> None:
        self.publishes += 1
        if self.publishes == 1 and self.action is not None:
            self.action()
        if self.delay_s:
            time.sleep(self.delay_s)
        super().publish(updates)


def test_a_rebuild_of_the_projectors_schema_is_refused_while_its_group_has_members(
    kafka_bootstrap: str, pg_dsn: str, setup: tuple[str, str, str],
) -> None:
    topic, group, schema = setup
    report = replay(kafka_bootstrap, pg_dsn, topic, group, schema)  # no member yet: allowed
    assert report.applied > 0
    before = dump(pg_dsn, schema)

    member = join_group(kafka_bootstrap, group, topic)
    try:
        with pytest.raises(RebuildFailed) as refused:
            replay(kafka_bootstrap, pg_dsn, topic, group, schema)
        assert refused.value.reason == "PROJECTOR_RUNNING"
        assert dump(pg_dsn, schema) == before
        assert not schema_exists(pg_dsn, f"{schema}__rebuild")

        # The command line: exit 1 and the reason as JSON on stderr.
        env = {**os.environ, "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap, "TETHER_PG_DSN": pg_dsn,
               "TETHER_TOPIC_PREFIX": group.removesuffix("projector"), "TETHER_PROJECTOR_EVENTS_TOPIC": topic,
               "TETHER_PROJECTOR_READ_MODEL_SCHEMA": schema}
        done = subprocess.run([sys.executable, "-m", "tether_projector", "rebuild"], env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 1, done.stderr[-2000:]
        error = json.loads(done.stderr.strip().splitlines()[-1])
        assert error["error"] == "PROJECTOR_RUNNING" and group in error["detail"]
        assert dump(pg_dsn, schema) == before

        # Into another schema (readers pointed at it afterwards) a rebuild may run meanwhile.
        other = replay(kafka_bootstrap, pg_dsn, topic, group, schema, target=f"{schema}_other")
        assert other.applied == report.applied
    finally:
        member.close()  # leaves the group at once
    assert replay(kafka_bootstrap, pg_dsn, topic, group, schema).applied == report.applied


def test_a_projector_that_starts_during_the_rebuild_stops_the_swap(
    kafka_bootstrap: str, pg_dsn: str, redis_client: redis.Redis, redis_prefix: str, setup: tuple[str, str, str],
) -> None:
    topic, group, schema = setup
    replay(kafka_bootstrap, pg_dsn, topic, group, schema)
    before = dump(pg_dsn, schema)
    members: list[Consumer] = []
    live = DuringRebuild(redis_client, redis_prefix, lambda: members.append(join_group(kafka_bootstrap, group, topic)))
    try:
        with pytest.raises(RebuildFailed) as refused:
            replay(kafka_bootstrap, pg_dsn, topic, group, schema, live=live, batch_size=5)
    finally:
        for m in members:
            m.close()
    assert live.publishes > 1  # it read on after the member joined, and stopped only at the swap
    assert refused.value.reason == "PROJECTOR_RUNNING" and "at the swap" in refused.value.detail
    assert dump(pg_dsn, schema) == before


def test_a_second_rebuild_of_the_same_schema_is_refused_while_one_runs(
    kafka_bootstrap: str, pg_dsn: str, redis_client: redis.Redis, redis_prefix: str, setup: tuple[str, str, str],
) -> None:
    topic, group, schema = setup
    second: list[BaseException | RebuildReport] = []

    def rebuild_again() -> None:
        try:
            second.append(replay(kafka_bootstrap, pg_dsn, topic, group, schema))
        except RebuildFailed as exc:
            second.append(exc)

    live = DuringRebuild(redis_client, redis_prefix, rebuild_again)
    first = replay(kafka_bootstrap, pg_dsn, topic, group, schema, live=live, batch_size=5)
    [outcome] = second
    assert isinstance(outcome, RebuildFailed) and outcome.reason == "REBUILD_RUNNING", outcome
    assert len(dump(pg_dsn, schema)["events"]) == first.applied  # the first one's read model, whole
    # The lock went with the first rebuild.
    assert replay(kafka_bootstrap, pg_dsn, topic, group, schema).applied == first.applied


def test_a_rebuild_longer_than_its_idle_timeout_succeeds_while_it_progresses(
    kafka_bootstrap: str, pg_dsn: str, redis_client: redis.Redis, redis_prefix: str, setup: tuple[str, str, str],
) -> None:
    topic, group, schema = setup
    # Every batch of 5 events takes 1.5 s (a slow database, say): the whole rebuild takes several
    # idle timeouts, but something is read well within each one.
    live = DuringRebuild(redis_client, redis_prefix, None, delay_s=1.5)
    report = replay(kafka_bootstrap, pg_dsn, topic, group, schema, live=live, batch_size=5, idle_timeout_s=4.0)
    assert live.publishes * live.delay_s > 2 * 4.0  # the batches alone outlast two idle timeouts
    assert len(dump(pg_dsn, schema)["events"]) == report.applied == report.records


def test_a_record_of_a_schema_this_build_does_not_know_fails_the_rebuild_corrupt_bytes_are_skipped(
    kafka_bootstrap: str, pg_dsn: str, setup: tuple[str, str, str],
) -> None:
    topic, group, schema = setup
    report = replay(kafka_bootstrap, pg_dsn, topic, group, schema)
    before = dump(pg_dsn, schema)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topic, bytes(range(0xFF, 0xBF, -1)), b"k", partition=0)  # corrupt: skipped, counted
    assert producer.flush(30) == 0
    again = replay(kafka_bootstrap, pg_dsn, topic, group, schema)
    assert (again.applied, again.undecodable) == (report.applied, 1)
    assert dump(pg_dsn, schema) == before

    # A newer producer's payload schema: the live projector stops on it, so the rebuild fails
    # rather than leave a false GAP in its run (and the old read model stays).
    log = happy_run(f"run-new-{uuid.uuid4().hex[:6]}")
    newer = log.events[1].model_copy(update={"payload": MAGIC + b"\x01" * 8 + log.events[1].payload[10:]})
    for env in (log.events[0], newer, *log.events[2:]):
        producer.produce(topic, encode(env), env.run_id.encode(), partition=1)
    assert producer.flush(30) == 0
    with pytest.raises(RebuildFailed) as failed:
        replay(kafka_bootstrap, pg_dsn, topic, group, schema)
    assert failed.value.reason == "UNKNOWN_SCHEMA" and "UNKNOWN_FINGERPRINT" in failed.value.detail
    assert dump(pg_dsn, schema) == before
