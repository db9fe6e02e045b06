"""Undecodable and unprocessable records go to the dead-letter topic and the loop keeps going."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tether_contracts.records import Remaining, StepGranted
from tether_messaging import loop as loop_mod
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.errors import Unprocessable
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics
from tether_runtime.logging import log_redactor

PARTITIONS = 3
POISON_STEP = 99
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Echo:
    """Emits each input's step to the run event topic; refuses step 99."""

    state_codec = None

    def __init__(self, topics: Topics) -> None:
        self.name = "echo"
        self.inputs = [topics.commands]
        self.output = topics.run_events

    def handle(self, msg: Inbound, ctx: Context) -> None:
        if msg.payload.step == POISON_STEP:
            ctx.emit(self.output, msg.payload, run_id="must-not-appear", tenant_id="t", event_id="x")
            raise Unprocessable("STEP_REFUSED", "step 99 is poison for this test")
        ctx.emit(self.output, msg.payload, run_id=msg.envelope.run_id, tenant_id=msg.envelope.tenant_id,
                 event_id=f"out:{msg.envelope.event_id}", causation_id=msg.envelope.event_id)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def on_tick(self, ctx: TickContext) -> None:
        pass


def _valid(step: int) -> bytes:
    env = make_envelope(StepGranted(step=step, remaining=REMAINING), run_id="run-1", tenant_id="t",
                        event_id=f"in:{step}", producer="test", recorded_at_ms=0)
    return encode(env)


def _read_all(bootstrap: str, topic: str, expect: int, timeout_s: float = 60) -> list:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}.reader",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expect and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or (msg.error() and not msg.error().fatal()):
                continue
            out.append(msg)
        # Anything beyond the expected count would be a bug: give it a moment to show up.
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                out.append(msg)
    finally:
        consumer.close()
    return out


@pytest.mark.integration
@pytest.mark.parametrize("transactional", [True, False], ids=["exactly-once", "at-least-once"])
def test_bad_records_are_dead_lettered_with_reasons_and_later_records_still_flow(
    kafka_bootstrap: str, topic_prefix: str, transactional: bool
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["echo"], prefix=topic_prefix)
    unknown_fp = b"\xc3\x01" + b"\x01\x02\x03\x04\x05\x06\x07\x08" + b"\x02\x04"
    inner_unknown = make_envelope(StepGranted(step=5, remaining=REMAINING), run_id="run-1", tenant_id="t",
                                  event_id="in:inner", producer="test", recorded_at_ms=0)
    inner_unknown = inner_unknown.model_copy(update={"payload": unknown_fp})
    records = [
        _valid(1),
        # Garbage in neither framing: random bytes failed 1 time in 256, when the first was 0x00
        # (the schema registry's magic byte: UNKNOWN_SCHEMA_ID instead of CORRUPT_PAYLOAD).
        bytes(range(0xFF, 0xBF, -1)),
        _valid(2),
        unknown_fp,  # a valid single-object header, but no schema has this fingerprint
        _valid(3),
        _valid(POISON_STEP),  # decodes, the handler refuses it
        encode(inner_unknown),  # the envelope decodes, its payload does not
        _valid(4),
    ]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for value in records:
        producer.produce(topics.commands, value, b"run-1", partition=1, headers=[("origin", b"test")])
    assert producer.flush(30) == 0

    loop = ProcessorLoop(Echo(topics), LoopConfig(bootstrap=kafka_bootstrap, topics=topics,
                                                  transactional=transactional, batch_max_ms=20))
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # surfaced below
            failure.append(exc)

    dead_before = loop_mod.DEAD_LETTERS.labels("echo", "STEP_REFUSED")._value.get()
    thread = threading.Thread(target=run)
    thread.start()
    try:
        outputs = _read_all(kafka_bootstrap, topics.run_events, expect=4)
        dead = _read_all(kafka_bootstrap, topics.dead_letters, expect=4)
    finally:
        stop.set()
        thread.join(60)
    assert not failure, failure
    assert not thread.is_alive()
    assert loop.ready

    assert [open_payload(decode_envelope(m.value())).step for m in outputs] == [1, 2, 3, 4]
    assert {m.partition() for m in outputs} == {1}

    by_offset = {int(dict(m.headers())["tether-dlq-offset"]): m for m in dead}
    assert sorted(by_offset) == [1, 3, 5, 6]
    reasons = {o: dict(m.headers())["tether-dlq-reason"].decode() for o, m in by_offset.items()}
    assert reasons == {1: "CORRUPT_PAYLOAD", 3: "UNKNOWN_FINGERPRINT", 5: "STEP_REFUSED", 6: "UNKNOWN_FINGERPRINT"}
    for offset, m in by_offset.items():
        headers = dict(m.headers())
        assert m.value() == records[offset]  # the original bytes, for an operator to replay
        assert m.key() == b"run-1" and m.partition() == 1
        assert headers["tether-dlq-topic"].decode() == topics.commands
        assert headers["tether-dlq-partition"] == b"1"
        assert headers["tether-dlq-service"] == b"echo"
        assert headers["origin"] == b"test"  # the original headers are kept
        assert headers["tether-dlq-detail"]
    # Counted once committed, like the topic above: an unrelated abort and replay does not count it twice.
    assert loop_mod.DEAD_LETTERS.labels("echo", "STEP_REFUSED")._value.get() == dead_before + 1

    # Every input is committed: a restart would not see any of them again.
    check = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id("echo")})
    committed = check.committed([TopicPartition(topics.commands, 1)], timeout=10)
    check.close()
    assert committed[0].offset == len(records)


class Leaky:
    """Raises on every input with a message that quotes a credential, as a failing client library may."""

    state_codec = None

    def __init__(self, topics: Topics, secret: str, token: str) -> None:
        self.name = "leaky"
        self.inputs = [topics.commands]
        self.secret = secret
        self.token = token

    def handle(self, msg: Inbound, ctx: Context) -> None:
        raise RuntimeError(f"upstream refused key={self.secret!r} (also tried {self.token}) for step {msg.payload.step}")

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def on_tick(self, ctx: TickContext) -> None:
        pass


@pytest.mark.integration
def test_a_handler_error_quoting_a_secret_is_dead_lettered_with_the_secret_redacted(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["leaky"], prefix=topic_prefix)
    secret = f"Dlq-Canary/{uuid.uuid4().hex[:12]}"
    token = "ghp_" + "a1B2c3D4e5" * 3 + "a1B2c3"  # secret-shaped, never registered
    assert log_redactor().add_secret(secret)  # as the gateway's SecretRegistry does when it resolves one
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topics.commands, _valid(7), b"run-1", partition=0)
    assert producer.flush(30) == 0

    loop = ProcessorLoop(Leaky(topics, secret, token),
                         LoopConfig(bootstrap=kafka_bootstrap, topics=topics, batch_max_ms=20))
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # surfaced below
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        dead = _read_all(kafka_bootstrap, topics.dead_letters, expect=1)
    finally:
        stop.set()
        thread.join(60)
    assert not failure, failure
    assert len(dead) == 1
    headers = dict(dead[0].headers())
    assert headers["tether-dlq-reason"] == b"HANDLER_ERROR"
    detail = headers["tether-dlq-detail"].decode()
    assert secret not in detail and secret.split("/")[1] not in detail and token not in detail
    assert detail == ("RuntimeError: upstream refused key='[REDACTED:secret]' "
                      "(also tried [REDACTED:github_token]) for step 7")
