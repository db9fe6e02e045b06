"""The read model in PostgreSQL: tables in one schema (default `read_model`), created idempotently.

The tables are the projector's contract with readers (services/projector/README.md). Writes are
keyed upserts produced by the domain; a run's `state` column holds the projector's fold, so the
next event is projected from what is committed, never from process memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tether_projector.domain.rows import TABLE_KEYS, Json, Upsert
from tether_projector.domain.state import RunFold
from tether_projector.ports import ReadModelUnavailable

#: Advisory-lock class of the projector (first key of pg_advisory_xact_lock(int, int)), so its
#: per-run locks do not collide with other services' advisory locks in the same database.
LOCK_CLASS = 0x7E7E

DDL = """
CREATE SCHEMA IF NOT EXISTS {s};

CREATE TABLE IF NOT EXISTS {s}.runs (
    run_id            text PRIMARY KEY,
    tenant_id         text NOT NULL,
    status            text NOT NULL,
    principal_id      text,
    request_id        text,
    goal              text,
    agent_id          text,
    agent_version     integer,
    agent_name        text,
    model_provider    text,
    model_name        text,
    caps              jsonb,
    deadline_ms       bigint,
    answer            text,
    reason_code       text,
    termination       jsonb,
    input_tokens      bigint NOT NULL DEFAULT 0,
    output_tokens     bigint NOT NULL DEFAULT 0,
    cost_usd_micros   bigint NOT NULL DEFAULT 0,
    steps             integer NOT NULL DEFAULT 0,
    current_step      integer NOT NULL DEFAULT 0,
    tool_calls        integer NOT NULL DEFAULT 0,
    created_at_ms     bigint NOT NULL,
    updated_at_ms     bigint NOT NULL,
    ended_at_ms       bigint,
    last_seq          bigint NOT NULL,
    last_hash         text NOT NULL,
    chain_ok          boolean NOT NULL DEFAULT true,
    chain_problems    jsonb NOT NULL DEFAULT '[]',
    state             jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_tenant_created ON {s}.runs (tenant_id, created_at_ms DESC, run_id);
CREATE INDEX IF NOT EXISTS runs_tenant_status ON {s}.runs (tenant_id, status);

CREATE TABLE IF NOT EXISTS {s}.events (
    run_id            text NOT NULL,
    seq               bigint NOT NULL,
    tenant_id         text NOT NULL,
    event_id          text NOT NULL,
    event_type        text NOT NULL,
    recorded_at_ms    bigint NOT NULL,
    producer          text NOT NULL,
    payload           jsonb NOT NULL,
    hash              text NOT NULL,
    prev_hash         text NOT NULL,
    causation_id      text,
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX IF NOT EXISTS events_event_id ON {s}.events (event_id);

CREATE TABLE IF NOT EXISTS {s}.steps (
    run_id                     text NOT NULL,
    step                       integer NOT NULL,
    tenant_id                  text NOT NULL,
    status                     text,
    started_at_ms              bigint,
    remaining_steps            integer,
    remaining_tokens           bigint,
    remaining_cost_usd_micros  bigint,
    remaining_wall_clock_ms    bigint,
    loop_warning               text,
    model_provider             text,
    model_name                 text,
    input_tokens               bigint,
    output_tokens              bigint,
    cost_usd_micros            bigint,
    assistant_text             text,
    message_ref                jsonb,
    finish_reason              text,
    latency_ms                 bigint,
    attempts                   integer,
    compacted                  boolean,
    tool_call_count            integer,
    model_completed_at_ms      bigint,
    error_code                 text,
    detail                     text,
    ended_at_ms                bigint,
    PRIMARY KEY (run_id, step)
);

CREATE TABLE IF NOT EXISTS {s}.tool_calls (
    run_id            text NOT NULL,
    call_id           text NOT NULL,
    tenant_id         text NOT NULL,
    step              integer NOT NULL,
    call_index        integer,
    tool_name         text,
    args_json         text,
    args_hash         text,
    idem_key          text,
    provenance_json   text,
    status            text,
    approval_id       text,
    result_json       text,
    result_ref        jsonb,
    untrusted         boolean,
    duration_ms       bigint,
    replayed          boolean,
    error_code        text,
    detail            text,
    retryable         boolean,
    policy_version    text,
    inputs_hash       text,
    requested_at_ms   bigint,
    budgeted_at_ms    bigint,
    updated_at_ms     bigint,
    ended_at_ms       bigint,
    PRIMARY KEY (run_id, call_id)
);
CREATE INDEX IF NOT EXISTS tool_calls_step ON {s}.tool_calls (run_id, step, call_index);

CREATE TABLE IF NOT EXISTS {s}.approvals (
    approval_id       text PRIMARY KEY,
    tenant_id         text NOT NULL,
    run_id            text,
    call_id           text,
    step              integer,
    idem_key          text,
    tool_name         text,
    args_json         text,
    args_hash         text,
    risk_class        text,
    reasons           text[],
    provenance_json   text,
    policy_version    text,
    inputs_hash       text,
    requested_at_ms   bigint,
    expires_at_ms     bigint,
    status            text,
    decided_by        text,
    decided_at_ms     bigint,
    comment           text,
    withdrawn_at_ms   bigint,
    refused_decision  jsonb
);
-- Added after the first release: a table created before it gains the column here.
ALTER TABLE {s}.approvals ADD COLUMN IF NOT EXISTS refused_decision jsonb;
CREATE INDEX IF NOT EXISTS approvals_tenant_status ON {s}.approvals (tenant_id, status, requested_at_ms, approval_id);
CREATE INDEX IF NOT EXISTS approvals_run ON {s}.approvals (run_id);
"""


def _clean(value: Any) -> Any:
    # PostgreSQL text and jsonb cannot hold U+0000; it never carries meaning in run data.
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    return value


def _param(value: Any) -> Any:
    if isinstance(value, Json):
        return None if value.value is None else Jsonb(_clean(value.value))
    return _clean(value)


class _PgTx:
    def __init__(self, model: PostgresReadModel, conn: psycopg.Connection[dict[str, Any]]) -> None:
        self._model = model
        self._conn = conn

    def load_runs(self, run_ids: Sequence[str]) -> dict[str, RunFold]:
        if not run_ids:
            return {}
        ids = sorted(set(run_ids))
        # Not pipelined: each statement's answer is read before the next is sent. In one pipeline
        # on one cursor, the 10,000-run load test once got the lock's rows back from `fetchall`
        # (KeyError 'run_id', the projector down); the two round trips cost well under a
        # millisecond here, the writes below stay pipelined.
        with self._conn.cursor() as cur:
            if self._model.lock_runs:
                # Serialises projection of a run across instances (a partition briefly owned by
                # two during a rebalance), including runs that have no row yet. Sorted: no deadlocks.
                cur.execute("SELECT pg_advisory_xact_lock(%s, hashtext(r)) FROM unnest(%s::text[]) AS r",
                            (LOCK_CLASS, ids))
            cur.execute(self._model.statement(("load",)), (ids,))
            rows = cur.fetchall()
        return {r["run_id"]: RunFold.model_validate(r["state"]) for r in rows}

    def write(self, writes: Sequence[Upsert]) -> None:
        groups: dict[tuple[str, tuple[str, ...], bool], list[dict[str, Any]]] = {}
        for w in writes:
            row = w.row()
            groups.setdefault((w.table, tuple(sorted(row)), w.only_insert), []).append(row)
        with self._conn.pipeline(), self._conn.cursor() as cur:
            for (table, columns, only_insert), rows in groups.items():
                statement = self._model.statement(("upsert", table, columns, only_insert))
                cur.executemany(statement, [tuple(_param(r[c]) for c in columns) for r in rows])


def _upsert_sql(schema: sql.Identifier, table: str, columns: tuple[str, ...], only_insert: bool) -> sql.Composed:
    keys = TABLE_KEYS[table]
    others = [c for c in columns if c not in keys]
    if only_insert or not others:
        action = sql.SQL("DO NOTHING")
    else:
        action = sql.SQL("DO UPDATE SET ") + sql.SQL(", ").join(
            sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in others
        )
    return sql.SQL("INSERT INTO {s}.{t} ({cols}) VALUES ({vals}) ON CONFLICT ({keys}) {action}").format(
        s=schema,
        t=sql.Identifier(table),
        cols=sql.SQL(", ").join(map(sql.Identifier, columns)),
        vals=sql.SQL(", ").join(sql.Placeholder() * len(columns)),
        keys=sql.SQL(", ").join(map(sql.Identifier, keys)),
        action=action,
    )


class PostgresReadModel:
    """ReadModel over one PostgreSQL schema, on one connection (the projector is single-threaded).

    A broken connection is dropped and reopened by the next transaction; the failed transaction
    surfaces as `ReadModelUnavailable` (it did not commit, so it can simply be retried).
    """

    def __init__(self, dsn: str, schema: str = "read_model", *, lock_runs: bool = True) -> None:
        self.dsn = dsn
        self.schema = schema
        self.lock_runs = lock_runs
        self._conn: psycopg.Connection[dict[str, Any]] | None = None
        self._statements: dict[tuple[Any, ...], bytes] = {}

    def statement(self, key: tuple[Any, ...]) -> bytes:
        """The SQL text of a load or upsert statement, composed once per shape (composing is not free)."""
        text = self._statements.get(key)
        if text is None:
            s = sql.Identifier(self.schema)
            if key[0] == "load":
                composed = sql.SQL("SELECT run_id, state FROM {s}.runs WHERE run_id = ANY(%s)").format(s=s)
            else:
                _, table, columns, only_insert = key
                composed = _upsert_sql(s, table, columns, only_insert)
            text = self._statements[key] = composed.as_bytes(None)
        return text

    def _connection(self) -> psycopg.Connection[dict[str, Any]]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row)
        return self._conn

    def close(self) -> None:
        """Close the connection (a later transaction reopens it)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        try:
            conn = self._connection()
            with conn.transaction():
                yield conn
        except psycopg.OperationalError as exc:
            self.close()
            raise ReadModelUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def ensure_schema(self) -> None:
        with self._tx() as conn:
            # Two instances starting together must not race on CREATE TABLE IF NOT EXISTS.
            conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (LOCK_CLASS,))
            conn.execute(sql.SQL(DDL).format(s=sql.Identifier(self.schema)))

    @contextmanager
    def transaction(self) -> Iterator[_PgTx]:
        # The loads run one statement at a time, the writes in a pipeline (`_PgTx`).
        with self._tx() as conn:
            yield _PgTx(self, conn)

    def rows(self, table: str) -> list[dict[str, Any]]:
        keys = TABLE_KEYS[table]
        with self._tx() as conn:
            return conn.execute(
                sql.SQL("SELECT * FROM {s}.{t} ORDER BY {keys}").format(
                    s=sql.Identifier(self.schema),
                    t=sql.Identifier(table),
                    keys=sql.SQL(", ").join(map(sql.Identifier, keys)),
                )
            ).fetchall()

    def drop_schema(self) -> None:
        """Drop the schema and every table in it."""
        with self._tx() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {s} CASCADE").format(s=sql.Identifier(self.schema)))

    def replace(self, target: str) -> None:
        """Make this schema the `target` schema in one transaction (readers switch atomically)."""
        with self._tx() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {t} CASCADE").format(t=sql.Identifier(target)))
            conn.execute(
                sql.SQL("ALTER SCHEMA {s} RENAME TO {t}").format(s=sql.Identifier(self.schema), t=sql.Identifier(target))
            )
        self.schema = target
        self._statements.clear()
