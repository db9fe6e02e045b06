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
        self.emit_on_grant = False
        self.out_topic = topics.run_intake

    def handle(self, msg: Inbound, ctx: Context) -> None:
        self.handled.append(msg.envelope.event_id)
        if self.emit_on_grant and isinstance(msg.payload, StepGranted) and msg.payload.step > 0:
            # An effect: the batch must commit. A grant of step 0 is handled without one.
            ctx.emit(self.out_topic, msg.payload, run_id=msg.envelope.run_id, tenant_id=msg.envelope.tenant_id,
                     event_id=f"out-{msg.envelope.event_id}")

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


def _deferred() -> float:
    return REGISTRY.get_sample_value("tether_loop_batches_total", {"service": "filter", "outcome": "deferred"}) or 0.0


def _wait(what: str, cond, errors: list, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert not errors, errors
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.integration
def test_a_batch_that_changes_nothing_commits_nothing_and_its_offsets_follow(kafka_bootstrap: str,
                                                                             topic_prefix: str) -> None:
    """`noop_commit_ms`: a batch of passed-over records, or of records handled without an effect, sends no
    transaction; its offsets go with the next commit (or one at most that long after the last), and a
    restart before that meets the records again and changes nothing again."""
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, 1, ["filter"], prefix=topic_prefix)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    tp = TopicPartition(topics.commands, 0)
    group = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id("filter")})
    n = 0

    def send(*payloads) -> None:
        nonlocal n
        for payload in payloads:
            env = make_envelope(payload, run_id="r", tenant_id="t", event_id=f"e{n}", producer="test",
                                recorded_at_ms=0)
            producer.produce(topics.commands, encode(env), b"r", partition=0, headers=headers_for(env))
            n += 1
        assert producer.flush(30) == 0

    def committed() -> int:
        return group.committed([tp], timeout=10)[0].offset

    def start(interval_ms: int):
        processor = GrantsOnly(topics)
        processor.emit_on_grant = True
        loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics,
                                                   noop_commit_ms=interval_ms))
        stop, errors = threading.Event(), []
        thread = threading.Thread(target=lambda: _run(loop, stop, errors), daemon=True)
        thread.start()
        return processor, stop, errors, thread

    rejected = RunRejected(request_id="q", reason_code="NO", detail="x")
    try:
        # A long interval: only a commit of something handled carries the passed-over offsets.
        processor, stop, errors, thread = start(600_000)
        send(StepGranted(step=1, remaining=REMAINING))
        _wait("the grant's commit", lambda: committed() == 1, errors)
        passed, deferred = _passed_over(topics.commands), _deferred()
        send(rejected, StepGranted(step=0, remaining=REMAINING), rejected)  # passed over, no effect, passed over
        _wait("the three taken", lambda: _passed_over(topics.commands) - passed == 2 and len(processor.handled) == 2,
              errors)
        _wait("their batches to end", lambda: _deferred() > deferred, errors)
        assert committed() == 1  # no transaction: nothing committed for them
        send(StepGranted(step=2, remaining=REMAINING))
        _wait("the next commit", lambda: committed() == 5, errors)  # it carries the deferred offsets
        assert processor.handled == ["e0", "e2", "e4"]
        # Passed over, then the process ends before any commit: the next one passes them over again.
        passed = _passed_over(topics.commands)
        send(rejected, rejected)
        _wait("two more passed over", lambda: _passed_over(topics.commands) - passed == 2, errors)
        stop.set()
        thread.join(60)
        assert not errors, errors
        assert committed() == 5
        # A short interval: the offsets follow within it even with nothing else to commit.
        passed = _passed_over(topics.commands)
        processor, stop, errors, thread = start(500)
        _wait("the replayed two passed over", lambda: _passed_over(topics.commands) - passed == 2, errors)
        _wait("their offsets committed", lambda: committed() == 7, errors)
        assert processor.handled == []  # replayed, passed over, nothing handled twice
    finally:
        stop.set()
        thread.join(60)
        group.close()
    assert not errors, errors
