"""`tick_after_backlog`: after an assignment a partition ticks only once the input that was there is handled,
and a partition whose committed offset stops at a transaction marker is not held back for good; a running
loop behind its input reads through (`TickContext.inputs_read_through_ms`) only times by which it has handled
what was appended, also behind an open transaction (real broker)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Producer
from pydantic import BaseModel

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, PydanticStateCodec, TickContext
from tether_messaging.serde import encode
from tether_messaging.topics import Topics

PARTITIONS = 2
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Seen(BaseModel):
    count: int = 0


class CountsThenTicks:
    """Counts the records it handles per partition; notes what each partition had handled when it first ticked."""

    state_codec = PydanticStateCodec(Seen)

    def __init__(self, topics: Topics, *, wait: bool = True) -> None:
        self.name = "backlog"
        self.inputs = [topics.commands]
        if wait:
            self.tick_after_backlog = frozenset(self.inputs)
        self.handled: Counter[int] = Counter()
        self.first_tick: dict[int, int] = {}

    def handle(self, msg: Inbound, ctx: Context) -> None:
        self.handled[msg.partition] += 1
        ctx.put_state("counter", Seen(count=self.handled[msg.partition]))  # a change: the batch commits

    def on_work_done(self, done, ctx: Context) -> None:  # pragma: no cover - no work here
        raise AssertionError("no work")

    def on_tick(self, ctx: TickContext) -> None:
        for p in ctx.owned_partitions():
            self.first_tick.setdefault(p, self.handled[p])


def produce(bootstrap: str, topic: str, partition: int, steps: range, *, transactional_id: str | None = None) -> None:
    conf = {"bootstrap.servers": bootstrap}
    if transactional_id:
        conf["transactional.id"] = transactional_id
    producer = Producer(conf)
    if transactional_id:
        producer.init_transactions(30)
    for n in steps:
        env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"run-{n}", tenant_id="t",
                            event_id=f"in:{n}", producer="test", recorded_at_ms=0)
        if transactional_id:
            producer.begin_transaction()
        producer.produce(topic, encode(env), env.run_id.encode(), partition=partition)
        if transactional_id:
            producer.commit_transaction(30)
    assert producer.flush(30) == 0


def run_until(loop: ProcessorLoop, done, what: str) -> None:
    """Run the loop until `done()` (or it fails), then stop it."""
    with running(loop) as errors:
        wait_for(what, lambda: done() or bool(errors))


@pytest.mark.integration
@pytest.mark.parametrize("wait", [True, False], ids=["tick_after_backlog", "without"])
def test_a_partition_ticks_only_after_its_backlog_at_assignment_is_handled(
    kafka_bootstrap: str, topic_prefix: str, wait: bool
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["backlog"], prefix=topic_prefix)
    # Partition 0: three transactions, handled and committed by a first life of the loop, whose committed
    # offset is therefore the last commit marker's (the consumer never returns a marker).
    produce(kafka_bootstrap, topics.commands, 0, range(3), transactional_id=f"{topic_prefix}writer")
    first = CountsThenTicks(topics, wait=wait)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, tick_interval_ms=1, batch_max_messages=3)
    run_until(ProcessorLoop(first, config), lambda: first.handled[0] == 3, "the first life handles partition 0")

    # Partition 1: a backlog written while the loop was down, more than a few batches of it.
    produce(kafka_bootstrap, topics.commands, 1, range(100, 120))
    second = CountsThenTicks(topics, wait=wait)
    run_until(ProcessorLoop(second, config), lambda: len(second.first_tick) == PARTITIONS and second.handled[1] == 20,
              "both partitions tick and the backlog is handled")

    assert second.handled[0] == 0  # nothing left on partition 0 but the marker
    if wait:
        assert second.first_tick == {0: 0, 1: 20}
    else:
        assert second.first_tick[1] < 20  # the tick ran with the backlog unread


class Clock:
    """The loop's clock (`ProcessorLoop(clock_ms=...)`): the test moves it."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


class NotesReadThrough:
    """Counts the records it handles per partition, slowly on partition 0, and held at a record of run
    `gate` until released; each tick notes, per partition, (read-through time, records handled then)."""

    state_codec = PydanticStateCodec(Seen)

    def __init__(self, topics: Topics) -> None:
        self.name = "readthrough"
        self.inputs = [topics.commands]
        self.tick_after_backlog = frozenset(self.inputs)
        self.handled: Counter[int] = Counter()
        self.seen: list[tuple[int, int, int]] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def handle(self, msg: Inbound, ctx: Context) -> None:
        if msg.envelope.run_id == "gate" and not self.release.is_set():
            self.holding.set()
            if not self.release.wait(60):
                raise RuntimeError("never released")
        if msg.partition == 0:
            time.sleep(0.02)  # a slow partition: ticks come between its records
        self.handled[msg.partition] += 1
        ctx.put_state("counter", Seen(count=self.handled[msg.partition]))

    def on_work_done(self, done, ctx: Context) -> None:  # pragma: no cover - no work here
        raise AssertionError("no work")

    def on_tick(self, ctx: TickContext) -> None:
        for p in ctx.owned_partitions():
            self.seen.append((p, ctx.inputs_read_through_ms(p), self.handled[p]))

    def ticks(self, partition: int, *, since: int = 0) -> list[tuple[int, int]]:
        """(read-through time, records handled) of each tick since the `since`-th note, for one partition."""
        return [(rt, n) for p, rt, n in list(self.seen)[since:] if p == partition]


