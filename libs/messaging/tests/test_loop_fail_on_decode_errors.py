"""`LoopConfig.fail_on_decode_errors`: a record the consumer must not lose blocks its partition
instead of being dead-lettered. The record stays at the group's offset, the other partitions keep
flowing, and the process stays up: the blocked gauge and the partition's lag are exported, /readyz
says not ready (real broker, real health server)."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import REGISTRY

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import encode
from tether_messaging.topics import Topics
from tether_runtime.http import HealthServer

PARTITIONS = 3
BLOCKED_PARTITION = 1
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Recorder:
    """Keeps the steps it handled; produces nothing."""

    state_codec = None

    def __init__(self, topics: Topics) -> None:
        self.name = "recorder"
        self.inputs = [topics.commands]
        self.steps: list[int] = []

    def handle(self, msg: Inbound, ctx: Context) -> None:
        self.steps.append(msg.payload.step)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def on_tick(self, ctx: TickContext) -> None:
        pass


def _valid(step: int) -> bytes:
    env = make_envelope(StepGranted(step=step, remaining=REMAINING), run_id="run-1", tenant_id="t",
                        event_id=f"in:{step}", producer="test", recorded_at_ms=0)
    return encode(env)


def _newer(step: int) -> bytes:
    """A newer producer's payload: a valid single-object header, a fingerprint no bundled schema has."""
    env = make_envelope(StepGranted(step=step, remaining=REMAINING), run_id="run-1", tenant_id="t",
                        event_id=f"in:{step}", producer="test", recorded_at_ms=0)
    return encode(env.model_copy(update={"payload": b"\xc3\x01" + b"\x01\x02\x03\x04\x05\x06\x07\x08" + b"\x04\x04"}))


def _gauge(name: str, topic: str) -> dict[tuple[str, ...], float]:
    """The series of one loop gauge for `topic`: (partition[, reason]) -> value."""
    return {
        tuple(v for k, v in sorted(s.labels.items()) if k in ("partition", "reason")): s.value
        for m in REGISTRY.collect() if m.name == name
        for s in m.samples if s.labels.get("topic") == topic and s.labels.get("service") == "recorder"
    }


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.integration
@pytest.mark.parametrize("transactional", [True, False], ids=["exactly-once", "at-least-once"])
def test_an_unknown_fingerprint_blocks_its_partition_unconsumed_while_the_loop_stays_up_and_says_so(
    kafka_bootstrap: str, topic_prefix: str, transactional: bool
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["recorder"], prefix=topic_prefix)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def append(partition: int, *values: bytes) -> None:
        for value in values:
            producer.produce(topics.commands, value, b"run-1", partition=partition)
        assert producer.flush(30) == 0

    # Offsets on the blocked partition: 0 readable, 1 of a newer schema, 2 readable behind it.
    append(BLOCKED_PARTITION, _valid(1), _newer(2), _valid(3))
    append(0, _valid(10))
    append(2, _valid(20))

    processor = Recorder(topics)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, transactional=transactional, batch_max_ms=20,
                        session_timeout_ms=6000, tick_interval_ms=200,
                        fail_on_decode_errors=frozenset({"UNKNOWN_FINGERPRINT"}))
    loop = ProcessorLoop(processor, config)
    health = HealthServer(ready=lambda: loop.ready)
    port = health.start()
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # asserted below
            failure.append(exc)

    def wait(what: str, cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 120
        while not cond() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cond(), (what, failure, processor.steps)

    blocked_series = {(str(BLOCKED_PARTITION), "UNKNOWN_FINGERPRINT"): 1.0}
    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait("the partition blocked", lambda: _gauge("tether_loop_blocked", topics.commands) == blocked_series)
        # More input on both sides of the block: the other partitions keep flowing, the blocked one's
        # lag grows (high watermark 4, position 1: the record and the two behind it).
        append(0, _valid(11))
        append(BLOCKED_PARTITION, _valid(4))
        wait("the other partitions handled", lambda: {1, 10, 11, 20} <= set(processor.steps))
        wait("the blocked partition's lag",
             lambda: _gauge("tether_loop_lag_records", topics.commands).get((str(BLOCKED_PARTITION),)) == 3)

        assert thread.is_alive() and not failure, failure
        assert not {2, 3, 4} & set(processor.steps)  # nothing at or behind the record was handled
        assert _gauge("tether_loop_blocked", topics.commands) == blocked_series
        # The process serves its metrics and says it is not ready while a partition is blocked.
        status, body = _get(port, "/readyz")
        assert status == 503, body
        status, body = _get(port, "/metrics")
        assert status == 200 and "tether_loop_blocked{" in body and topics.commands in body

        # Nothing dead-lettered, and the group's offset is the record's own (1): the records before it
        # are committed, the record is not, so a build that can read it starts there.
        reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id("recorder")})
        try:
            for p in range(PARTITIONS):
                assert reader.get_watermark_offsets(TopicPartition(topics.dead_letters, p), timeout=10)[1] == 0

            def committed() -> int:
                [tp] = reader.committed([TopicPartition(topics.commands, BLOCKED_PARTITION)], timeout=10)
                return tp.offset

            wait("the offsets before the record committed", lambda: committed() == 1)
        finally:
            reader.close()
    finally:
        stop.set()
        thread.join(60)
        health.stop()
    assert not thread.is_alive() and not failure, failure
    assert not {2, 3, 4} & set(processor.steps)
    assert _gauge("tether_loop_blocked", topics.commands) == {}  # a stopped loop blocks nothing


