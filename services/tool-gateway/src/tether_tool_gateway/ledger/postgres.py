"""The idempotency ledger in PostgreSQL: table `<schema>.tool_calls`, one row per idem_key.

Leases use the database clock (clock_timestamp()), so gateway instances never compare their
own clocks. Every operation runs in one transaction; a row being decided on is locked
(SELECT ... FOR UPDATE), and the sweep skips rows another sweep holds (SKIP LOCKED), so two
instances can never take over the same intent.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any

from psycopg import Connection, sql
from psycopg_pool import ConnectionPool

from tether_contracts.records import BlobRef
from tether_messaging.blobstore import check_schema_name
from tether_tool_gateway.ledger.port import (
    UNKNOWN_DETAIL,
    Busy,
    CallRecord,
    Claim,
    Completion,
    Execute,
    IdempotencyLedger,
    Intent,
    Owner,
    Resolution,
    ResolutionStatus,
    Resolved,
    TakeoverAction,
    check_same_intent,
    takeover_action,
)

_COLUMNS = (
    "idem_key, run_id, tenant_id, kafka_partition, step, call_id, tool_name, args_json, args_hash, "
    "tool_spec_json, idempotent, attempt, lease_owner, lease_boot, lease_token, status, result_json, "
    "result_ref_sha256, result_ref_size, result_ref_media_type, untrusted, duration_ms, error_code, "
    "detail, retryable, late_resolution, lease_expires_at <= clock_timestamp() AS lease_expired"
)

_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    idem_key text PRIMARY KEY,
    run_id text NOT NULL,
    tenant_id text NOT NULL,
    kafka_partition int NOT NULL,
    step int NOT NULL,
    call_id text NOT NULL,
    tool_name text NOT NULL,
    args_json text NOT NULL,
    args_hash text NOT NULL,
    tool_spec_json text NOT NULL,
    idempotent boolean NOT NULL,
    attempt int NOT NULL DEFAULT 1,
    lease_owner text,
    lease_boot text,
    lease_token text,
    lease_expires_at timestamptz,
    status text CHECK (status IN ('COMPLETED', 'FAILED', 'OUTCOME_UNKNOWN')),
    result_json text,
    result_ref_sha256 text,
    result_ref_size bigint,
    result_ref_media_type text,
    untrusted boolean NOT NULL DEFAULT false,
    duration_ms bigint NOT NULL DEFAULT 0,
    error_code text,
    detail text NOT NULL DEFAULT '',
    retryable boolean NOT NULL DEFAULT false,
    late_resolution jsonb,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    resolved_at timestamptz
)
"""


def resolution_to_json(r: Resolution) -> str:
    d = dataclasses.asdict(r)
    d["status"] = r.status.value
    d["result_ref"] = None if r.result_ref is None else r.result_ref.to_avro()
    return json.dumps(d, sort_keys=True)


def resolution_from_json(data: Any) -> Resolution:
    d = dict(json.loads(data) if isinstance(data, str) else data)
    d["status"] = ResolutionStatus(d["status"])
    d["result_ref"] = None if d.get("result_ref") is None else BlobRef.from_avro(d["result_ref"])
    return Resolution(**d)


def _record(row: tuple[Any, ...]) -> tuple[CallRecord, bool]:
    (idem_key, run_id, tenant_id, partition, step, call_id, tool_name, args_json, args_hash, tool_spec_json,
     idempotent, attempt, lease_owner, lease_boot, lease_token, status, result_json, ref_sha, ref_size,
     ref_media, untrusted, duration_ms, error_code, detail, retryable, late, expired) = row
    intent = Intent(idem_key, run_id, tenant_id, partition, step, call_id, tool_name, args_json, args_hash,
                    tool_spec_json, idempotent)
    resolution = None
    if status is not None:
        ref = None if ref_sha is None else BlobRef(sha256=ref_sha, size=ref_size, media_type=ref_media)
        resolution = Resolution(ResolutionStatus(status), result_json, ref, untrusted, duration_ms, error_code,
                                detail, retryable)
    owner = None if lease_owner is None else Owner(lease_owner, lease_boot or "")
    late_res = None if late is None else resolution_from_json(late)
    return CallRecord(intent, attempt, owner, lease_token, resolution, late_res), bool(expired)


