"""Zombie fencing: a second instance in the same transactional slot makes the first one exit."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import FatalLoopError, LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import decode_envelope, encode
from tether_messaging.topics import Topics

PARTITIONS = 4


class Forward:
    state_codec = None

    def __init__(self, topics: Topics) -> None:
        self.name = "forward"
        self.inputs = [topics.commands]
        self.output = topics.run_events

    def handle(self, msg: Inbound, ctx: Context) -> None:
        ctx.emit(self.output, msg.payload, run_id=msg.envelope.run_id, tenant_id="t",
                 event_id=f"out:{msg.envelope.event_id}", causation_id=msg.envelope.event_id)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def on_tick(self, ctx: TickContext) -> None:
        pass


class Runner:
    def __init__(self, loop: ProcessorLoop) -> None:
        self.loop = loop
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run(self.stop)
        except BaseException as exc:  # inspected by the test
            self.error = exc

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.loop.ready:
            if self.error or time.monotonic() > deadline:
                pytest.fail(f"loop not ready: {self.error!r}")
            time.sleep(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


@pytest.mark.integration
def test_the_older_instance_of_a_slot_is_fenced_and_exits_with_a_fatal_error(kafka_bootstrap: str, topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["forward"], prefix=topic_prefix)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, instance_id=0, session_timeout_ms=6000)
    first = Runner(ProcessorLoop(Forward(topics), config))
    second = None
    try:
        first.wait_ready()
        second = Runner(ProcessorLoop(Forward(topics), config))  # same slot: a zombie's successor
        second.wait_ready()

        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        remaining = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)
        expected = []
        for i in range(40):
            env = make_envelope(StepGranted(step=i, remaining=remaining), run_id=f"run-{i}", tenant_id="t",
                                event_id=f"in:{i}", producer="test", recorded_at_ms=0)
            producer.produce(topics.commands, encode(env), env.run_id.encode(), partition=i % PARTITIONS)
            expected.append(f"in:{i}")
        assert producer.flush(30) == 0

        first.thread.join(90)
        assert not first.thread.is_alive(), "the fenced instance kept running"
        assert isinstance(first.error, FatalLoopError), first.error

        reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                           "isolation.level": "read_committed", "enable.auto.commit": False})
        reader.assign([TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
        seen: list[str] = []
        deadline = time.monotonic() + 90
        while len(seen) < len(expected) and time.monotonic() < deadline:
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                seen.append(decode_envelope(msg.value()).causation_id)
        end = time.monotonic() + 1
        while time.monotonic() < end:
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                seen.append(decode_envelope(msg.value()).causation_id)
        reader.close()
        assert sorted(seen) == sorted(expected), "the surviving instance must emit every output exactly once"
        assert second.error is None
    finally:
        first.close()
        if second is not None:
            second.close()