@contextmanager
def running(loop: ProcessorLoop) -> Iterator[list[BaseException]]:
    """Run the loop on a thread; yields the errors it ended with so far (asserted empty at the end)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors


def wait_for(what: str, done: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.02)


def send(producer: Producer, topic: str, partition: int, run_id: str) -> None:
    env = make_envelope(StepGranted(step=1, remaining=REMAINING), run_id=run_id, tenant_id="t",
                        event_id=f"in:{run_id}", producer="test", recorded_at_ms=0)
    producer.produce(topic, encode(env), run_id.encode(), partition=partition)


T0 = 1_700_000_000_000


@pytest.mark.integration
def test_a_loop_behind_its_input_reads_through_only_times_by_which_it_handled_what_was_appended(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["readthrough"], prefix=topic_prefix)
    processor = NotesReadThrough(topics)
    clock = Clock(T0)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, tick_interval_ms=1, batch_max_messages=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    with running(ProcessorLoop(processor, config, clock_ms=clock)):
        wait_for("both partitions tick", lambda: processor.ticks(0) and processor.ticks(1))
        # Partition 0 falls behind: held at one record while ten more are appended and the clock moves on.
        send(producer, topics.commands, 0, "gate")
        assert producer.flush(30) == 0
        wait_for("the loop is held", processor.holding.is_set)
        for n in range(10):
            send(producer, topics.commands, 0, f"behind-{n}")
        assert producer.flush(30) == 0
        moved = T0 + 60_000
        clock.now_ms = moved
        processor.release.set()
        wait_for("partition 0 read through the new time", lambda: any(rt >= moved for rt, _ in processor.ticks(0)))

    # No tick saw partition 0 read through a time by which records it had not handled were appended.
    assert [n for rt, n in processor.ticks(0) if rt >= moved] and all(
        n == 11 for rt, n in processor.ticks(0) if rt >= moved)
    assert all(rt < moved for rt, n in processor.ticks(0) if n < 11)
    # Partition 1, idle, was read through the new time while partition 0 was still behind.
    behind_until = next(i for i, (p, rt, n) in enumerate(processor.seen) if p == 0 and n == 11)
    assert any(rt >= moved for rt, _ in processor.ticks(1)[:behind_until]), processor.seen


@pytest.mark.integration
@pytest.mark.parametrize("ending", ["commit", "abort"])
def test_a_record_appended_behind_an_open_transaction_is_waited_for(
    kafka_bootstrap: str, topic_prefix: str, ending: str
) -> None:
    # A record acknowledged behind another producer's open transaction is not readable (read_committed)
    # until that transaction ends. The last stable offset would leave it out of the read-through time; the
    # high watermark keeps it in, and the transaction's end (either way) lets the loop past it.
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["readthrough"], prefix=topic_prefix)
    processor = NotesReadThrough(topics)
    clock = Clock(T0)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, tick_interval_ms=1)
    plain = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    transactional = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{topic_prefix}open"})
    transactional.init_transactions(30)
    with running(ProcessorLoop(processor, config, clock_ms=clock)):
        wait_for("both partitions tick", lambda: processor.ticks(0) and processor.ticks(1))
        transactional.begin_transaction()
        send(transactional, topics.commands, 0, "in-transaction")
        transactional.flush(30)
        send(plain, topics.commands, 0, "acknowledged")
        assert plain.flush(30) == 0
        moved = T0 + 60_000
        clock.now_ms = moved
        since = len(processor.seen)
        # Partition 1 is read through the new time at once: marks are being taken after it.
        wait_for("partition 1 read through the new time",
                 lambda: sum(rt >= moved for rt, _ in processor.ticks(1, since=since)) >= 20)
        assert all(rt < moved for rt, _ in processor.ticks(0, since=since))
        assert processor.handled[0] == 0
        if ending == "commit":
            transactional.commit_transaction(30)
        else:
            transactional.abort_transaction(30)
        wait_for("partition 0 read through the new time",
                 lambda: any(rt >= moved for rt, _ in processor.ticks(0, since=since)))
    assert processor.handled[0] == (2 if ending == "commit" else 1)
    assert all(n == processor.handled[0] for rt, n in processor.ticks(0, since=since) if rt >= moved)
