"""With a registry URL configured, the loop writes the Confluent wire format and reads both formats."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.registry import RegistryCodec, SchemaRegistryClient, value_subject
from tether_messaging.serde import SingleObjectCodec, UnknownSchemaId, decode_envelope, open_payload
from tether_messaging.topics import Topics
from tether_testing.loops import LoopThread

REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Echo:
    """Emits one StepGranted(step + 100) per input."""

    state_codec = None

    def __init__(self, topics: Topics) -> None:
        self.name = "echo"
        self.inputs = [topics.commands]
        self.output = topics.run_events

    def handle(self, msg: Inbound, ctx: Context) -> None:
        ctx.emit(self.output, StepGranted(step=msg.payload.step + 100, remaining=REMAINING),
                 run_id=msg.envelope.run_id, tenant_id=msg.envelope.tenant_id, event_id=f"out:{msg.envelope.run_id}")

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def on_tick(self, ctx: TickContext) -> None:
        pass


@pytest.mark.integration
def test_loop_uses_the_registry_wire_format_when_configured(kafka_bootstrap, topic_prefix, schema_registry):
    url, state = schema_registry
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, 1, ["echo"], prefix=topic_prefix)
    registry_codec = RegistryCodec(SchemaRegistryClient(url))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for n, codec in ((1, SingleObjectCodec()), (2, registry_codec)):  # inputs in either format
        env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"run-{n}", tenant_id="t",
                            event_id=f"in:{n}", producer="test", recorded_at_ms=0)
        producer.produce(topics.commands, codec.encode_value(env, topics.commands), env.run_id.encode(), partition=0)
    assert producer.flush(30) == 0

    loop = ProcessorLoop(Echo(topics), LoopConfig(bootstrap=kafka_bootstrap, topics=topics, schema_registry_url=url))
    running = LoopThread(loop)
    running.start()
    raw: list[bytes] = []
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topics.run_events, 0, 0)])
    try:
        deadline = time.monotonic() + 90
        while len(raw) < 2 and time.monotonic() < deadline and not running.errors:
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                raw.append(msg.value())
    finally:
        running.stop()
        reader.close()
    assert not running.errors, running.errors
    assert len(raw) == 2, "the loop did not echo both inputs"
    registered = state.subjects[value_subject(topics.run_events)]
    for value in raw:
        assert value[0] == 0 and int.from_bytes(value[1:5], "big") in registered  # Confluent framing
        with pytest.raises(UnknownSchemaId):
            decode_envelope(value)  # Confluent framing, and no registry to read it with
    steps = sorted(open_payload(registry_codec.decode_value(v)).step for v in raw)
    assert steps == [101, 102]
