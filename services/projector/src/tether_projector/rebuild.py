"""Rebuilding the read model by replaying the run event log from offset 0.

The log is read with manual assignment of every partition from the beginning (read_committed,
no consumer group offsets used or committed) into a staging schema `<target>__rebuild`, in
large transactions; when every partition has reached its end, the staging schema replaces the
target schema in one transaction, so readers switch from the old tables to the new ones at once.

Records are decoded as the live projector decodes them (either wire format; the registry's needs
its URL). A record the live projector would dead-letter (corrupt, an unknown schema) is skipped and
counted; a log that cannot be decoded at all — framed records and no registry URL, or the registry
unreachable — fails the rebuild before anything replaces the target, so a misconfigured rebuild
can never swap an empty read model in for a full one.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import structlog
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from tether_messaging.registry import RegistryCodec, SchemaRegistryUnavailable, envelope_codec
from tether_messaging.serde import SerdeError, UnknownSchemaId, open_payload
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.handlers import Deps, project_batch
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LiveState, LogEvent

log = structlog.get_logger("tether_projector.rebuild")

#: Lowercase, short enough that "<name>__rebuild" fits PostgreSQL's 63-character identifiers.
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,50}$")


class RebuildFailed(Exception):
    """The rebuild could not read the log to its end; the target schema was left untouched."""


@dataclass(frozen=True)
class RebuildReport:
    """What a rebuild read and wrote."""

    schema: str
    records: int
    applied: int
    duplicates: int
    undecodable: int
    unsealed: int
    chain_problems: int
    seconds: float


def rebuild(
    *,
    bootstrap: str,
    topic: str,
    dsn: str,
    target_schema: str,
    group_id: str,
    metrics: ProjectorMetrics,
    live: LiveState | None = None,
    schema_registry_url: str | None = None,
    batch_size: int = 2_000,
    timeout_s: float = 3_600.0,
) -> RebuildReport:
    """Replay `topic` from offset 0 into a fresh read model that replaces `target_schema`.

    Stop the live projector first when `target_schema` is the schema it writes (or rebuild into a
    new schema and point readers at it). `live` also republishes Redis state (off by default:
    the live projector owns it, and its writes are idempotent anyway).
    """
    if not SCHEMA_NAME.match(target_schema):
        raise RebuildFailed(f"schema name {target_schema!r} must match {SCHEMA_NAME.pattern}")
    started = time.monotonic()
    codec = envelope_codec(schema_registry_url)
    staging = PostgresReadModel(dsn, f"{target_schema}__rebuild", lock_runs=False)
    staging.drop_schema()
    staging.ensure_schema()
    deps = Deps(read_model=staging, live=live, metrics=metrics)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            # Never subscribes or commits: the id only names the client in broker logs.
            "group.id": group_id,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    records = applied = duplicates = undecodable = unsealed = problems = 0
    try:
        metadata = consumer.list_topics(topic, timeout=30)
        described = metadata.topics.get(topic)
        if described is None or described.error is not None or not described.partitions:
            raise RebuildFailed(f"topic {topic!r} not found: {described.error if described else 'no metadata'}")
        partitions = sorted(described.partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        pending = set(partitions)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RebuildFailed(f"partitions {sorted(pending)} of {topic} not read to their end in {timeout_s}s")
            events: list[LogEvent] = []
            for msg in consumer.consume(batch_size, 1.0):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                        continue
                    if err.fatal():
                        raise RebuildFailed(f"consumer: {err.str()}")
                    log.warning("consume_error", error=err.str())
                    continue
                records += 1
                try:
                    envelope = codec.decode_value(msg.value() or b"")
                    events.append(LogEvent(envelope, open_payload(envelope)))
                except SchemaRegistryUnavailable as exc:
                    # Not a bad record: skipping would drop good events from the new read model.
                    raise RebuildFailed(f"{topic}[{msg.partition()}]@{msg.offset()}: schema registry "
                                        f"unavailable: {exc}") from exc
                except UnknownSchemaId as exc:
                    if not schema_registry_url:
                        # The log is in the registry's wire format: every such record would be
                        # skipped and the rebuilt read model would miss them all.
                        raise RebuildFailed(f"{topic}[{msg.partition()}]@{msg.offset()} is in the schema "
                                            "registry's wire format: set TETHER_SCHEMA_REGISTRY_URL") from exc
                    undecodable += 1
                    log.warning("undecodable_record", reason=exc.reason, partition=msg.partition(), offset=msg.offset())
                except SerdeError as exc:
                    # The live projector dead-letters these; a rebuild skips them the same way.
                    undecodable += 1
                    log.warning("undecodable_record", reason=exc.reason, partition=msg.partition(), offset=msg.offset())
            if events:
                result = project_batch(events, deps=deps)
                applied += result.applied
                duplicates += result.duplicates
                unsealed += len(result.rejected)
                problems += len(result.chain_problems)
        staging.replace(target_schema)
    finally:
        consumer.close()
        staging.close()
        if isinstance(codec, RegistryCodec):
            codec.client.close()
    report = RebuildReport(
        schema=target_schema,
        records=records,
        applied=applied,
        duplicates=duplicates,
        undecodable=undecodable,
        unsealed=unsealed,
        chain_problems=problems,
        seconds=round(time.monotonic() - started, 3),
    )
    log.info("rebuild_done", **report.__dict__)
    return report
