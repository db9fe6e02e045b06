"""Reading a log to its end decodes single-object and Confluent-framed records alike (the stand-in registry)."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.envelopes import make_envelope
from tether_messaging.logreader import LogReadError, read_to_end
from tether_messaging.registry import RegistryCodec, SchemaRegistryClient
from tether_messaging.serde import SingleObjectCodec, open_payload

REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


@pytest.mark.integration
def test_a_log_that_switched_to_the_registry_format_reads_whole_and_in_order(kafka_bootstrap, kafka_topics,
                                                                            schema_registry):
    url, _ = schema_registry
    topic = kafka_topics.create("logreader", partitions=2)
    registry_codec = RegistryCodec(SchemaRegistryClient(url))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    # Steps 1-2 written before the deployment set TETHER_SCHEMA_REGISTRY_URL, 3-4 after; two runs, two partitions.
    for step, codec in ((1, SingleObjectCodec()), (2, SingleObjectCodec()), (3, registry_codec), (4, registry_codec)):
        for partition, run_id in enumerate(("run-a", "run-b")):
            env = make_envelope(StepGranted(step=step, remaining=REMAINING), run_id=run_id, tenant_id="t",
                                event_id=f"{run_id}:{step}", producer="test", recorded_at_ms=step)
            producer.produce(topic, codec.encode_value(env, topic), run_id.encode(), partition=partition)
    assert producer.flush(30) == 0

    records = read_to_end(kafka_bootstrap, topic, schema_registry_url=url, timeout_s=60)
    by_run = {run: [open_payload(r.envelope).step for r in records if r.envelope.run_id == run]
              for run in ("run-a", "run-b")}
    assert by_run == {"run-a": [1, 2, 3, 4], "run-b": [1, 2, 3, 4]}
    assert [(r.partition, r.offset) for r in records if r.partition == 1] == [(1, 0), (1, 1), (1, 2), (1, 3)]

    # Without the registry the first framed record stops the read, saying where and what to give.
    with pytest.raises(LogReadError, match=r"\]@2 does not decode: UNKNOWN_SCHEMA_ID.*schema registry URL"):
        read_to_end(kafka_bootstrap, topic, timeout_s=60)


@pytest.mark.integration
def test_a_missing_topic_is_a_log_read_error(kafka_bootstrap, topic_prefix):
    with pytest.raises(LogReadError, match="does not exist"):
        read_to_end(kafka_bootstrap, f"{topic_prefix}absent", timeout_s=10)