@pytest.mark.integration
def test_a_blocked_partition_moved_by_a_rebalance_is_blocked_by_its_new_owner_and_forgotten_by_the_old(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["recorder"], prefix=topic_prefix)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for value in (_valid(1), _newer(2), _valid(3)):
        producer.produce(topics.commands, value, b"run-1", partition=BLOCKED_PARTITION)
    assert producer.flush(30) == 0

    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, batch_max_ms=20, session_timeout_ms=6000,
                        tick_interval_ms=200, fail_on_decode_errors=frozenset({"UNKNOWN_FINGERPRINT"}))
    first = ProcessorLoop(Recorder(topics), config)
    second = ProcessorLoop(Recorder(topics), dataclasses.replace(config, instance_id=1))  # its own slot
    stop = threading.Event()
    failure: list[BaseException] = []

    def run(loop: ProcessorLoop) -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # asserted below
            failure.append(exc)

    def holders() -> list[ProcessorLoop]:
        return [loop for loop in (first, second) if (topics.commands, BLOCKED_PARTITION) in loop._blocked]

    def wait(what: str, cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 120
        while not cond() and not failure and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cond(), (what, failure)

    blocked_series = {(str(BLOCKED_PARTITION), "UNKNOWN_FINGERPRINT"): 1.0}
    threads = [threading.Thread(target=run, args=(first,))]
    threads[0].start()
    try:
        wait("blocked by the first member", lambda: holders() == [first])
        threads.append(threading.Thread(target=run, args=(second,)))
        threads[1].start()
        # Eager rebalance: every partition is revoked and reassigned. Whichever member gets the partition
        # now (the first again, or the second) fetches it from the committed offset, meets the record
        # and blocks; the other exports nothing for it.
        # (The first member's revoke, which forgets its block, comes before any assignment to the second.)
        wait("the second member assigned", lambda: bool(second._owned))
        wait("blocked by its owner after the rebalance", lambda: len(holders()) == 1
             and BLOCKED_PARTITION in holders()[0]._owned and len(first._owned) + len(second._owned) == PARTITIONS)
        assert not failure, failure
        assert _gauge("tether_loop_blocked", topics.commands) == blocked_series
        assert all(3 not in loop.processor.steps and 2 not in loop.processor.steps for loop in (first, second))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not failure, failure
