"""`tick_after_backlog`: after an assignment a partition ticks only once the input that was there is handled,
and a partition whose committed offset stops at a transaction marker is not held back for good (real broker)."""

from __future__ import annotations

import threading
import time
from collections import Counter

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
        deadline = time.monotonic() + 60
        while not done() and not errors:
            if time.monotonic() > deadline:
                pytest.fail(f"not within 60 s: {what}")
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors


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
