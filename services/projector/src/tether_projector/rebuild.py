"""Rebuilding the read model by replaying the run event log from offset 0.

The log is read with manual assignment of every partition from the beginning (read_committed,
no consumer group offsets used or committed) into a staging schema `<target>__rebuild`, in
large transactions; when every partition has reached its end, the staging schema replaces the
target schema in one transaction, so readers switch from the old tables to the new ones at once.

Records are decoded as the live projector decodes them (either wire format; the registry's needs
its URL). A record the live projector would dead-letter (corrupt) is skipped and counted; one it
stops on (a schema this build does not know: `entrypoint.unknown_schema_reasons`), and a log that
cannot be decoded at all — framed records and no registry URL, or the registry unreachable —
fail the rebuild before anything replaces the target, so a misconfigured or outdated rebuild can
never swap a read model missing events in for a full one.

Rebuilding the schema the live projector writes is refused while the projector's consumer group
has members, checked before reading and again right before the swap: events it committed into the
old schema after the rebuild read its partitions' ends would be dropped with that schema while its
offsets are past them. A session advisory lock on the target, held for the whole rebuild, keeps a
second rebuild of it from running at the same time. The rebuild fails only when it makes no
progress for `idle_timeout_s`; a log of any length can be rebuilt.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
import structlog
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from tether_messaging.registry import RegistryCodec, SchemaRegistryUnavailable, envelope_codec
from tether_messaging.serde import SerdeError, UnknownSchemaId, open_payload
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.entrypoint import unknown_schema_reasons
from tether_projector.handlers import Deps, project_batch
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LiveState, LogEvent, ReadModelUnavailable

log = structlog.get_logger("tether_projector.rebuild")

#: Lowercase, short enough that "<name>__rebuild" fits PostgreSQL's 63-character identifiers.
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,50}$")

#: Advisory-lock class of rebuilds (pg_try_advisory_lock(int, hashtext(target))), apart from the
#: live projector's per-run class (adapters/postgres.py LOCK_CLASS).
REBUILD_LOCK_CLASS = 0x7E7F


class RebuildFailed(Exception):
    """The rebuild did not replace the target schema, which was left untouched.

    `reason` is a stable code: INVALID_SCHEMA_NAME, REBUILD_RUNNING (another rebuild holds the
    target), PROJECTOR_RUNNING (the live projector's group has members and writes the target),
    PROJECTOR_STATE_UNKNOWN (its group could not be described), TOPIC_NOT_FOUND, CONSUMER_ERROR,
    STALLED (nothing read for the idle timeout), SCHEMA_REGISTRY_UNAVAILABLE,
    REGISTRY_URL_REQUIRED, UNKNOWN_SCHEMA (a record this build cannot read: upgrade first).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _refuse_if_projector_runs(bootstrap: str, group: str, schema: str, when: str) -> None:
    """PROJECTOR_RUNNING if the live projector's consumer group has members (it writes `schema`)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        described = admin.describe_consumer_groups([group], request_timeout=30)[group].result(timeout=60)
    except KafkaException as exc:
        raise RebuildFailed("PROJECTOR_STATE_UNKNOWN", f"could not describe consumer group {group!r} {when}: "
                            f"{exc}; refusing to replace {schema!r}, which the projector may be writing") from exc
    if described.members:
        raise RebuildFailed(
            "PROJECTOR_RUNNING",
            f"consumer group {group!r} has {len(described.members)} member(s) ({described.state.name}) {when}: "
            f"the projector writes {schema!r}, and events it commits there would be lost with the old schema. "
            "Stop it (a static member leaves after its session timeout), or rebuild into another schema.",
        )


def _lock_target(dsn: str, schema: str) -> psycopg.Connection:
    """A session holding the target's rebuild lock until closed; REBUILD_RUNNING if another holds it."""
    try:
        conn = psycopg.connect(dsn, autocommit=True)
    except psycopg.OperationalError as exc:
        raise ReadModelUnavailable(f"{type(exc).__name__}: {exc}") from exc
    try:
        row = conn.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))", (REBUILD_LOCK_CLASS, schema)).fetchone()
    except psycopg.OperationalError as exc:
        conn.close()
        raise ReadModelUnavailable(f"{type(exc).__name__}: {exc}") from exc
    if not row or not row[0]:
        conn.close()
        raise RebuildFailed("REBUILD_RUNNING", f"another rebuild of {schema!r} is running (it holds the lock)")
    return conn


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
    idle_timeout_s: float = 300.0,
    projector_group: str | None = None,
    live_schema: str | None = None,
) -> RebuildReport:
    """Replay `topic` from offset 0 into a fresh read model that replaces `target_schema`.

    When `target_schema` is `live_schema`, the schema the live projector (consumer group
    `projector_group`) writes, the rebuild refuses to run while that group has members (stop the
    projector first, or rebuild into a new schema and point readers at it). `live` also
    republishes Redis state (off by default: the live projector owns it, and its writes are
    idempotent anyway). Fails STALLED after `idle_timeout_s` without reading anything.
    """
    if not SCHEMA_NAME.match(target_schema):
        raise RebuildFailed("INVALID_SCHEMA_NAME", f"schema name {target_schema!r} must match {SCHEMA_NAME.pattern}")
    guarded = projector_group is not None and target_schema == live_schema
    started = time.monotonic()
    lock = _lock_target(dsn, target_schema)
    try:
        if guarded:
            _refuse_if_projector_runs(bootstrap, projector_group or "", target_schema, "before the rebuild")
        report = _replay(bootstrap=bootstrap, topic=topic, dsn=dsn, target_schema=target_schema,
                         group_id=group_id, metrics=metrics, live=live, schema_registry_url=schema_registry_url,
                         batch_size=batch_size, idle_timeout_s=idle_timeout_s, started=started,
                         before_swap=(lambda: _refuse_if_projector_runs(
                             bootstrap, projector_group or "", target_schema, "at the swap")) if guarded else None)
    finally:
        lock.close()
    log.info("rebuild_done", **report.__dict__)
    return report


