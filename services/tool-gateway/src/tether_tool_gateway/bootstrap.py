"""Builds the gateway's processor and adapters from settings; `Gateway.open()` does the start-up I/O."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog
from psycopg_pool import ConnectionPool

from tether_messaging.blobstore import PostgresBlobStore
from tether_messaging.topics import Topics
from tether_runtime.logging import log_redactor
from tether_security import (
    EnvSecretProvider,
    FileSecretProvider,
    Redactor,
    SandboxRunner,
    SandboxUnavailable,
    SecretProvider as SecretSource,
    SecretRegistry,
    StaticSecretProvider,
)
from tether_tool_gateway.domain.policy import TrustPolicy
from tether_tool_gateway.domain.policy_document import LoadedPolicy, default_policy, parse_policy
from tether_tool_gateway.domain.results import ResultLimits
from tether_tool_gateway.entrypoint import GatewayProcessor
from tether_tool_gateway.execution import ToolRunner
from tether_tool_gateway.executors.builtin import BuiltinExecutor, _tls
from tether_tool_gateway.executors.http_deadline import deadline_transport
from tether_tool_gateway.executors.http_tool import HttpToolExecutor
from tether_tool_gateway.executors.mcp_stdio import McpStdioExecutor
from tether_tool_gateway.executors.mcp_tool import McpToolExecutor
from tether_tool_gateway.executors.sandbox import SandboxExecutor
from tether_tool_gateway.handlers import Deps
from tether_tool_gateway.ledger.port import Owner
from tether_tool_gateway.ledger.postgres import PostgresLedger
from tether_tool_gateway.ports import Executor
from tether_tool_gateway.ratelimit import RedisRateLimiter
from tether_tool_gateway.settings import GatewaySettings

log = structlog.get_logger("tether_tool_gateway.bootstrap")


@dataclass
class Gateway:
    """The wired service: the processor for the loop, and the resources to open and close."""

    processor: GatewayProcessor
    runner: ToolRunner
    pool: ConnectionPool
    ledger: PostgresLedger
    blobs: PostgresBlobStore
    limiter: RedisRateLimiter
    redactor: Redactor
    sandbox: SandboxRunner | None = None

    def open(self) -> None:
        """Connect to PostgreSQL and create the ledger and blob schemas if missing; probe the sandbox."""
        # Short: start-up retries this (wait_for_dependency) and checks for a SIGTERM between
        # attempts, so a stop during a PostgreSQL outage is honoured within seconds, not 30.
        self.pool.open(wait=True, timeout=5)
        self.ledger.ensure_schema()
        self.blobs.ensure_schema()
        if self.sandbox is not None:
            try:
                self.sandbox.probe()
            except SandboxUnavailable as exc:
                # Tools of kind 'sandbox' and 'mcp_stdio' then fail with EXECUTOR_UNAVAILABLE; nothing runs
                # unsandboxed.
                self.runner.remove_executor("sandbox")
                self.runner.remove_executor("mcp_stdio")
                log.warning("sandbox_unavailable", error=str(exc))

    def close(self) -> None:
        self.runner.close()
        self.pool.close()
        self.limiter.close()


def load_policy(settings: GatewaySettings) -> LoadedPolicy:
    """The policy document the settings name (file, inline, or the built-in default)."""
    if settings.policy_file is not None:
        return parse_policy(Path(settings.policy_file).read_text(encoding="utf-8"))
    if settings.policy_json is not None:
        return parse_policy(settings.policy_json)
    return default_policy()


def secret_source(settings: GatewaySettings, environ: Mapping[str, str]) -> SecretSource:
    """Where tools' secrets come from: a file store, the environment, or nowhere (every lookup fails)."""
    if settings.secrets_path is not None:
        return FileSecretProvider(settings.secrets_path)
    if settings.secrets_env_prefix is not None:
        return EnvSecretProvider(environ, prefix=settings.secrets_env_prefix)
    return StaticSecretProvider({})


