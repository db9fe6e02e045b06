"""`event_types`: the loop passes over, undecoded, the records of types a processor does not act on."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import REGISTRY

from tether_contracts.records import Remaining, RunRejected, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import headers_for, make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import encode
from tether_messaging.topics import Topics

REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class GrantsOnly:
    name = "filter"
    state_codec = None

    def __init__(self, topics: Topics) -> None:
        self.inputs = [topics.commands]
        self.event_types = {topics.commands: frozenset({StepGranted.AVRO_NAME})}
        self.handled: list[str] = []

    def handle(self, msg: Inbound, ctx: Context) -> None:
        self.handled.append(msg.envelope.event_id)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work")

    def on_tick(self, ctx: TickContext) -> None:
        return


def _passed_over(topic: str) -> float:
    return REGISTRY.get_sample_value("tether_loop_records_total",
                                     {"service": "filter", "topic": topic, "outcome": "passed_over"}) or 0.0


@pytest.mark.integration
def test_records_of_other_types_are_passed_over_by_their_header(kafka_bootstrap: str, topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, 1, ["filter"], prefix=topic_prefix)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    sent = []
    for n, payload in enumerate([StepGranted(step=1, remaining=REMAINING), RunRejected(request_id="q", reason_code="NO", detail="x"),
                                 StepGranted(step=2, remaining=REMAINING), RunRejected(request_id="q", reason_code="NO", detail="y")]):
        env = make_envelope(payload, run_id="r", tenant_id="t", event_id=f"e{n}", producer="test", recorded_at_ms=0)
        producer.produce(topics.commands, encode(env), b"r", partition=0, headers=headers_for(env))
        sent.append(env)
    # A writer that sets no type header: decoded and handled whatever its type.
    bare = make_envelope(RunRejected(request_id="q", reason_code="NO", detail="z"), run_id="r", tenant_id="t", event_id="bare",
                         producer="test", recorded_at_ms=0)
    producer.produce(topics.commands, encode(bare), b"r", partition=0)
    # Passed over by the header, never decoded: a value that is not an envelope at all.
    producer.produce(topics.commands, b"\x00not an envelope", b"r", partition=0,
                     headers=[("tether-event-type", RunRejected.AVRO_NAME.encode())])
    assert producer.flush(30) == 0

    processor = GrantsOnly(topics)
    before = _passed_over(topics.commands)
    loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics))
    stop = threading.Event()
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run(loop, stop, errors), daemon=True)
    thread.start()
    group = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id("filter")})
    try:
        deadline = time.monotonic() + 60
        committed = -1
        while committed < 6 and time.monotonic() < deadline and not errors:
            time.sleep(0.2)
            committed = group.committed([TopicPartition(topics.commands, 0)], timeout=10)[0].offset
    finally:
        stop.set()
        thread.join(60)
        group.close()
    assert not errors, errors
    assert processor.handled == ["e0", "e2", "bare"]
    assert committed == 6  # passed-over records count as handled: nothing replays them
    assert _passed_over(topics.commands) - before == 3
    dead = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}dlq"})
    low, high = dead.get_watermark_offsets(TopicPartition(topics.dead_letters, 0), timeout=10)
    dead.close()
    assert high == low, "a passed-over record was dead-lettered"


def _run(loop: ProcessorLoop, stop: threading.Event, errors: list) -> None:
    try:
        loop.run(stop)
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)