def _replay(
    *,
    bootstrap: str,
    topic: str,
    dsn: str,
    target_schema: str,
    group_id: str,
    metrics: ProjectorMetrics,
    live: LiveState | None,
    schema_registry_url: str | None,
    batch_size: int,
    idle_timeout_s: float,
    started: float,
    before_swap: Callable[[], None] | None,
) -> RebuildReport:
    codec = envelope_codec(schema_registry_url)
    stop_reasons = unknown_schema_reasons(schema_registry_url)
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
            raise RebuildFailed("TOPIC_NOT_FOUND",
                                f"topic {topic!r} not found: {described.error if described else 'no metadata'}")
        partitions = sorted(described.partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        pending = set(partitions)
        # An inactivity deadline, reset by every record (or partition end) read: a long log takes
        # as long as it takes; only a rebuild that stopped moving fails.
        last_progress = time.monotonic()
        while pending:
            if time.monotonic() - last_progress > idle_timeout_s:
                raise RebuildFailed("STALLED", f"nothing read from partitions {sorted(pending)} of {topic} "
                                               f"for {idle_timeout_s}s")
            events: list[LogEvent] = []
            msgs = consumer.consume(batch_size, 1.0)
            if msgs:
                last_progress = time.monotonic()
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                        continue
                    if err.fatal():
                        raise RebuildFailed("CONSUMER_ERROR", f"consumer: {err.str()}")
                    log.warning("consume_error", error=err.str())
                    continue
                records += 1
                try:
                    envelope = codec.decode_value(msg.value() or b"")
                    events.append(LogEvent(envelope, open_payload(envelope)))
                except SchemaRegistryUnavailable as exc:
                    # Not a bad record: skipping would drop good events from the new read model.
                    raise RebuildFailed("SCHEMA_REGISTRY_UNAVAILABLE", f"{topic}[{msg.partition()}]@{msg.offset()}: "
                                        f"schema registry unavailable: {exc}") from exc
                except UnknownSchemaId as exc:
                    if not schema_registry_url:
                        # The log is in the registry's wire format: every such record would be
                        # skipped and the rebuilt read model would miss them all.
                        raise RebuildFailed("REGISTRY_URL_REQUIRED", f"{topic}[{msg.partition()}]@{msg.offset()} is "
                                            "in the schema registry's wire format: set TETHER_SCHEMA_REGISTRY_URL"
                                            ) from exc
                    undecodable += 1
                    log.warning("undecodable_record", reason=exc.reason, partition=msg.partition(), offset=msg.offset())
                except SerdeError as exc:
                    if exc.reason in stop_reasons:
                        # The live projector stops on these too: a newer build reads them, and
                        # skipping would leave a false GAP in their runs.
                        raise RebuildFailed("UNKNOWN_SCHEMA", f"{topic}[{msg.partition()}]@{msg.offset()}: "
                                            f"{exc.reason}: {exc.detail}; upgrade the projector first") from exc
                    # The live projector dead-letters these; a rebuild skips them the same way.
                    undecodable += 1
                    log.warning("undecodable_record", reason=exc.reason, partition=msg.partition(), offset=msg.offset())
            if events:
                result = project_batch(events, deps=deps)
                applied += result.applied
                duplicates += result.duplicates
                unsealed += len(result.rejected)
                problems += len(result.chain_problems)
                last_progress = time.monotonic()
        if before_swap is not None:
            before_swap()
        staging.replace(target_schema)
    finally:
        consumer.close()
        staging.close()
        if isinstance(codec, RegistryCodec):
            codec.client.close()
    return RebuildReport(
        schema=target_schema,
        records=records,
        applied=applied,
        duplicates=duplicates,
        undecodable=undecodable,
        unsealed=unsealed,
        chain_problems=problems,
        seconds=round(time.monotonic() - started, 3),
    )
