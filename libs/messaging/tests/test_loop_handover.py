"""A rebalance hands running work over: its outcome is committed before the partitions move, not redone.

`make chaos` found the bug this covers: a restarted planner slot's join rebalanced the group, the
other slot dropped a model call in flight with its revoked partition, and the partition's new
owner asked the model again (duplicate_model_calls 1). With `revoke_drain_ms` 0 the loop gives
running work up at once, which is that old behaviour: the same test then sees the work done twice.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics

_spec = importlib.util.spec_from_file_location("eos_processor", Path(__file__).resolve().parent / "eos_processor.py")
eos_processor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eos_processor)

PARTITIONS = 4
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)
#: Input 7 of each run starts work (eos_processor.WORK_EVERY). In the graceful-stop test it runs
#: this long, so the stop comes mid-way; in the join test it runs until the first member's revoke
#: (hand-over: until a second after the revoke began, so the revoke has to wait for it). A fixed
#: time was too short on a loaded machine: the second member's transactional init and join can
#: take longer than the work, and the work was then done before anything moved.
WORK_S = 6.0
INPUTS = 10


class CountingProcessor(eos_processor.EosProcessor):
    """The exactly-once checker, counting how often each piece of work actually runs."""

    def __init__(self, topics: Topics, calls: Counter, running: set, lock: threading.Lock,
                 release: threading.Event | None = None) -> None:
        super().__init__(topics, int(WORK_S * 1000))
        self.calls, self.running, self.lock, self.release = calls, running, lock, release

    def _start(self, ctx, run_id, state, n) -> None:  # noqa: ANN001 - the base class's signature
        key = f"{run_id}:{n}"

        def work() -> int:
            with self.lock:
                self.calls[key] += 1
                self.running.add(key)
            if self.release is None:
                time.sleep(WORK_S)
            else:
                assert self.release.wait(60), "the work was never released"
            with self.lock:
                self.running.discard(key)
            return n

        ctx.start_work(key, run_id, state.tenant_id, work)


def _produce(producer: Producer, topic: str, numbers: range) -> None:
    for n in numbers:
        for p in range(PARTITIONS):
            env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"p{p}", tenant_id="t",
                                event_id=f"in:p{p}:{n}", producer="test", recorded_at_ms=0)
            producer.produce(topic, encode(env), env.run_id.encode(), partition=p)
    assert producer.flush(30) == 0


def _start(loop: ProcessorLoop, stop: threading.Event, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _setup(kafka_bootstrap: str, topic_prefix: str) -> tuple[Topics, Counter, set, threading.Lock, list]:
    """The test's topics, and what its processors share: work calls per key, the keys running, their
    lock, and the errors the loops raised."""
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, [eos_processor.NAME], prefix=topic_prefix)
    return topics, Counter(), set(), threading.Lock(), []


def _reader(kafka_bootstrap: str, topic_prefix: str, topics: Topics) -> Consumer:
    """A read_committed reader of every partition of the outputs, from the start."""
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
    return reader


def _read_outputs(reader: Consumer, outputs: dict[str, list[int]], linger_s: float = 0.0) -> None:
    """Read outputs (run id → steps) until every run's INPUTS are in (90 s at most), then
    `linger_s` longer and whatever is still there."""

    def take(msg) -> None:  # noqa: ANN001
        if msg is not None and not msg.error():
            env = decode_envelope(msg.value())
            outputs[env.run_id].append(open_payload(env).step)

    deadline = time.monotonic() + 90
    while sum(map(len, outputs.values())) < PARTITIONS * INPUTS and time.monotonic() < deadline:
        take(reader.poll(0.2))
    if linger_s:
        time.sleep(linger_s)
        while (msg := reader.poll(0.2)) is not None:
            take(msg)


def _wait(condition, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.parametrize(("revoke_drain_ms", "handed_over"), [(30_000, True), (0, False)],
                         ids=["hand-over", "give-up-at-once"])
def test_a_member_joining_does_not_make_running_work_run_twice(kafka_bootstrap: str, topic_prefix: str,
                                                               revoke_drain_ms: int, handed_over: bool) -> None:
    topics, calls, running, lock, errors = _setup(kafka_bootstrap, topic_prefix)
    stop = threading.Event()
    release = threading.Event()  # the work runs until the first member's revoke

    def member(instance: int) -> ProcessorLoop:
        return ProcessorLoop(CountingProcessor(topics, calls, running, lock, release),
                             LoopConfig(bootstrap=kafka_bootstrap, topics=topics, instance_id=instance,
                                        revoke_drain_ms=revoke_drain_ms))

    first, second = member(0), member(1)
    revoke = first._on_revoke

    def on_revoke(consumer, partitions) -> None:  # noqa: ANN001 - librdkafka's callback
        # Handing over: the work finishes a second after the revoke began, so only a revoke that
        # waits for running work (revoke_drain_ms) can commit its outcome before the partitions
        # move. Giving up at once: only after the revoke, so nothing of it can be committed first.
        if handed_over:
            timer = threading.Timer(1.0, release.set)
            timer.daemon = True
            timer.start()
        revoke(consumer, partitions)
        release.set()

    first._on_revoke = on_revoke  # looked up when the loop subscribes
    threads = [_start(first, stop, errors)]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    reader = _reader(kafka_bootstrap, topic_prefix, topics)
    outputs: dict[str, list[int]] = defaultdict(list)
    try:
        _wait(lambda: first.ready or errors, 60, "the first member's assignment")
        _produce(producer, topics.commands, range(1, 8))
        # Every run's input 7 has started its work on the first member; now the second joins.
        _wait(lambda: len(running) == PARTITIONS or errors, 60, "the work to start")
        threads.append(_start(second, stop, errors))
        _wait(lambda: second.ready or errors, 60, "the second member's assignment")
        _produce(producer, topics.commands, range(8, INPUTS + 1))
        _read_outputs(reader, outputs, linger_s=1.0)  # a late duplicate output would show up in the linger
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        reader.close()
    assert not errors, errors
    # Exactly once whatever the hand-over did: that is the loop's replay contract.
    assert {run: steps for run, steps in outputs.items()} == {f"p{p}": list(range(1, INPUTS + 1))
                                                              for p in range(PARTITIONS)}
    moved = [f"p{p}:7" for p in range(PARTITIONS) if p not in first._owned]  # partitions the second took
    if handed_over:
        assert calls == Counter({f"p{p}:7": 1 for p in range(PARTITIONS)}), calls
    else:
        # The old behaviour: the work of every partition that moved ran again on its new owner
        # (again on a further rebalance, which giving up at once allows).
        assert moved and all(calls[key] >= 2 for key in moved), (moved, calls)


@pytest.mark.integration
def test_a_graceful_stop_hands_running_work_over(kafka_bootstrap: str, topic_prefix: str) -> None:
    """SIGTERM's path: stopping the loop closes the consumer, which revokes; the running work's
    outcome is committed before the process goes, so the next instance does not redo it."""
    topics, calls, running, lock, errors = _setup(kafka_bootstrap, topic_prefix)

    def member() -> ProcessorLoop:
        # The same slot twice (a restart), static so the close does not leave the group.
        return ProcessorLoop(CountingProcessor(topics, calls, running, lock),
                             LoopConfig(bootstrap=kafka_bootstrap, topics=topics, instance_id=0,
                                        static_membership=True, revoke_drain_ms=30_000))

    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    first_stop, second_stop = threading.Event(), threading.Event()
    first = member()
    thread = _start(first, first_stop, errors)
    _wait(lambda: first.ready or errors, 60, "the first life's assignment")
    _produce(producer, topics.commands, range(1, 8))
    _wait(lambda: len(running) == PARTITIONS or errors, 60, "the work to start")
    first_stop.set()  # what the SIGTERM handler does
    thread.join(60)
    assert not thread.is_alive() and not errors, errors
    assert not running, "the stop did not wait for the running work"

    second = member()
    thread = _start(second, second_stop, errors)
    reader = _reader(kafka_bootstrap, topic_prefix, topics)
    outputs: dict[str, list[int]] = defaultdict(list)
    try:
        _wait(lambda: second.ready or errors, 60, "the second life's assignment")
        _produce(producer, topics.commands, range(8, INPUTS + 1))
        _read_outputs(reader, outputs)
    finally:
        second_stop.set()
        thread.join(60)
        reader.close()
    assert not errors, errors
    assert dict(outputs) == {f"p{p}": list(range(1, INPUTS + 1)) for p in range(PARTITIONS)}
    assert calls == Counter({f"p{p}:7": 1 for p in range(PARTITIONS)}), calls
