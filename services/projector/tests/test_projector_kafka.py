"""`python -m tether_projector` on the real broker, PostgreSQL and Redis: the read model, redelivery, rebuild."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry

from tether_contracts.records import Envelope, RunCompleted, Usage
from tether_messaging.admin import declare_topics
from tether_messaging.chain import seal
from tether_messaging.envelopes import headers_for, make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import encode
from tether_messaging.topics import Topics
from tether_projector.adapters.memory import InMemoryLiveState, InMemoryReadModel
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.adapters.redis_live import run_key, stream_key, tenant_index_key
from tether_projector.domain.rows import TABLE_KEYS
from tether_projector.entrypoint import ProjectorProcessor
from tether_projector.handlers import Deps
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import ReadModelUnavailable
from tether_projector.testing import RunLog, cancelled_while_waiting, happy_run, random_run, rejected_run, troubled_run
from tether_testing.processes import free_port

PARTITIONS = 2


def dump(dsn: str, schema: str) -> dict[str, list[dict[str, Any]]]:
    """Every read-model table, ordered by its key."""
    model = PostgresReadModel(dsn, schema)
    try:
        return {table: model.rows(table) for table in TABLE_KEYS}
    finally:
        model.close()


def produce_log(bootstrap: str, topic: str, logs: list[RunLog], rng: random.Random) -> RunLog:
    """Append the runs' events the way the budget does: transactions, each run on its partition,
    runs interleaved. Returns the run into whose middle an ABORTED transaction put a forged event."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"test-budget-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    queues = [list(log.events) for log in logs]
    victim = logs[0]
    forged_at = len(victim.events) // 2  # after this many of the victim's events

    def send(env: Envelope) -> None:
        p = partition_for(env.tenant_id, env.run_id, PARTITIONS)
        producer.produce(topic, encode(env), env.run_id.encode(), partition=p, headers=headers_for(env))

    sent_victim = 0
    while any(queues):
        producer.begin_transaction()
        for _ in range(rng.randint(1, 12)):
            live = [q for q in queues if q]
            if not live:
                break
            q = rng.choice(live)
            env = q.pop(0)
            send(env)
            if env.run_id == victim.run_id:
                sent_victim += 1
        producer.commit_transaction(30)
        if 0 <= forged_at <= sent_victim:
            # A forged next event in a transaction that aborts: read_committed never shows it.
            producer.begin_transaction()
            fake = make_envelope(RunCompleted(step=1, answer="FORGED", usage=Usage()), run_id=victim.run_id,
                                 tenant_id=victim.tenant_id, event_id="forged", producer="budget",
                                 recorded_at_ms=1)
            prev = victim.events[sent_victim - 1].hash or ""
            send(seal(fake, sent_victim + 1, prev))
            producer.flush(30)
            producer.abort_transaction(30)
            forged_at = -1
    return victim


def wait_for(what: str, check, timeout: float = 120.0, service=None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            log = "\n".join(service.log_text().splitlines()[-40:]) if service is not None else ""
            pytest.fail(f"timed out waiting for {what}\n{log}")
        time.sleep(0.3)


def last_seqs(dsn: str, schema: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        try:
            return dict(conn.execute(f'SELECT run_id, last_seq FROM "{schema}".runs').fetchall())
        except psycopg.errors.UndefinedTable:
            return {}


def group_caught_up(bootstrap: str, group: str, topic: str) -> bool:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        committed = c.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10)
        for tp in committed:
            _low, high = c.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)
            if high == 0:
                continue  # an empty partition: nothing to commit
            # The log ends with a transaction marker; the committed offset may sit on or after it.
            if tp.offset < high - 1:
                return False
        return True
    finally:
        c.close()


