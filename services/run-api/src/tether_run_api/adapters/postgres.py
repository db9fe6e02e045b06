"""The run_api schema in PostgreSQL: tenants, API keys, the versioned catalog, grants, the submit ledger."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import psycopg
from psycopg import errors, sql
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from tether_contracts.records import AgentSpec, Caps, ModelRef, RiskClass, ToolSpec
from tether_run_api.domain.auth import ApiKeyRecord, Principal
from tether_run_api.domain.catalog import AgentVersion, ToolVersion
from tether_run_api.domain.errors import (
    AgentAlreadyExists,
    AgentVersionConflict,
    BackendUnavailable,
    RequestIdReused,
    UnstorableValue,
)
from tether_run_api.domain.tenancy import TenantPolicy
from tether_run_api.domain.views import Submission
from tether_run_api.ports import Idempotency

P = ParamSpec("P")
T = TypeVar("T")

ALL_PRINCIPALS = "*"

_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.tenants (
    tenant_id    text PRIMARY KEY,
    display_name text NOT NULL DEFAULT '',
    spread       int  NOT NULL DEFAULT 1 CHECK (spread >= 1),
    created_at   timestamptz NOT NULL DEFAULT now()
);
-- Tenant limits (totals over the tenant's spread; 0 = no limit), added after the first release.
ALTER TABLE {s}.tenants ADD COLUMN IF NOT EXISTS max_concurrent_runs  int    NOT NULL DEFAULT 0;
ALTER TABLE {s}.tenants ADD COLUMN IF NOT EXISTS max_queued_runs      int    NOT NULL DEFAULT 0;
ALTER TABLE {s}.tenants ADD COLUMN IF NOT EXISTS spend_cap_usd_micros bigint NOT NULL DEFAULT 0;
ALTER TABLE {s}.tenants ADD COLUMN IF NOT EXISTS spend_window_ms      bigint NOT NULL DEFAULT 0;
ALTER TABLE {s}.tenants ADD COLUMN IF NOT EXISTS tokens_per_minute    bigint NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS {s}.api_keys (
    key_hash     text PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES {s}.tenants (tenant_id),
    principal_id text NOT NULL,
    roles        text[] NOT NULL DEFAULT '{{}}',
    label        text NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz
);
CREATE TABLE IF NOT EXISTS {s}.agent_versions (
    tenant_id             text    NOT NULL,
    agent_id              text    NOT NULL,
    version               int     NOT NULL CHECK (version >= 1),
    display_name          text    NOT NULL,
    instructions          text    NOT NULL,
    model_provider        text    NOT NULL,
    model_name            text    NOT NULL,
    context_window_tokens int     NOT NULL,
    tool_allowlist        text[]  NOT NULL,
    max_steps             int     NOT NULL,
    max_wall_clock_ms     bigint  NOT NULL,
    max_tokens            bigint  NOT NULL,
    max_cost_usd_micros   bigint  NOT NULL,
    max_tool_calls        int     NOT NULL,
    compaction_threshold  real    NOT NULL,
    created_by            text    NOT NULL,
    created_at_ms         bigint  NOT NULL,
    CONSTRAINT agent_versions_pkey PRIMARY KEY (tenant_id, agent_id, version)
);
CREATE TABLE IF NOT EXISTS {s}.tool_versions (
    tenant_id            text    NOT NULL,
    name                 text    NOT NULL,
    version              int     NOT NULL CHECK (version >= 1),
    description          text    NOT NULL,
    args_schema          jsonb   NOT NULL,
    args_schema_json     text    NOT NULL,
    risk_class           text    NOT NULL,
    idempotent           boolean NOT NULL,
    untrusted_source     boolean NOT NULL,
    executor_kind        text    NOT NULL,
    executor_config_json text    NOT NULL,
    timeout_ms           int     NOT NULL,
    pollable             boolean NOT NULL,
    egress               boolean NOT NULL,
    constraints_json     text    NOT NULL DEFAULT '{{}}',
    disabled             boolean NOT NULL DEFAULT false,
    created_by           text    NOT NULL,
    created_at_ms        bigint  NOT NULL,
    CONSTRAINT tool_versions_pkey PRIMARY KEY (tenant_id, name, version)
);
-- Added after the first release: existing tables get the column too.
ALTER TABLE {s}.tool_versions ADD COLUMN IF NOT EXISTS constraints_json text NOT NULL DEFAULT '{{}}';
CREATE TABLE IF NOT EXISTS {s}.grants (
    tenant_id    text NOT NULL,
    principal_id text NOT NULL,  -- '*' grants the tool to every principal of the tenant
    tool_name    text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, principal_id, tool_name)
);
CREATE TABLE IF NOT EXISTS {s}.requests (
    tenant_id    text NOT NULL,
    operation    text NOT NULL,
    request_id   text NOT NULL,
    request_hash text NOT NULL,
    result_key   text NOT NULL,
    result_version int NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT requests_pkey PRIMARY KEY (tenant_id, operation, request_id)
);
CREATE TABLE IF NOT EXISTS {s}.submissions (
    tenant_id     text   NOT NULL,
    request_id    text   NOT NULL,
    request_hash  text   NOT NULL,
    run_id        text   COLLATE "C" NOT NULL UNIQUE,
    principal_id  text   NOT NULL,
    agent_id      text   NOT NULL,
    agent_version int    NOT NULL,
    goal          text   NOT NULL,
    partition     int    NOT NULL,
    envelope      bytea  NOT NULL,
    created_at_ms bigint NOT NULL,
    delivered_at  timestamptz,
    PRIMARY KEY (tenant_id, request_id)
);
CREATE INDEX IF NOT EXISTS submissions_tenant_run ON {s}.submissions (tenant_id, run_id DESC);
CREATE INDEX IF NOT EXISTS submissions_undelivered ON {s}.submissions (created_at_ms) WHERE delivered_at IS NULL;
CREATE INDEX IF NOT EXISTS submissions_tenant_created ON {s}.submissions (tenant_id, created_at_ms);
"""


