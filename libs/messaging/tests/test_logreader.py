"""Reading a log to its end decodes single-object and Confluent-framed records alike (the stand-in registry)."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.chain import GENESIS_HASH, ProblemKind, seal, verify_chain
from tether_messaging.envelopes import make_envelope
from tether_messaging.logreader import LogReadError, read_log, read_to_end
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


@pytest.mark.integration
def test_a_partition_whose_first_records_were_deleted_is_read_from_its_start_and_the_loss_reported(
        kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("logreader-deleted", partitions=2)
    codec = SingleObjectCodec()
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for partition, run_id in enumerate(("run-a", "run-b")):
        prev = GENESIS_HASH
        for step in range(1, 11):
            env = make_envelope(StepGranted(step=step, remaining=REMAINING), run_id=run_id, tenant_id="t",
                                event_id=f"{run_id}:{step}", producer="test", recorded_at_ms=step)
            env = seal(env, step, prev)
            prev = env.hash
            producer.produce(topic, codec.encode_value(env, topic), run_id.encode(), partition=partition)
    assert producer.flush(30) == 0
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # run-a's first three events are gone (retention, delete_records, a lost segment).
    (fut,) = admin.delete_records([TopicPartition(topic, 0, 3)]).values()
    assert fut.result(30).low_watermark == 3

    read = read_log(kafka_bootstrap, topic, timeout_s=60)
    # Read from where the log starts now, not skipped to the end (librdkafka's default reset).
    assert [r.offset for r in read.records if r.partition == 0] == list(range(3, 10))
    assert [r.offset for r in read.records if r.partition == 1] == list(range(10))
    assert read.deleted == {0: 3} and read.log_start == {0: 3, 1: 0}
    def where(records):
        return sorted((r.partition, r.offset) for r in records)

    assert where(read_to_end(kafka_bootstrap, topic, timeout_s=60)) == where(read.records)
    problems = verify_chain(r.envelope for r in read.records)
    assert [(p.kind, p.run_id, p.detail) for p in problems] == [
        (ProblemKind.GAP, "run-a", "seq 1..3 missing before seq 4")]

    # Every record of the partition gone: nothing to read there, and still said.
    (fut,) = admin.delete_records([TopicPartition(topic, 0, 10)]).values()
    assert fut.result(30).low_watermark == 10
    read = read_log(kafka_bootstrap, topic, timeout_s=60)
    assert {r.partition for r in read.records} == {1} and read.deleted == {0: 10}
