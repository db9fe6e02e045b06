"""An event whose schema this build does not know holds its partition instead of being dropped for
good, while the projector stays up, serves the other partitions and exports the block (real broker
and PostgreSQL; the loop configured as `python -m tether_projector` configures it)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import REGISTRY, CollectorRegistry

from tether_messaging.admin import declare_topics
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import MAGIC, encode
from tether_messaging.topics import Topics
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.bootstrap import loop_options
from tether_projector.entrypoint import ProjectorProcessor
from tether_projector.handlers import Deps
from tether_projector.metrics import ProjectorMetrics
from tether_projector.settings import ProjectorSettings
from tether_projector.testing import happy_run

PARTITIONS = 2


@pytest.fixture
def prefix(kafka_bootstrap: str) -> Iterator[str]:
    """A unique topic prefix, its topics declared and deleted afterwards."""
    prefix = f"test-projector-{uuid.uuid4().hex[:10]}."
    declare_topics(kafka_bootstrap, PARTITIONS, ["projector"], prefix=prefix)
    yield prefix
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    mine = [t for t in admin.list_topics(timeout=30).topics if t.startswith(prefix)]
    for fut in admin.delete_topics(mine, operation_timeout=30).values():
        fut.result(timeout=30)


def _blocked(topic: str) -> dict[str, float]:
    """tether_loop_blocked of the projector on `topic`: partition -> value."""
    return {
        s.labels["partition"]: s.value
        for m in REGISTRY.collect() if m.name == "tether_loop_blocked"
        for s in m.samples if s.labels.get("service") == "projector" and s.labels.get("topic") == topic
    }


@pytest.mark.integration
def test_an_event_of_an_unknown_schema_holds_its_partition_before_it_and_the_projector_serves_the_rest(
    kafka_bootstrap: str, prefix: str, pg_read_model: PostgresReadModel,
) -> None:
    topics = Topics(prefix)
    log = happy_run(f"run-{uuid.uuid4().hex[:6]}")
    # seq 4 written by a newer producer: its payload schema's fingerprint is unknown to this build.
    e4 = log.events[3]
    newer = e4.model_copy(update={"payload": MAGIC + b"\x01" * 8 + e4.payload[10:]})
    partition = partition_for(log.tenant_id, log.run_id, PARTITIONS)
    # A run of another tenant, on the other partition: not held up by the block.
    other_tenant = next(t for t in (f"tenant-{i}" for i in range(100))
                        if partition_for(t, "x", PARTITIONS) != partition)
    other = happy_run(f"run-{uuid.uuid4().hex[:6]}", other_tenant)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def append(envs) -> None:
        for env in envs:
            p = partition_for(env.tenant_id, env.run_id, PARTITIONS)
            producer.produce(topics.run_events, encode(env), env.run_id.encode(), partition=p)
        assert producer.flush(30) == 0

    settings = ProjectorSettings(topic_prefix=prefix, kafka_bootstrap=kafka_bootstrap)
    processor = ProjectorProcessor(Deps(pg_read_model, None, ProjectorMetrics(CollectorRegistry())),
                                   topics.run_events)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, session_timeout_ms=6000, batch_max_ms=20,
                        **loop_options(settings))
    loop = ProcessorLoop(processor, config)
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # asserted below
            failure.append(exc)

    def last_seq(run_id: str) -> int:
        return next((r["last_seq"] for r in pg_read_model.rows("runs") if r["run_id"] == run_id), 0)

    def wait(what: str, cond) -> None:
        deadline = time.monotonic() + 120
        while thread.is_alive() and not cond() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cond(), (what, failure)

    append(log.events[:3])
    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait("seq 1-3 projected", lambda: last_seq(log.run_id) == 3)
        append([newer, *log.events[4:]])
        wait("the partition blocked", lambda: _blocked(topics.run_events) == {str(partition): 1.0})
        append(other.events)
        wait("the other partition's run projected", lambda: last_seq(other.run_id) == len(other.events))

        assert thread.is_alive() and not failure, failure
        assert not loop.ready  # /readyz: 503 while a partition is blocked
        [run_row] = [r for r in pg_read_model.rows("runs") if r["run_id"] == log.run_id]
        # Held before seq 4: no false GAP, last_seq not past it, so it is projected after the upgrade.
        assert run_row["last_seq"] == 3 and run_row["chain_ok"], run_row["chain_problems"]
        assert [e["seq"] for e in pg_read_model.rows("events") if e["run_id"] == log.run_id] == [1, 2, 3]
        reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id("projector")})
        try:
            for p in range(PARTITIONS):
                assert reader.get_watermark_offsets(TopicPartition(topics.dead_letters, p), timeout=10)[1] == 0
            [committed] = reader.committed([TopicPartition(topics.run_events, partition)], timeout=10)
            assert committed.offset == 3  # the record at offset 3: read again by a build that can
        finally:
            reader.close()
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and not failure, failure
    assert last_seq(log.run_id) == 3
