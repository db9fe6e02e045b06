"""Measures the projector on the real stack: live path (shared loop, at-least-once) and rebuild.

Run: .venv/bin/python services/projector/bench/throughput.py [--events 10000]

Produces generated runs (sealed, transactional, like the budget) to a unique topic prefix, then
times (1) `ProcessorLoop` + `ProjectorProcessor` until every run's last_seq is in PostgreSQL,
(2) the same log re-read from offset 0 (all duplicates), (3) `rebuild` into another schema.
Prints events/second for each. Cleans up its topics, schemas and Redis keys.
"""

from __future__ import annotations

import argparse
import random
import signal
import threading
import time
import uuid

import psycopg
import redis
from confluent_kafka import ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry

from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import headers_for
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import encode
from tether_messaging.topics import Topics
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.adapters.redis_live import RedisLiveState
from tether_projector.entrypoint import ProjectorProcessor
from tether_projector.handlers import Deps
from tether_projector.metrics import ProjectorMetrics
from tether_projector.rebuild import rebuild
from tether_projector.testing import random_run

BOOTSTRAP = "127.0.0.1:9092"
DSN = "postgresql://tether@127.0.0.1:5432/tether"
REDIS = "redis://127.0.0.1:6379/0"
PARTITIONS = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=10_000)
    args = ap.parse_args()

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt  # a `timeout` still runs the cleanup below

    signal.signal(signal.SIGTERM, interrupted)
    prefix = f"bench-projector-{uuid.uuid4().hex[:8]}."
    schema = f"bench_rm_{uuid.uuid4().hex[:8]}"
    redis_prefix = f"{prefix}"
    topics = Topics(prefix)
    client = redis.Redis.from_url(REDIS)
    declare_topics(BOOTSTRAP, PARTITIONS, ["projector"], prefix=prefix)
    try:
        rng = random.Random(1)
        logs, total = [], 0
        while total < args.events:
            log = random_run(f"bench-{len(logs)}", rng, tenant_id=f"t{len(logs) % 7}")
            logs.append(log)
            total += len(log.events)
        expected = {log.run_id: len(log.events) for log in logs}
        producer = Producer({"bootstrap.servers": BOOTSTRAP, "transactional.id": f"bench-{uuid.uuid4().hex}",
                             "linger.ms": 5})
        producer.init_transactions(30)
        producer.begin_transaction()
        for i, env in enumerate(e for log in logs for e in log.events):
            producer.produce(topics.run_events, encode(env), env.run_id.encode(),
                             partition=partition_for(env.tenant_id, env.run_id, PARTITIONS), headers=headers_for(env))
            if i % 500 == 499:
                producer.commit_transaction(30)
                producer.begin_transaction()
        producer.commit_transaction(30)
        print(f"produced {total} events of {len(logs)} runs")

        registry = CollectorRegistry()
        deps = Deps(PostgresReadModel(DSN, schema), RedisLiveState(client, prefix=redis_prefix), ProjectorMetrics(registry))
        deps.read_model.ensure_schema()
        processor = ProjectorProcessor(deps, topics.run_events)
        config = LoopConfig(bootstrap=BOOTSTRAP, topics=topics, transactional=False, handler_errors="fail")

        def run_until(check) -> float:
            stop = threading.Event()
            loop = ProcessorLoop(processor, config)
            thread = threading.Thread(target=loop.run, args=(stop,))
            started = time.monotonic()
            thread.start()
            while not check():
                time.sleep(0.2)
            elapsed = time.monotonic() - started
            stop.set()
            thread.join()
            return elapsed

        def done() -> bool:
            with psycopg.connect(DSN) as conn:
                return dict(conn.execute(f'SELECT run_id, last_seq FROM "{schema}".runs').fetchall()) == expected

        live = run_until(done)
        print(f"live path (shared loop at-least-once: one PG transaction + one Redis pipeline per loop batch): {live:.1f}s,"
              f" {total / live:.0f} events/s (includes group join)")
        group = topics.group_id("projector")
        admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
        reset = ConsumerGroupTopicPartitions(group, [TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
        admin.alter_consumer_group_offsets([reset])[group].result(timeout=30)
        before = registry.get_sample_value("tether_projector_events_total", {"outcome": "duplicate"}) or 0

        def replayed() -> bool:
            now = registry.get_sample_value("tether_projector_events_total", {"outcome": "duplicate"}) or 0
            return now - before >= total

        again = run_until(replayed)
        print(f"redelivery from offset 0 (all duplicates): {again:.1f}s, {total / again:.0f} events/s")
        started = time.monotonic()
        report = rebuild(bootstrap=BOOTSTRAP, topic=topics.run_events, dsn=DSN, target_schema=f"{schema}_rb",
                         group_id=f"{group}.rebuild", metrics=ProjectorMetrics(CollectorRegistry()), batch_size=2000)
        took = time.monotonic() - started
        print(f"rebuild (batches of 2000, no Redis): {took:.1f}s, {total / took:.0f} events/s; {report}")
    finally:
        with psycopg.connect(DSN, autocommit=True) as conn:
            for s in (schema, f"{schema}_rb", f"{schema}_rb__rebuild"):
                conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
        keys = list(client.scan_iter(match=f"{redis_prefix}*", count=1000))
        if keys:
            client.delete(*keys)
        admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
        mine = [t for t in admin.list_topics(timeout=30).topics if t.startswith(prefix)]
        for fut in admin.delete_topics(mine).values():
            fut.result()


if __name__ == "__main__":
    main()