def metric(port: int, name: str, labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def isolation(kafka_bootstrap: str, pg_dsn: str) -> Iterator[tuple[str, str]]:
    """A unique topic prefix (topics declared, deleted afterwards) and a unique schema name (dropped)."""
    prefix = f"test-projector-{uuid.uuid4().hex[:10]}."
    schema = f"test_rm_{uuid.uuid4().hex[:10]}"
    declare_topics(kafka_bootstrap, PARTITIONS, ["projector"], prefix=prefix)
    yield prefix, schema
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for s in (schema, f"{schema}_rebuilt", f"{schema}_rebuilt__rebuild"):
            conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    mine = [t for t in admin.list_topics(timeout=30).topics if t.startswith(prefix)]
    for fut in admin.delete_topics(mine, operation_timeout=30).values():
        fut.result(timeout=30)


@pytest.mark.integration
def test_projector_builds_the_read_model_idempotently_and_a_rebuild_is_identical(
    kafka_bootstrap: str, pg_dsn: str, redis_url: str, redis_client: redis.Redis, redis_prefix: str,
    isolation: tuple[str, str], service_processes, tmp_path: Path,
) -> None:
    prefix, schema = isolation
    topics = Topics(prefix)
    rng = random.Random(42)
    u = uuid.uuid4().hex[:6]
    logs = [
        happy_run(f"run-happy-{u}", "tenant-a"),
        troubled_run(f"run-troubled-{u}", "tenant-b"),
        cancelled_while_waiting(f"run-cancel-{u}", "tenant-a"),
        rejected_run(f"run-rejected-{u}", "tenant-c"),
        *[random_run(f"run-gen{i}-{u}", rng, tenant_id=f"tenant-{'abc'[i % 3]}") for i in range(12)],
    ]
    victim = produce_log(kafka_bootstrap, topics.run_events, logs, rng)
    expected = {log.run_id: len(log.events) for log in logs}

    port = free_port()
    env = {
        "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TETHER_PG_DSN": pg_dsn,
        "TETHER_REDIS_URL": redis_url,
        "TETHER_TOPIC_PREFIX": prefix,
        "TETHER_PARTITIONS": str(PARTITIONS),
        "TETHER_PROJECTOR_READ_MODEL_SCHEMA": schema,
        "TETHER_PROJECTOR_REDIS_KEY_PREFIX": redis_prefix,
        "TETHER_PROJECTOR_METRICS_PORT": str(port),
        "TETHER_PROJECTOR_BATCH_MAX_MS": "20",
        "TETHER_PROJECTOR_SESSION_TIMEOUT_MS": "6000",
    }
    projector = service_processes.start("tether_projector", health_port=port, env=env, health_path="/readyz",
                                        timeout=90)
    # A crash as soon as anything is projected (mid-log, or at its end on a fast machine): the
    # restarted process replays from the committed offsets, and nothing is lost or doubled.
    wait_for("a first run projected", lambda: bool(last_seqs(pg_dsn, schema)), service=projector)
    projector.kill()
    projector.restart(timeout=90)
    wait_for("every run projected", lambda: last_seqs(pg_dsn, schema) == expected, service=projector)
    group = topics.group_id("projector")
    wait_for("offsets committed", lambda: group_caught_up(kafka_bootstrap, group, topics.run_events),
             service=projector)

    # -- the read model ------------------------------------------------------------------------
    first = dump(pg_dsn, schema)
    runs = {r["run_id"]: r for r in first["runs"]}
    assert runs[logs[0].run_id]["status"] == "COMPLETED" and runs[logs[0].run_id]["answer"] == "42"
    assert runs[logs[1].run_id]["status"] == "TERMINATED" and runs[logs[1].run_id]["reason_code"] == "MODEL_FAILED"
    assert runs[logs[2].run_id]["status"] == "TERMINATED" and runs[logs[2].run_id]["reason_code"] == "CANCELLED"
    assert runs[logs[3].run_id]["status"] == "REJECTED"
    assert all(r["chain_ok"] for r in first["runs"]), [r["chain_problems"] for r in first["runs"]]
    assert len(first["events"]) == sum(expected.values())
    victim_events = [e for e in first["events"] if e["run_id"] == victim.run_id]
    assert [e["event_id"] for e in victim_events] == [e.event_id for e in victim.events]  # nothing aborted
    assert "FORGED" not in json.dumps([e["payload"] for e in first["events"]])
    approvals = {a["approval_id"]: a for a in first["approvals"]}
    assert approvals[f"apr-{logs[0].run_id}-1.1"]["status"] == "APPROVED"
    assert approvals[f"apr-{logs[2].run_id}-1.0"]["status"] == "WITHDRAWN"

    # -- Redis ----------------------------------------------------------------------------------
    for log in logs:
        ids = [i.decode() for i, _ in redis_client.xrange(stream_key(log.run_id, redis_prefix))]
        assert ids == [f"{s}-0" for s in range(1, len(log.events) + 1)]
        hot = redis_client.hgetall(run_key(log.run_id, redis_prefix))
        assert int(hot[b"last_seq"]) == len(log.events)
        assert hot[b"status"].decode() == runs[log.run_id]["status"]
        assert 0 < redis_client.ttl(stream_key(log.run_id, redis_prefix)) <= 24 * 3600  # ended: retention
    _, fields = redis_client.xrange(stream_key(logs[0].run_id, redis_prefix))[-1]
    assert fields[b"event_type"] == b"tether.v1.RunCompleted" and json.loads(fields[b"payload"])["answer"] == "42"
    for tenant in ("tenant-a", "tenant-b", "tenant-c"):
        assert redis_client.zcard(tenant_index_key(tenant, redis_prefix)) == 0  # every run ended

    # -- redelivery: the whole log again from offset 0 changes nothing ---------------------------
    projector.stop()
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    reset = ConsumerGroupTopicPartitions(group, [TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
    admin.alter_consumer_group_offsets([reset])[group].result(timeout=30)
    assert not group_caught_up(kafka_bootstrap, group, topics.run_events)
    projector.restart(timeout=90)
    wait_for("the log re-read", lambda: group_caught_up(kafka_bootstrap, group, topics.run_events),
             service=projector)
    wait_for("duplicates counted",
             lambda: metric(port, "tether_projector_events_total", 'outcome="duplicate"') == sum(expected.values()),
             service=projector)
    assert metric(port, "tether_projector_events_total", 'outcome="applied"') == 0
    assert dump(pg_dsn, schema) == first
    for log in logs:
        assert redis_client.xlen(stream_key(log.run_id, redis_prefix)) == len(log.events)
    projector.stop()

    # -- rebuild from offset 0 into another schema: identical tables ------------------------------
    rebuilt = f"{schema}_rebuilt"
    done = subprocess.run(
        [sys.executable, "-m", "tether_projector", "rebuild", "--schema", rebuilt, "--batch", "50"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["applied"] == sum(expected.values()) and report["duplicates"] == 0
    assert report["chain_problems"] == 0 and report["undecodable"] == 0
    assert dump(pg_dsn, rebuilt) == first


@pytest.mark.integration
def test_offsets_are_committed_only_after_the_read_model_committed(
    kafka_bootstrap: str, isolation: tuple[str, str]
) -> None:
    prefix, _ = isolation
    topics = Topics(prefix)
    log = happy_run(f"run-{uuid.uuid4().hex[:6]}")
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"test-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for env in log.events:
        producer.produce(topics.run_events, encode(env), env.run_id.encode(),
                         partition=partition_for(env.tenant_id, env.run_id, PARTITIONS), headers=headers_for(env))
    producer.commit_transaction(30)

    read_model = InMemoryReadModel()
    read_model.fail_next = 1_000_000  # PostgreSQL "down" for the whole first run
    deps = Deps(read_model, InMemoryLiveState(), ProjectorMetrics(CollectorRegistry()))
    processor = ProjectorProcessor(deps, topics.run_events, read_model_attempts=2)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, transactional=False, handler_errors="fail",
                        session_timeout_ms=6000)
    with pytest.raises(ReadModelUnavailable):
        ProcessorLoop(processor, config).run(threading.Event())
    group = topics.group_id("projector")
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    try:
        assert all(tp.offset < 0 for tp in c.committed(
            [TopicPartition(topics.run_events, p) for p in range(PARTITIONS)], timeout=10))
    finally:
        c.close()
    assert read_model.rows("events") == []

    read_model.fail_next = 0  # back up: the restarted loop re-reads the batch and commits after it
    stop = threading.Event()
    loop = ProcessorLoop(processor, config)
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    try:
        wait_for("the run projected", lambda: bool(read_model.rows("runs"))
                 and read_model.rows("runs")[0]["last_seq"] == len(log.events))
        wait_for("offsets committed", lambda: group_caught_up(kafka_bootstrap, group, topics.run_events))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert len(read_model.rows("events")) == len(log.events)
