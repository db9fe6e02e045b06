"""`LoopConfig.fail_on_decode_errors`: a record the consumer must not lose stops the loop instead of
being dead-lettered, and stays at the group's offset to be read again (real broker)."""

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
from tether_messaging.serde import encode
from tether_messaging.topics import Topics

PARTITIONS = 3
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


@pytest.mark.integration
@pytest.mark.parametrize("transactional", [True, False], ids=["exactly-once", "at-least-once"])
def test_an_unknown_fingerprint_stops_the_loop_and_stays_unconsumed_when_asked(
    kafka_bootstrap: str, topic_prefix: str, transactional: bool
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["recorder"], prefix=topic_prefix)
    # A payload of a newer producer: a valid single-object header, a fingerprint no bundled schema has.
    newer = make_envelope(StepGranted(step=2, remaining=REMAINING), run_id="run-1", tenant_id="t",
                          event_id="in:2", producer="test", recorded_at_ms=0)
    newer = newer.model_copy(update={"payload": b"\xc3\x01" + b"\x01\x02\x03\x04\x05\x06\x07\x08" + b"\x04\x04"})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for value in (_valid(1), encode(newer), _valid(3)):
        producer.produce(topics.commands, value, b"run-1", partition=1)
    assert producer.flush(30) == 0

    processor = Recorder(topics)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, transactional=transactional, batch_max_ms=20,
                        session_timeout_ms=6000, fail_on_decode_errors=frozenset({"UNKNOWN_FINGERPRINT"}))
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            ProcessorLoop(processor, config).run(stop)
        except BaseException as exc:  # asserted below
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while thread.is_alive() and 3 not in processor.steps and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()  # if it went on past the record (the dead-letter default)
    thread.join(60)
    assert failure and isinstance(failure[0], FatalLoopError), (failure, processor.steps)
    assert "UNKNOWN_FINGERPRINT" in str(failure[0])
    assert 3 not in processor.steps  # nothing after it was handled

    # Nothing dead-lettered, and the group's offset is not past the record (offset 1): a restart
    # after the upgrade reads it again.
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id("recorder")})
    try:
        for p in range(PARTITIONS):
            _low, high = reader.get_watermark_offsets(TopicPartition(topics.dead_letters, p), timeout=10)
            assert high == 0
        [committed] = reader.committed([TopicPartition(topics.commands, 1)], timeout=10)
        assert committed.offset <= 1
    finally:
        reader.close()
