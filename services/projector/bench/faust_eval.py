"""Measures whether faust-streaming 0.15.3 meets the projector's needs (see docs/projector.md).

Run: .venv/bin/python services/projector/bench/faust_eval.py [--events 10000] [--guarantee at_least_once]

It declares a unique topic, produces N committed records plus one ABORTED transaction, runs a
faust worker with a raw-bytes agent until it has seen N committed records (or times out), then
reports: did it start and consume, did it deliver aborted records (read_committed?), elapsed
time, and the group's committed offsets afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

BOOTSTRAP = "127.0.0.1:9092"
PARTITIONS = 6


def declare(topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        f.result()


def produce(topic: str, n: int) -> None:
    p = Producer({"bootstrap.servers": BOOTSTRAP, "transactional.id": f"eval-{uuid.uuid4()}", "linger.ms": 5})
    p.init_transactions()
    batch = 500
    for start in range(0, n, batch):
        p.begin_transaction()
        for i in range(start, min(start + batch, n)):
            p.produce(topic, key=f"run-{i % 50}".encode(), value=b"COMMITTED:%d" % i, partition=i % PARTITIONS)
        p.commit_transaction()
    # One aborted transaction: a read_committed consumer must never see these.
    p.begin_transaction()
    for i in range(100):
        p.produce(topic, key=b"run-x", value=b"ABORTED:%d" % i, partition=i % PARTITIONS)
    p.flush()
    p.abort_transaction()
    # A committed tail after the aborted records, so a consumer must read past them.
    p.begin_transaction()
    for i in range(PARTITIONS):
        p.produce(topic, key=b"run-tail", value=b"COMMITTED:tail%d" % i, partition=i)
    p.commit_transaction()


def committed(group: str, topic: str) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": group})
    tps = c.committed([TopicPartition(topic, i) for i in range(PARTITIONS)], timeout=10)
    c.close()
    return {tp.partition: tp.offset for tp in tps}


def confluent_eval(n: int) -> int:
    """The same measurement with a plain confluent-kafka read_committed consumer."""
    topic = f"eval-ck-{uuid.uuid4().hex[:8]}"
    group = f"eval-ck-{uuid.uuid4().hex[:8]}"
    declare(topic)
    produce(topic, n)
    expected = n + PARTITIONS
    c = Consumer({
        "bootstrap.servers": BOOTSTRAP, "group.id": group, "isolation.level": "read_committed",
        "enable.auto.commit": False, "auto.offset.reset": "earliest",
    })
    c.subscribe([topic])
    seen = aborted = 0
    t_start = time.monotonic()
    first = last = None
    while seen < expected and time.monotonic() - t_start < 120:
        msgs = c.consume(500, 1.0)
        for m in msgs:
            if m.error():
                continue
            first = first or time.monotonic()
            if m.value().startswith(b"ABORTED"):
                aborted += 1
            else:
                seen += 1
        if msgs:
            c.commit(asynchronous=False)
            last = time.monotonic()
    c.close()
    print("engine=confluent-kafka read_committed")
    print(f"committed records seen: {seen} / {expected}; ABORTED delivered: {aborted}")
    if first and last:
        print(f"start-to-first-record: {first - t_start:.1f}s; consume time: {last - first:.2f}s;"
              f" rate: {seen / max(last - first, 1e-9):.0f} rec/s")
    print("group committed offsets:", committed(group, topic))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--guarantee", default="at_least_once", choices=["at_least_once", "exactly_once"])
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--engine", default="faust", choices=["faust", "confluent"])
    args = ap.parse_args()
    if args.engine == "confluent":
        return confluent_eval(args.events)

    import faust  # imported here: faust patches the event loop policy on import

    topic = f"eval-faust-{uuid.uuid4().hex[:8]}"
    app_id = f"eval-faust-{uuid.uuid4().hex[:8]}"
    declare(topic)
    t0 = time.monotonic()
    produce(topic, args.events)
    print(f"produced {args.events} committed + 100 aborted + {PARTITIONS} tail in {time.monotonic() - t0:.1f}s", flush=True)

    expected = args.events + PARTITIONS
    app = faust.App(
        app_id,
        broker=f"kafka://{BOOTSTRAP}",
        value_serializer="raw",
        key_serializer="raw",
        processing_guarantee=args.guarantee,
        topic_allow_declare=False,  # the projector's input topic is declared elsewhere
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        web_enabled=False,
        datadir=tempfile.mkdtemp(prefix="eval-faust-"),  # not the caller's cwd (the repo root)
        broker_commit_every=500,
        broker_commit_interval=0.5,
    )
    src = app.topic(topic, value_type=bytes, key_type=bytes, partitions=PARTITIONS)
    stats = {"committed": 0, "aborted": 0, "first": None, "last": None}

    @app.agent(src)
    async def count(stream):  # type: ignore[no-untyped-def]
        async for value in stream:
            now = time.monotonic()
            if stats["first"] is None:
                stats["first"] = now
            if value.startswith(b"ABORTED"):
                stats["aborted"] += 1
            else:
                stats["committed"] += 1
            stats["last"] = now

    @app.timer(1.0)
    async def watchdog() -> None:
        # Stop from outside the agent (stopping inside it waits on its own unacked record);
        # wait a few commit intervals after the last record so its offset is committed.
        done = stats["committed"] >= expected and time.monotonic() - stats["last"] > 3.0
        if done or time.monotonic() - t0 > args.timeout:
            if not done:
                print("TIMEOUT", stats, flush=True)
            report()
            await app.stop()
            asyncio.get_event_loop().call_later(0.5, asyncio.get_event_loop().stop)

    def report() -> None:
        first = stats["first"]
        last = stats["last"]
        print(f"guarantee={args.guarantee}")
        print(f"committed records seen: {stats['committed']} / {expected}")
        print(f"ABORTED records delivered: {stats['aborted']} (read_committed would deliver 0)")
        if first is not None and last is not None:
            print(f"start-to-first-record: {first - t_start:.1f}s; consume time: {last - first:.2f}s;"
                  f" rate: {stats['committed'] / max(last - first, 1e-9):.0f} rec/s")
        print("group committed offsets:", committed(app_id, topic), flush=True)

    t_start = time.monotonic()
    worker = faust.Worker(app, loglevel="WARNING", quiet=True)
    try:
        worker.execute_from_commandline()
    except SystemExit:
        pass
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