def unavailable_as_error(fn: Callable[P, T]) -> Callable[P, T]:
    """Turn a lost connection or an exhausted pool into BackendUnavailable (UNAVAILABLE, retryable),
    and a value PostgreSQL cannot store (DataError) into UnstorableValue (INVALID_ARGUMENT).

    Validation refuses such values with a field violation first; this is the backstop for one it
    missed, so a client's bad value is never reported as the server's INTERNAL failure.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise BackendUnavailable("postgres", type(exc).__name__) from exc
        except psycopg.DataError as exc:
            # psycopg raises it itself, without a sqlstate, for a NUL in a text parameter.
            raise UnstorableValue(exc.sqlstate) from exc

    return wrapper


def open_pool(dsn: str, *, max_size: int, timeout_s: float = 10.0) -> ConnectionPool:
    """A connection pool, opened and checked (raises if PostgreSQL is unreachable)."""
    pool = ConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        timeout=timeout_s,
        open=False,
        kwargs={"autocommit": True, "row_factory": dict_row},
    )
    try:
        pool.open(wait=True, timeout=timeout_s)
    except BaseException:
        pool.close()  # its worker would otherwise keep connecting in the background
        raise
    return pool


def migrate(pool: ConnectionPool, schema: str) -> None:
    """Create the schema and tables if missing. Serialised by an advisory lock: replicas start together."""
    with pool.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"tether-migrate:{schema}",))
        conn.execute(sql.SQL(_DDL).format(s=sql.Identifier(schema)))


def _agent(row: dict[str, Any]) -> AgentVersion:
    return AgentVersion(
        spec=AgentSpec(
            agent_id=row["agent_id"],
            version=row["version"],
            name=row["display_name"],
            instructions=row["instructions"],
            model=ModelRef(
                provider=row["model_provider"],
                name=row["model_name"],
                context_window_tokens=row["context_window_tokens"],
            ),
            tool_allowlist=list(row["tool_allowlist"]),
            caps=Caps(
                max_steps=row["max_steps"],
                max_wall_clock_ms=row["max_wall_clock_ms"],
                max_tokens=row["max_tokens"],
                max_cost_usd_micros=row["max_cost_usd_micros"],
                max_tool_calls=row["max_tool_calls"],
            ),
            compaction_threshold=row["compaction_threshold"],
        ),
        created_at_ms=row["created_at_ms"],
        created_by=row["created_by"],
    )


def _tool(row: dict[str, Any]) -> ToolVersion:
    return ToolVersion(
        spec=ToolSpec(
            name=row["name"],
            version=row["version"],
            description=row["description"],
            args_schema_json=row["args_schema_json"],
            risk_class=RiskClass(row["risk_class"]),
            idempotent=row["idempotent"],
            untrusted_source=row["untrusted_source"],
            executor_kind=row["executor_kind"],
            executor_config_json=row["executor_config_json"],
            timeout_ms=row["timeout_ms"],
            pollable=row["pollable"],
            egress=row["egress"],
            constraints_json=row["constraints_json"],
        ),
        disabled=row["disabled"],
        created_at_ms=row["created_at_ms"],
        created_by=row["created_by"],
    )


def _submission(row: dict[str, Any]) -> Submission:
    return Submission(
        tenant_id=row["tenant_id"],
        request_id=row["request_id"],
        request_hash=row["request_hash"],
        run_id=row["run_id"],
        principal_id=row["principal_id"],
        agent_id=row["agent_id"],
        agent_version=row["agent_version"],
        goal=row["goal"],
        partition=row["partition"],
        envelope=bytes(row["envelope"]),
        created_at_ms=row["created_at_ms"],
        delivered=row["delivered_at"] is not None,
    )


class PostgresStore:
    """ApiKeys, Catalog and SubmitLedger over one schema (default run_api)."""

    def __init__(self, pool: ConnectionPool, schema: str = "run_api") -> None:
        self._pool = pool
        self._s = sql.Identifier(schema)

    def _q(self, text: str) -> sql.Composed:
        return sql.SQL(text).format(s=self._s)

    def _one(self, text: str, params: Iterable[Any]) -> dict[str, Any] | None:
        with self._pool.connection() as conn:
            return conn.execute(self._q(text), tuple(params)).fetchone()

    def _all(self, text: str, params: Iterable[Any]) -> list[dict[str, Any]]:
        with self._pool.connection() as conn:
            return conn.execute(self._q(text), tuple(params)).fetchall()

    # -- administration (bootstrap, tests) ---------------------------------------------------

    @unavailable_as_error
    def ensure_tenant(self, tenant_id: str, display_name: str | None = None, spread: int | None = None) -> int | None:
        """Create the tenant or update the name and spread given: None keeps the stored value (a new
        tenant gets '' and 1). Returns the spread it had before, None if it is new."""
        with self._pool.connection() as conn, conn.transaction():
            row = conn.execute(self._q("SELECT spread FROM {s}.tenants WHERE tenant_id = %s FOR UPDATE"),
                               (tenant_id,)).fetchone()
            conn.execute(
                self._q(
                    "INSERT INTO {s}.tenants AS t (tenant_id, display_name, spread) "
                    "VALUES (%s, coalesce(%s::text, ''), coalesce(%s::int, 1)) "
                    "ON CONFLICT (tenant_id) DO UPDATE SET display_name = coalesce(%s::text, t.display_name), "
                    "spread = coalesce(%s::int, t.spread)"
                ),
                (tenant_id, display_name, spread, display_name, spread),
            )
            return row["spread"] if row else None

    @unavailable_as_error
    def add_api_key(self, key_hash: str, tenant_id: str, principal_id: str, roles: Iterable[str],
                    label: str = "") -> None:
        """Store a key's hash mapped to its tenant, principal and roles."""
        with self._pool.connection() as conn:
            conn.execute(
                self._q(
                    "INSERT INTO {s}.api_keys (key_hash, tenant_id, principal_id, roles, label) "
                    "VALUES (%s, %s, %s, %s, %s)"
                ),
                (key_hash, tenant_id, principal_id, sorted(set(roles)), label),
            )

    @unavailable_as_error
    def revoke_api_key(self, key_hash: str) -> bool:
        """Revoke a key; True if it was active."""
        with self._pool.connection() as conn:
            cur = conn.execute(
                self._q("UPDATE {s}.api_keys SET revoked_at = now() WHERE key_hash = %s AND revoked_at IS NULL"),
                (key_hash,),
            )
            return cur.rowcount == 1

    @unavailable_as_error
    def api_keys(self, *, tenant_id: str | None = None, hash_prefix: str = "") -> list[ApiKeyRecord]:
        """Stored keys (hashes only), revoked ones too: of one tenant or of all, whose hash starts with
        `hash_prefix` (hex, checked by the caller)."""
        rows = self._all(
            "SELECT key_hash, tenant_id, principal_id, roles, label, created_at, revoked_at FROM {s}.api_keys "
            "WHERE (%s::text IS NULL OR tenant_id = %s) AND key_hash LIKE %s "
            "ORDER BY tenant_id, principal_id, created_at, key_hash",
            (tenant_id, tenant_id, hash_prefix + "%"),
        )
        return [ApiKeyRecord(r["key_hash"], r["tenant_id"], r["principal_id"], tuple(r["roles"]), r["label"],
                             r["created_at"], r["revoked_at"]) for r in rows]

    @unavailable_as_error
    def grant(self, tenant_id: str, principal_id: str, tool_names: Iterable[str]) -> None:
        """Grant tools to a principal ('*' = every principal of the tenant)."""
        with self._pool.connection() as conn, conn.transaction():
            for name in tool_names:
                conn.execute(
                    self._q(
                        "INSERT INTO {s}.grants (tenant_id, principal_id, tool_name) VALUES (%s, %s, %s) "
                        "ON CONFLICT DO NOTHING"
                    ),
                    (tenant_id, principal_id, name),
                )

    @unavailable_as_error
    def revoke_grant(self, tenant_id: str, principal_id: str, tool_name: str) -> bool:
        """Remove one grant; True if it existed."""
        with self._pool.connection() as conn:
            cur = conn.execute(
                self._q("DELETE FROM {s}.grants WHERE tenant_id = %s AND principal_id = %s AND tool_name = %s"),
                (tenant_id, principal_id, tool_name),
            )
            return cur.rowcount == 1

    # -- ApiKeys -------------------------------------------------------------------------------

    @unavailable_as_error
    def principal_for(self, key_hash: str) -> Principal | None:
        row = self._one(
            "SELECT tenant_id, principal_id, roles FROM {s}.api_keys WHERE key_hash = %s AND revoked_at IS NULL",
            (key_hash,),
        )
        if row is None:
            return None
        return Principal(row["tenant_id"], row["principal_id"], frozenset(row["roles"]))

    # -- Catalog: agents -------------------------------------------------------------------------

    def _replay(self, conn: psycopg.Connection, tenant_id: str, op: str, idem: Idempotency) -> tuple[str, int] | None:
        row = conn.execute(
            self._q(
                "SELECT request_hash, result_key, result_version FROM {s}.requests "
                "WHERE tenant_id = %s AND operation = %s AND request_id = %s"
            ),
            (tenant_id, op, idem.request_id),
        ).fetchone()
        if row is None:
            return None
        if row["request_hash"] != idem.request_hash:
            raise RequestIdReused(idem.request_id)
        return row["result_key"], row["result_version"]

    def _remember(self, conn: psycopg.Connection, tenant_id: str, op: str, idem: Idempotency | None,
                  key: str, version: int) -> None:
        if idem is None:
            return
        conn.execute(
            self._q(
                "INSERT INTO {s}.requests (tenant_id, operation, request_id, request_hash, result_key, "
                "result_version) VALUES (%s, %s, %s, %s, %s, %s)"
            ),
            (tenant_id, op, idem.request_id, idem.request_hash, key, version),
        )

    def _insert_agent(self, conn: psycopg.Connection, tenant_id: str, spec: AgentSpec, created_by: str,
                      now_ms: int) -> None:
        conn.execute(
            self._q(
                "INSERT INTO {s}.agent_versions (tenant_id, agent_id, version, display_name, instructions, "
                "model_provider, model_name, context_window_tokens, tool_allowlist, max_steps, "
                "max_wall_clock_ms, max_tokens, max_cost_usd_micros, max_tool_calls, compaction_threshold, "
                "created_by, created_at_ms) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
                "%s, %s, %s)"
            ),
            (
                tenant_id, spec.agent_id, spec.version, spec.name, spec.instructions, spec.model.provider,
                spec.model.name, spec.model.context_window_tokens, list(spec.tool_allowlist),
                spec.caps.max_steps, spec.caps.max_wall_clock_ms, spec.caps.max_tokens,
                spec.caps.max_cost_usd_micros, spec.caps.max_tool_calls, spec.compaction_threshold,
                created_by, now_ms,
            ),
        )

    def _write_agent(self, op: str, tenant_id: str, spec: AgentSpec, created_by: str, now_ms: int,
                     idem: Idempotency | None) -> AgentVersion:
        with self._pool.connection() as conn:
            if idem is not None and (done := self._replay(conn, tenant_id, op, idem)) is not None:
                return self._get_agent_or_fail(tenant_id, *done)
            try:
                with conn.transaction():
                    self._insert_agent(conn, tenant_id, spec, created_by, now_ms)
                    self._remember(conn, tenant_id, op, idem, spec.agent_id, spec.version)
            except errors.UniqueViolation as exc:
                # A concurrent twin of this request may have won: its result is ours too.
                if idem is not None and (done := self._replay(conn, tenant_id, op, idem)) is not None:
                    return self._get_agent_or_fail(tenant_id, *done)
                if exc.diag.constraint_name != "agent_versions_pkey":
                    raise
                if op == "CreateAgent":
                    raise AgentAlreadyExists(spec.agent_id) from None
                latest = self.get_agent(tenant_id, spec.agent_id)
                raise AgentVersionConflict(spec.agent_id, spec.version - 1, latest.spec.version if latest else 0) \
                    from None
        return AgentVersion(spec=spec, created_at_ms=now_ms, created_by=created_by)

    def _get_agent_or_fail(self, tenant_id: str, agent_id: str, version: int) -> AgentVersion:
        found = self.get_agent(tenant_id, agent_id, version)
        if found is None:
            raise RuntimeError(f"request log points at missing agent {agent_id} v{version}")
        return found

    @unavailable_as_error
    def create_agent(self, tenant_id: str, spec: AgentSpec, created_by: str, now_ms: int,
                     idem: Idempotency | None) -> AgentVersion:
        return self._write_agent("CreateAgent", tenant_id, spec.model_copy(update={"version": 1}), created_by,
                                 now_ms, idem)

    @unavailable_as_error
    def add_agent_version(self, tenant_id: str, spec: AgentSpec, created_by: str, now_ms: int,
                          idem: Idempotency | None) -> AgentVersion:
        return self._write_agent("UpdateAgent", tenant_id, spec, created_by, now_ms, idem)

    @unavailable_as_error
    def replayed_agent(self, tenant_id: str, op: str, idem: Idempotency) -> AgentVersion | None:
        with self._pool.connection() as conn:
            done = self._replay(conn, tenant_id, op, idem)
        return None if done is None else self._get_agent_or_fail(tenant_id, *done)

    @unavailable_as_error
    def get_agent(self, tenant_id: str, agent_id: str, version: int | None = None) -> AgentVersion | None:
        if version is None:
            row = self._one(
                "SELECT * FROM {s}.agent_versions WHERE tenant_id = %s AND agent_id = %s "
                "ORDER BY version DESC LIMIT 1",
                (tenant_id, agent_id),
            )
        else:
            row = self._one(
                "SELECT * FROM {s}.agent_versions WHERE tenant_id = %s AND agent_id = %s AND version = %s",
                (tenant_id, agent_id, version),
            )
        return _agent(row) if row else None

    @unavailable_as_error
    def list_agents(self, tenant_id: str, after_agent_id: str | None, limit: int) -> list[AgentVersion]:
        rows = self._all(
            "SELECT DISTINCT ON (agent_id) * FROM {s}.agent_versions WHERE tenant_id = %s AND agent_id > %s "
            "ORDER BY agent_id, version DESC LIMIT %s",
            (tenant_id, after_agent_id or "", limit),
        )
        return [_agent(r) for r in rows]

    # -- Catalog: tools ----------------------------------------------------------------------------

    @unavailable_as_error
    def register_tool(self, tenant_id: str, spec: ToolSpec, created_by: str, now_ms: int,
                      idem: Idempotency | None) -> ToolVersion:
        op = "RegisterTool"
        with self._pool.connection() as conn:
            if idem is not None and (done := self._replay(conn, tenant_id, op, idem)) is not None:
                return self._get_tool_or_fail(tenant_id, *done)
            for _attempt in range(5):
                try:
                    with conn.transaction():
                        row = conn.execute(
                            self._q(
                                "SELECT coalesce(max(version), 0) AS v FROM {s}.tool_versions "
                                "WHERE tenant_id = %s AND name = %s"
                            ),
                            (tenant_id, spec.name),
                        ).fetchone()
                        version = row["v"] + 1
                        conn.execute(
                            self._q(
                                "INSERT INTO {s}.tool_versions (tenant_id, name, version, description, "
                                "args_schema, args_schema_json, risk_class, idempotent, untrusted_source, "
                                "executor_kind, executor_config_json, timeout_ms, pollable, egress, "
                                "constraints_json, created_by, created_at_ms) VALUES (%s, %s, %s, %s, %s::jsonb, "
                                "%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                            ),
                            (
                                tenant_id, spec.name, version, spec.description, spec.args_schema_json,
                                spec.args_schema_json, spec.risk_class.value, spec.idempotent,
                                spec.untrusted_source, spec.executor_kind, spec.executor_config_json,
                                spec.timeout_ms, spec.pollable, spec.egress, spec.constraints_json, created_by,
                                now_ms,
                            ),
                        )
                        self._remember(conn, tenant_id, op, idem, spec.name, version)
                    return ToolVersion(spec=spec.model_copy(update={"version": version}), disabled=False,
                                       created_at_ms=now_ms, created_by=created_by)
                except errors.UniqueViolation as exc:
                    if idem is not None and (done := self._replay(conn, tenant_id, op, idem)) is not None:
                        return self._get_tool_or_fail(tenant_id, *done)
                    if exc.diag.constraint_name != "tool_versions_pkey":
                        raise
                    # Another registration of the same name took this version; number again.
            raise BackendUnavailable("postgres", f"tool {spec.name!r}: version contention, retry")

    def _get_tool_or_fail(self, tenant_id: str, name: str, version: int) -> ToolVersion:
        found = self.get_tool(tenant_id, name, version)
        if found is None:
            raise RuntimeError(f"request log points at missing tool {name} v{version}")
        return found

    @unavailable_as_error
    def get_tool(self, tenant_id: str, name: str, version: int | None = None) -> ToolVersion | None:
        if version is None:
            row = self._one(
                "SELECT * FROM {s}.tool_versions WHERE tenant_id = %s AND name = %s ORDER BY version DESC LIMIT 1",
                (tenant_id, name),
            )
        else:
            row = self._one(
                "SELECT * FROM {s}.tool_versions WHERE tenant_id = %s AND name = %s AND version = %s",
                (tenant_id, name, version),
            )
        return _tool(row) if row else None

    @unavailable_as_error
    def list_tools(self, tenant_id: str, after_name: str | None, limit: int, show_disabled: bool) -> list[ToolVersion]:
        rows = self._all(
            "SELECT * FROM (SELECT DISTINCT ON (name) * FROM {s}.tool_versions WHERE tenant_id = %s AND name > %s "
            "ORDER BY name, version DESC) latest WHERE %s OR NOT disabled ORDER BY name LIMIT %s",
            (tenant_id, after_name or "", show_disabled, limit),
        )
        return [_tool(r) for r in rows]

    @unavailable_as_error
    def disable_tool(self, tenant_id: str, name: str, version: int | None) -> list[int] | None:
        with self._pool.connection() as conn, conn.transaction():
            exists = conn.execute(
                self._q(
                    "SELECT 1 FROM {s}.tool_versions WHERE tenant_id = %s AND name = %s "
                    "AND (%s::int IS NULL OR version = %s::int)"
                ),
                (tenant_id, name, version, version),
            ).fetchone()
            if exists is None:
                return None
            rows = conn.execute(
                self._q(
                    "UPDATE {s}.tool_versions SET disabled = true WHERE tenant_id = %s AND name = %s "
                    "AND (%s::int IS NULL OR version = %s::int) AND NOT disabled RETURNING version"
                ),
                (tenant_id, name, version, version),
            ).fetchall()
        return sorted(r["version"] for r in rows)

    @unavailable_as_error
    def latest_enabled_tools(self, tenant_id: str, names: list[str]) -> list[ToolVersion]:
        if not names:
            return []
        rows = self._all(
            "SELECT DISTINCT ON (name) * FROM {s}.tool_versions WHERE tenant_id = %s AND name = ANY(%s) "
            "AND NOT disabled ORDER BY name, version DESC",
            (tenant_id, list(names)),
        )
        return [_tool(r) for r in rows]

    @unavailable_as_error
    def grants_for(self, tenant_id: str, principal_id: str) -> list[str]:
        rows = self._all(
            "SELECT DISTINCT tool_name FROM {s}.grants WHERE tenant_id = %s AND principal_id IN (%s, %s) "
            "ORDER BY tool_name",
            (tenant_id, principal_id, ALL_PRINCIPALS),
        )
        return [r["tool_name"] for r in rows]

    @unavailable_as_error
    def tenant_spread(self, tenant_id: str) -> int:
        row = self._one("SELECT spread FROM {s}.tenants WHERE tenant_id = %s", (tenant_id,))
        return row["spread"] if row else 1

    @unavailable_as_error
    def tenant_policy(self, tenant_id: str) -> TenantPolicy:
        row = self._one(
            "SELECT spread, max_concurrent_runs, max_queued_runs, spend_cap_usd_micros, spend_window_ms, "
            "tokens_per_minute FROM {s}.tenants WHERE tenant_id = %s",
            (tenant_id,),
        )
        return TenantPolicy(**row) if row else TenantPolicy()

    @unavailable_as_error
    def set_tenant_limits(self, tenant_id: str, policy: TenantPolicy) -> bool:
        """Store the tenant's limits (its spread is left as it is); False if there is no such tenant."""
        with self._pool.connection() as conn:
            cur = conn.execute(
                self._q(
                    "UPDATE {s}.tenants SET max_concurrent_runs = %s, max_queued_runs = %s, "
                    "spend_cap_usd_micros = %s, spend_window_ms = %s, tokens_per_minute = %s WHERE tenant_id = %s"
                ),
                (policy.max_concurrent_runs, policy.max_queued_runs, policy.spend_cap_usd_micros,
                 policy.spend_window_ms, policy.tokens_per_minute, tenant_id),
            )
            return cur.rowcount == 1

    # -- SubmitLedger ------------------------------------------------------------------------------

    @unavailable_as_error
    def get(self, tenant_id: str, request_id: str) -> Submission | None:
        row = self._one("SELECT * FROM {s}.submissions WHERE tenant_id = %s AND request_id = %s",
                        (tenant_id, request_id))
        return _submission(row) if row else None

    @unavailable_as_error
    def claim(self, submission: Submission) -> Submission:
        s = submission
        with self._pool.connection() as conn:
            row = conn.execute(
                self._q(
                    "INSERT INTO {s}.submissions (tenant_id, request_id, request_hash, run_id, principal_id, "
                    "agent_id, agent_version, goal, partition, envelope, created_at_ms) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (tenant_id, request_id) DO NOTHING RETURNING *"
                ),
                (s.tenant_id, s.request_id, s.request_hash, s.run_id, s.principal_id, s.agent_id, s.agent_version,
                 s.goal, s.partition, s.envelope, s.created_at_ms),
            ).fetchone()
            if row is None:
                row = conn.execute(
                    self._q("SELECT * FROM {s}.submissions WHERE tenant_id = %s AND request_id = %s"),
                    (s.tenant_id, s.request_id),
                ).fetchone()
        return _submission(row)

    @unavailable_as_error
    def mark_delivered(self, tenant_id: str, request_id: str) -> None:
        with self._pool.connection() as conn:
            conn.execute(
                self._q(
                    "UPDATE {s}.submissions SET delivered_at = now() WHERE tenant_id = %s AND request_id = %s "
                    "AND delivered_at IS NULL"
                ),
                (tenant_id, request_id),
            )

    @unavailable_as_error
    def find_run(self, tenant_id: str, run_id: str) -> Submission | None:
        row = self._one("SELECT * FROM {s}.submissions WHERE tenant_id = %s AND run_id = %s", (tenant_id, run_id))
        return _submission(row) if row else None

    @unavailable_as_error
    def list_runs(self, tenant_id: str, before_run_id: str | None, limit: int) -> list[Submission]:
        if before_run_id is None:
            rows = self._all(
                "SELECT * FROM {s}.submissions WHERE tenant_id = %s ORDER BY run_id DESC LIMIT %s",
                (tenant_id, limit),
            )
        else:
            rows = self._all(
                "SELECT * FROM {s}.submissions WHERE tenant_id = %s AND run_id < %s ORDER BY run_id DESC LIMIT %s",
                (tenant_id, before_run_id, limit),
            )
        return [_submission(r) for r in rows]

    @unavailable_as_error
    def undelivered(self, created_before_ms: int, limit: int) -> list[Submission]:
        rows = self._all(
            "SELECT * FROM {s}.submissions WHERE delivered_at IS NULL AND created_at_ms < %s "
            "ORDER BY created_at_ms LIMIT %s",
            (created_before_ms, limit),
        )
        return [_submission(r) for r in rows]
