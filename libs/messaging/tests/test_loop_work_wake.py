"""Finished work wakes the loop: its outcome is handled without waiting for new input or a tick."""

from __future__ import annotations

import dataclasses
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import REGISTRY

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import decode_envelope, encode
from tether_messaging.topics import Topics
from tether_testing.loops import LoopThread

REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)
#: Far longer than the test waits for the output: only a wake-up by the finished work delivers it in time.
QUIET_POLL_MS = 60_000


class SlowEcho:
    """Each input starts 200 ms of work; its outcome is emitted as the output."""

    state_codec = None

    def __init__(self, topics: Topics) -> None:
        self.name = "wake"
        self.inputs = [topics.commands]
        self.output = topics.run_events

    def handle(self, msg: Inbound, ctx: Context) -> None:
        env = msg.envelope

        def work() -> str:
            time.sleep(0.2)
            return env.event_id

        ctx.start_work(f"w:{env.event_id}", env.run_id, env.tenant_id, work)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        ctx.emit(self.output, StepGranted(step=1, remaining=REMAINING), run_id=done.run_id, tenant_id=done.tenant_id,
                 event_id=f"out:{done.result}", causation_id=done.result)

    def on_tick(self, ctx: TickContext) -> None:
        return


def _hop_counts(service: str) -> dict[str, float]:
    names = ("input_age", "handle", "commit", "work_start", "work_deliver")
    return {n: REGISTRY.get_sample_value(f"tether_loop_{n}_seconds_count", {"service": service}) or 0.0
            for n in names}


def _produce(producer: Producer, topic: str, n: int) -> None:
    env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"run-{n}", tenant_id="t",
                        event_id=f"in:{n}", producer="test", recorded_at_ms=0)
    producer.produce(topic, encode(env), env.run_id.encode(), partition=0)
    assert producer.flush(30) == 0


@pytest.mark.integration
def test_finished_work_is_delivered_while_the_loop_waits_in_a_long_poll(kafka_bootstrap: str,
                                                                        topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, 1, ["wake"], prefix=topic_prefix)
    loop = ProcessorLoop(SlowEcho(topics), LoopConfig(bootstrap=kafka_bootstrap, topics=topics,
                                                      tick_interval_ms=QUIET_POLL_MS))
    running = LoopThread(loop)
    counts_before = _hop_counts("wake")
    running.start()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topics.run_events, 0, 0)])
    outputs: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not loop.ready and not running.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.ready, running.errors
        # From now on an idle poll blocks for a minute (the assignment, which a blocking poll
        # would also sit on, is done); the loop reads its config at every wait.
        loop.config = dataclasses.replace(loop.config, idle_poll_ms=QUIET_POLL_MS)
        time.sleep(0.2)  # the loop is in its long poll now
        _produce(producer, topics.commands, 1)
        deadline = time.monotonic() + 15
        while not outputs and time.monotonic() < deadline:
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                outputs.append(decode_envelope(msg.value()).causation_id)
    finally:
        running.stop_event.set()
        _produce(producer, topics.commands, 2)  # ends the loop's long poll, so it sees `stop`
        running.stop()
        reader.close()
    assert not running.errors, running.errors
    assert not running.is_alive()
    assert outputs == ["in:1"], "the finished work waited for the loop's next input or tick"
    # The hop's time was recorded piece by piece (docs/loop.md, "Latency of a hop"): the input's
    # age when taken, the handling and commit of both batches, the work's wait for a worker
    # and the wait for its delivery (the second input, which ends the long poll, may add its own).
    counts = {k: v - counts_before[k] for k, v in _hop_counts("wake").items()}
    assert counts["input_age"] >= 1 and counts["work_start"] >= 1 and counts["work_deliver"] >= 1, counts
    assert counts["handle"] >= 2 and counts["commit"] >= 2, counts