class PostgresLedger(IdempotencyLedger):
    """`IdempotencyLedger` over a psycopg connection pool; schema `gateway` unless configured."""

    def __init__(self, pool: ConnectionPool, schema: str = "gateway") -> None:
        self._pool = pool
        self._schema = check_schema_name(schema)
        self._t = sql.Identifier(schema, "tool_calls")

    def _q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(t=self._t, cols=sql.SQL(_COLUMNS))

    def ensure_schema(self) -> None:
        with self._pool.connection() as conn:
            # Every instance runs this at start-up; the lock keeps their DDL from racing.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"tether.gateway.ledger.{self._schema}",))
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self._schema)))
            conn.execute(sql.SQL(_DDL).format(table=self._t))
            conn.execute(
                sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (kafka_partition, lease_expires_at) WHERE status IS NULL").format(
                    sql.Identifier("tool_calls_unresolved"), self._t
                )
            )

    # -- claim ---------------------------------------------------------------------------------
    def claim(self, intent: Intent, owner: Owner, lease_ms: int) -> Claim:
        token = uuid.uuid4().hex
        with self._pool.connection() as conn:
            inserted = conn.execute(
                self._q(
                    "INSERT INTO {t} (idem_key, run_id, tenant_id, kafka_partition, step, call_id, tool_name, "
                    "args_json, args_hash, tool_spec_json, idempotent, attempt, lease_owner, lease_boot, lease_token, "
                    "lease_expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 1, %s, %s, %s, "
                    "clock_timestamp() + %s * interval '1 millisecond') ON CONFLICT (idem_key) DO NOTHING RETURNING {cols}"
                ),
                (intent.idem_key, intent.run_id, intent.tenant_id, intent.partition, intent.step, intent.call_id,
                 intent.tool_name, intent.args_json, intent.args_hash, intent.tool_spec_json, intent.idempotent,
                 owner.instance, owner.boot, token, lease_ms),
            ).fetchone()
            if inserted is not None:
                record, _ = _record(inserted)
                return Execute(record, token, 1, resumed=False)
            row = conn.execute(self._q("SELECT {cols} FROM {t} WHERE idem_key = %s FOR UPDATE"), (intent.idem_key,)).fetchone()
            record, expired = _record(row)
            check_same_intent(record.intent, intent)
            if record.resolution is not None:
                return Resolved(record, record.resolution, by_this_claim=False)
            return self._take_over(conn, record, owner, lease_ms, expired)

    def _take_over(self, conn: Connection, record: CallRecord, owner: Owner, lease_ms: int, expired: bool) -> Claim:
        action = takeover_action(record, owner, lease_expired=expired)
        if action is TakeoverAction.BUSY:
            return Busy(record)
        key = record.intent.idem_key
        if action is TakeoverAction.REEXECUTE:
            token = uuid.uuid4().hex
            conn.execute(
                self._q(
                    "UPDATE {t} SET attempt = attempt + 1, lease_owner = %s, lease_boot = %s, lease_token = %s, "
                    "lease_expires_at = clock_timestamp() + %s * interval '1 millisecond' WHERE idem_key = %s"
                ),
                (owner.instance, owner.boot, token, lease_ms, key),
            )
            record = dataclasses.replace(record, attempt=record.attempt + 1, lease_owner=owner, lease_token=token)
            return Execute(record, token, record.attempt, resumed=True)
        resolution = Resolution(ResolutionStatus.OUTCOME_UNKNOWN, detail=UNKNOWN_DETAIL)
        self._write_resolution(conn, key, resolution)
        return Resolved(dataclasses.replace(record, resolution=resolution), resolution, by_this_claim=True)

    def _write_resolution(self, conn: Connection, key: str, r: Resolution) -> None:
        ref = r.result_ref
        conn.execute(
            self._q(
                "UPDATE {t} SET status = %s, result_json = %s, result_ref_sha256 = %s, result_ref_size = %s, "
                "result_ref_media_type = %s, untrusted = %s, duration_ms = %s, error_code = %s, detail = %s, "
                "retryable = %s, resolved_at = clock_timestamp() WHERE idem_key = %s"
            ),
            (r.status.value, r.result_json, ref and ref.sha256, ref and ref.size, ref and ref.media_type,
             r.untrusted, r.duration_ms, r.error_code, r.detail, r.retryable, key),
        )

    # -- lease and resolution --------------------------------------------------------------------
    def heartbeat(self, idem_key: str, token: str, lease_ms: int) -> bool:
        with self._pool.connection() as conn:
            cur = conn.execute(
                self._q(
                    "UPDATE {t} SET lease_expires_at = clock_timestamp() + %s * interval '1 millisecond' "
                    "WHERE idem_key = %s AND lease_token = %s AND status IS NULL"
                ),
                (lease_ms, idem_key, token),
            )
            return cur.rowcount == 1

    def complete(self, idem_key: str, token: str, resolution: Resolution) -> Completion:
        with self._pool.connection() as conn:
            row = conn.execute(self._q("SELECT {cols} FROM {t} WHERE idem_key = %s FOR UPDATE"), (idem_key,)).fetchone()
            if row is None:
                return Completion(False, None)
            record, _ = _record(row)
            if record.resolution is not None:
                if resolution != record.resolution and record.late_resolution is None:
                    conn.execute(
                        self._q("UPDATE {t} SET late_resolution = %s::jsonb WHERE idem_key = %s"),
                        (resolution_to_json(resolution), idem_key),
                    )
                return Completion(False, record.resolution)
            if record.lease_token != token:
                return Completion(False, None)
            self._write_resolution(conn, idem_key, resolution)
            return Completion(True, resolution)

    def sweep(self, owner: Owner, lease_ms: int, partitions: Sequence[int] | None = None, limit: int = 100) -> list[Claim]:
        where = "status IS NULL AND lease_expires_at <= clock_timestamp()"
        params: list[Any] = []
        if partitions is not None:
            where += " AND kafka_partition = ANY(%s)"
            params.append(list(partitions))
        params.append(limit)
        with self._pool.connection() as conn:
            rows = conn.execute(
                self._q(f"SELECT {{cols}} FROM {{t}} WHERE {where} ORDER BY lease_expires_at LIMIT %s FOR UPDATE SKIP LOCKED"),
                params,
            ).fetchall()
            claims = []
            for row in rows:
                record, expired = _record(row)
                claims.append(self._take_over(conn, record, owner, lease_ms, expired))
            return claims

    def get(self, idem_key: str) -> CallRecord | None:
        with self._pool.connection() as conn:
            row = conn.execute(self._q("SELECT {cols} FROM {t} WHERE idem_key = %s"), (idem_key,)).fetchone()
        return None if row is None else _record(row)[0]
