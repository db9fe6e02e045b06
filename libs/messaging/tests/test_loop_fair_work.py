"""The loop's worker pool takes work in fair order across tenants: a flood of one tenant does not delay another."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Producer
from prometheus_client import REGISTRY

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import encode
from tether_messaging.topics import Topics
from tether_testing.loops import LoopThread

REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class RecordsWorkOrder:
    """Every input starts one work item; the items record the order they ran in.

    The first item blocks the only worker until every other item waits in the pool's queue
    (the loop's `tether_loop_work_waiting` gauge), so the order the queue hands them out is
    visible.
    """

    state_codec = None

    def __init__(self, topics: Topics, expected: int) -> None:
        self.name = "fairwork"
        self.inputs = [topics.commands]
        self.expected = expected
        self.handled = 0
        self.release = threading.Event()
        self.ran: list[str] = []
        self.done = threading.Event()
        self._lock = threading.Lock()

    def handle(self, msg: Inbound, ctx: Context) -> None:
        env = msg.envelope
        first = self.handled == 0
        self.handled += 1

        def work() -> None:
            if first:
                self._wait_until_all_queued()
            with self._lock:
                self.ran.append(env.tenant_id)
                if len(self.ran) == self.expected:
                    self.done.set()

        ctx.start_work(f"w:{env.run_id}", env.run_id, env.tenant_id, work)

    def _wait_until_all_queued(self) -> None:
        deadline = time.monotonic() + 60
        while not self.release.is_set() and time.monotonic() < deadline:
            if REGISTRY.get_sample_value("tether_loop_work_waiting", {"service": self.name}) == self.expected - 1:
                return
            time.sleep(0.01)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        return

    def on_tick(self, ctx: TickContext) -> None:
        return


def _produce(producer: Producer, topic: str, tenant: str, n: int) -> None:
    env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"{tenant}-{n}", tenant_id=tenant,
                        event_id=f"in:{tenant}:{n}", producer="test", recorded_at_ms=0)
    producer.produce(topic, encode(env), env.run_id.encode(), partition=0)


@pytest.mark.integration
def test_the_quiet_tenants_work_runs_after_at_most_one_more_of_the_flood(kafka_bootstrap: str,
                                                                          topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, 1, ["fairwork"], prefix=topic_prefix)
    flood = 60
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for n in range(flood):
        _produce(producer, topics.commands, "noisy", n)
    # The quiet tenant's single input comes last in the partition: with a FIFO pool it would run last.
    _produce(producer, topics.commands, "quiet", 0)
    assert producer.flush(30) == 0

    processor = RecordsWorkOrder(topics, flood + 1)
    loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics, work_threads=1,
                                               batch_max_messages=10))
    running = LoopThread(loop)
    running.start()
    try:
        deadline = time.monotonic() + 90
        while not processor.done.is_set() and time.monotonic() < deadline and not running.errors:
            processor.done.wait(0.2)
    finally:
        running.stop_event.set()
        processor.release.set()
        running.stop()
    assert not running.errors, running.errors
    assert processor.done.is_set(), f"only {len(processor.ran)} of {flood + 1} work items ran"
    # The first noisy item held the only worker until every other item waited (the inputs came
    # in batches of at most 10, so the quiet one was queued behind 59 noisy ones). Then the fair
    # queue served one more noisy item (the noisy tenant's turn had begun) and the quiet one.
    assert processor.ran.index("quiet") <= 2, processor.ran[:5]
    assert processor.ran.count("noisy") == flood
