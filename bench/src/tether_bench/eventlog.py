"""Read a run event log as an auditor would: every partition from offset 0, read_committed, up to its end."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, KafkaError, TopicPartition

from tether_contracts.records import Envelope
from tether_messaging.serde import decode_envelope


class LogReadError(Exception):
    """The log could not be read to its end (broker unreachable, a decode failure); says which."""


def read_log(bootstrap: str, topic: str, partitions: int, *, timeout_s: float = 300.0
             ) -> list[tuple[int, int, Envelope]]:
    """(partition, offset, envelope) of every committed record of `topic`, in each partition's order."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"chaos-auditor-{uuid.uuid4().hex}",
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
    })
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        # With read_committed the high watermark the broker reports is the last stable offset's
        # upper bound: read until every partition reports EOF at or past it.
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)}
        out: list[tuple[int, int, Envelope]] = []
        done = {p for p, end in ends.items() if end == 0}
        deadline = time.monotonic() + timeout_s
        while len(done) < partitions:
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
            out.append((msg.partition(), msg.offset(), decode_envelope(msg.value())))
            if msg.offset() + 1 >= ends[msg.partition()]:
                done.add(msg.partition())
        return out
    finally:
        consumer.close()