def build_gateway(settings: GatewaySettings, *, boot_id: str | None = None,
                  environ: Mapping[str, str] | None = None) -> Gateway:
    """Every adapter the settings describe (no I/O until `open`). `environ` is the process
    environment, passed by the composition root (only for `secrets_env_prefix`)."""
    pool = ConnectionPool(settings.pg_dsn, min_size=1, max_size=settings.pg_pool_max, open=False,
                          name="tool-gateway")
    ledger = PostgresLedger(pool, schema=settings.ledger_schema)
    blobs = PostgresBlobStore(pool, schema=settings.blob_schema)
    # The instance slot is stable across restarts; the boot id tells this life from the last,
    # so an intent our previous life left behind is taken over at once.
    owner = Owner(instance=f"{GatewayProcessor.name}-{settings.instance_id}", boot=boot_id or uuid.uuid4().hex)
    limiter = RedisRateLimiter.from_url(settings.redis_url,
                                        key_prefix=settings.topic_prefix + settings.rate_limit_key_prefix,
                                        max_wait_ms=settings.rate_limit_max_wait_ms,
                                        grant_ttl_ms=settings.rate_limit_grant_ttl_ms)
    # Every secret value a tool resolves is registered with the redactor before it is used, so
    # tool output is scrubbed of it (and of secret-shaped strings) before it is recorded. It is
    # the process-wide log redactor, so the same values never reach a log line either.
    redactor = log_redactor()
    secrets = SecretRegistry(secret_source(settings, environ or {}), redactor)
    # The HTTP tools' deadline rides on a private attribute of httpx (executors/http_deadline.py):
    # build one transport now, so an httpx that no longer takes it stops the start-up here
    # instead of failing every HTTP tool call later.
    deadline_transport(_tls()).close()
    executors: dict[str, Executor] = {"builtin": BuiltinExecutor(), "http": HttpToolExecutor(),
                                      "mcp": McpToolExecutor()}
    sandbox: SandboxRunner | None = None
    if settings.sandbox_enabled:
        try:
            sandbox = SandboxRunner()
            executors["sandbox"] = SandboxExecutor(sandbox)
            executors["mcp_stdio"] = McpStdioExecutor(sandbox, allowed_roots=settings.mcp_stdio_roots)
        except SandboxUnavailable as exc:
            # Tools of kind 'sandbox' then fail with EXECUTOR_UNAVAILABLE; nothing runs unsandboxed.
            log.warning("sandbox_unavailable", error=str(exc))
    runner = ToolRunner(
        ledger=ledger,
        executors=executors,
        blobs=blobs,
        owner=owner,
        secrets=secrets,
        redactor=redactor,
        limiter=limiter,
        limits=ResultLimits(inline_max_bytes=settings.inline_result_max_bytes, max_bytes=settings.result_max_bytes),
        lease_ms=settings.lease_ms,
        heartbeat_ms=settings.heartbeat_ms,
        max_parallel=settings.execution_threads,
    )
    deps = Deps(
        topics=Topics(settings.topic_prefix),
        policy=TrustPolicy(load_policy(settings)),
        runner=runner,
        recheck_ms=settings.recheck_ms,
        stall_ms=settings.stall_ms,
    )
    processor = GatewayProcessor(deps, sweep_interval_ms=settings.sweep_interval_ms, sweep_limit=settings.sweep_limit)
    return Gateway(processor=processor, runner=runner, pool=pool, ledger=ledger, blobs=blobs, limiter=limiter,
                   redactor=redactor, sandbox=sandbox)


def declare_topics(settings: GatewaySettings) -> None:
    """Create the topics the gateway reads and writes (and its changelog) if missing; idempotent."""
    from tether_messaging.admin import declare_topics as declare

    declare(settings.kafka_bootstrap, settings.partitions, [GatewayProcessor.name], prefix=settings.topic_prefix,
            replication_factor=settings.topic_replication_factor)
