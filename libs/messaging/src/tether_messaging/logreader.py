"""Read a topic to its end as an auditor does: every partition from its start, read_committed, decoded by the loop's codec.

`tether audit verify` and the chaos invariant checker read the run event log this way. Values
are decoded by the same `registry.envelope_codec` the processor loops use, so a log written in
single-object encoding, in the Confluent wire format (TETHER_SCHEMA_REGISTRY_URL set), or in
both (a deployment that switched formats) reads the same.

A partition whose first records were deleted (retention, `delete_records`, a lost segment) is
read from its log start offset, and `read_log` says where each partition started: the reader
never skips to the end, and the loss is reported, not hidden.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from tether_contracts.records import Envelope
from tether_messaging.registry import RegistryCodec, SchemaRegistryUnavailable, envelope_codec
from tether_messaging.serde import EnvelopeCodec, SerdeError, UnknownSchemaId


class LogReadError(Exception):
    """The log could not be read to its end (broker unreachable, no such topic, a record that does not decode)."""


@dataclass(frozen=True)
class LogRecord:
    """One committed record of the log and where it sits."""

    partition: int
    offset: int
    envelope: Envelope


@dataclass(frozen=True)
class LogRead:
    """The committed records of a topic, and the offset each partition's log started at when read."""

    topic: str
    records: list[LogRecord]
    #: partition → its log start offset (low watermark); above 0 when records were deleted.
    log_start: dict[int, int]

    @property
    def deleted(self) -> dict[int, int]:
        """Partitions whose first records are gone: partition → the first offset still in the log."""
        return {p: start for p, start in self.log_start.items() if start > 0}


def read_to_end(
    bootstrap: str,
    topic: str,
    *,
    schema_registry_url: str | None = None,
    codec: EnvelopeCodec | None = None,
    timeout_s: float = 120.0,
    group_prefix: str = "tether-log-reader",
) -> list[LogRecord]:
    """Every committed record of `topic`, each partition in order, up to the end it had when reading began.

    The records of `read_log`; use that to learn whether a partition's first records were deleted.
    """
    return read_log(bootstrap, topic, schema_registry_url=schema_registry_url, codec=codec,
                    timeout_s=timeout_s, group_prefix=group_prefix).records


def read_log(
    bootstrap: str,
    topic: str,
    *,
    schema_registry_url: str | None = None,
    codec: EnvelopeCodec | None = None,
    timeout_s: float = 120.0,
    group_prefix: str = "tether-log-reader",
) -> LogRead:
    """Every committed record of `topic`, each partition from its log start offset, up to the end it had
    when reading began, and each partition's log start offset (`LogRead.deleted`: where records are gone).

    Confluent-framed values need `schema_registry_url` (the writer schemas are in the registry);
    single-object values decode either way. `codec` overrides the URL (tests). Raises
    LogReadError naming the partition and offset of a record that does not decode.
    """
    owned_codec = codec is None
    codec = codec or envelope_codec(schema_registry_url)
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        # Never committed: the partitions are assigned, not subscribed.
        "group.id": f"{group_prefix}-{uuid.uuid4().hex}",
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        # Where the log starts, never its end: librdkafka's default (latest) would turn an offset
        # whose records were deleted (during the read, too) into a silent skip of the partition.
        "auto.offset.reset": "earliest",
    })
    try:
        try:
            meta = consumer.list_topics(topic, timeout=30)
        except KafkaException as err:
            raise LogReadError(f"cannot reach Kafka at {bootstrap}: {err}") from err
        topic_meta = meta.topics.get(topic)
        if topic_meta is None or topic_meta.error is not None or not topic_meta.partitions:
            raise LogReadError(f"topic {topic} does not exist at {bootstrap}")
        partitions = sorted(topic_meta.partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        # With read_committed the high watermark bounds the last stable offset: read until every
        # partition reports EOF at or past it. The low watermark is the log start offset.
        marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30) for p in partitions}
        starts = {p: low for p, (low, _) in marks.items()}
        ends = {p: high for p, (_, high) in marks.items()}
        done = {p for p in partitions if ends[p] <= starts[p]}
        out: list[LogRecord] = []
        deadline = time.monotonic() + timeout_s
        while len(done) < len(partitions):
            if time.monotonic() > deadline:
                raise LogReadError(f"{topic} was not read to its end {ends} within {timeout_s:.0f}s")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    if msg.offset() >= ends[msg.partition()]:
                        done.add(msg.partition())
                    continue
                raise LogReadError(msg.error().str())
            try:
                envelope = codec.decode_value(msg.value() or b"")
            except (SerdeError, SchemaRegistryUnavailable) as err:
                hint = (" (the log is in the registry's wire format: give the schema registry URL)"
                        if isinstance(err, UnknownSchemaId) and owned_codec and not schema_registry_url else "")
                raise LogReadError(f"{topic}[{msg.partition()}]@{msg.offset()} does not decode: {err}{hint}") from err
            out.append(LogRecord(msg.partition(), msg.offset(), envelope))
            if msg.offset() + 1 >= ends[msg.partition()]:
                done.add(msg.partition())
        return LogRead(topic, out, starts)
    finally:
        consumer.close()
        if owned_codec and isinstance(codec, RegistryCodec):
            codec.client.close()
