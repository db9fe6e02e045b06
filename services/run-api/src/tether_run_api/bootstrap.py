"""Composition root helpers: real adapters built from RunApiSettings (the only place that opens connections)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
import redis
import structlog
from psycopg_pool import ConnectionPool

from tether_messaging.admin import declare_topics
from tether_messaging.registry import envelope_codec
from tether_messaging.topics import Topics
from tether_run_api import handlers
from tether_run_api.adapters.backlog import PostgresTenantBacklog
from tether_run_api.adapters.kafka import KafkaCommandPublisher
from tether_run_api.adapters.live import RedisLiveEvents
from tether_run_api.adapters.postgres import PostgresStore, migrate, open_pool
from tether_run_api.adapters.read_model import PostgresReadModel
from tether_run_api.api.servicers import Services
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.catalog import CapCeilings, CatalogLimits
from tether_run_api.domain.runs import RunLimits
from tether_run_api.domain.tenancy import AdmissionGate
from tether_run_api.settings import RunApiSettings
from tether_runtime.startup import wait_for_dependency


@dataclass
class App:
    """The run-api's wired dependencies and how to release them."""

    settings: RunApiSettings
    services: Services
    store: PostgresStore
    publisher: KafkaCommandPublisher
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def ready(self) -> bool:
        """Ready to serve: the producer's poll thread is alive."""
        return self.publisher.ready()

    def close(self) -> None:
        """Flush Kafka and close PostgreSQL and Redis, in reverse order of opening."""
        for close in reversed(self._closers):
            close()
        self._closers.clear()


def _backlog_unavailable(tenant_id: str, error: Exception) -> None:
    # The door lets the submit through; the budget service still enforces the tenant's limits.
    structlog.get_logger("tether_run_api").warning("tenant_backlog_unavailable", tenant_id=tenant_id, error=str(error))


def open_store(settings: RunApiSettings) -> tuple[PostgresStore, ConnectionPool]:
    """The run_api schema's store (migrated), for the server and for admin commands."""
    pool = open_pool(settings.pg_dsn, max_size=settings.pg_pool_size)
    try:
        migrate(pool, settings.pg_schema)
    except BaseException:
        pool.close()
        raise
    return PostgresStore(pool, settings.pg_schema), pool


def build_app(settings: RunApiSettings, *, stop: threading.Event | None = None) -> App:
    """Open PostgreSQL (and migrate run_api), Redis and a Kafka producer; declare the topics if asked.

    An unreachable PostgreSQL is waited for, up to `settings.startup_wait_s`
    (`tether_runtime.startup.wait_for_dependency`; `StartupInterrupted` if `stop` is set meanwhile).
    """
    topics = Topics(settings.topic_prefix)
    if settings.declare_topics:
        declare_topics(settings.kafka_bootstrap, settings.partitions, [], prefix=settings.topic_prefix,
                       replication_factor=settings.topic_replication_factor)
    closers: list[Callable[[], None]] = []
    store, pool = wait_for_dependency(lambda: open_store(settings), what="postgresql",
                                      retry_on=(psycopg.OperationalError,), stop=stop or threading.Event(),
                                      timeout_s=settings.startup_wait_s)
    closers.append(pool.close)
    redis_client = redis.Redis.from_url(settings.redis_url)
    closers.append(redis_client.close)
    publisher = KafkaCommandPublisher(
        settings.kafka_bootstrap,
        topics.commands,
        delivery_timeout_ms=settings.delivery_timeout_ms,
        codec=envelope_codec(settings.schema_registry_url),
    )
    closers.append(publisher.close)
    ceilings = CapCeilings(
        max_steps=settings.ceiling_max_steps,
        max_wall_clock_ms=settings.ceiling_max_wall_clock_ms,
        max_tokens=settings.ceiling_max_tokens,
        max_cost_usd_micros=settings.ceiling_max_cost_usd_micros,
        max_tool_calls=settings.ceiling_max_tool_calls,
    )
    services = Services(
        keys=store,
        catalog=store,
        ledger=store,
        read_model=PostgresReadModel(pool, settings.read_model_schema),
        live=RedisLiveEvents(redis_client, key_prefix=settings.live_key_prefix),
        publisher=publisher,
        limiter=SubmitRateLimiter(settings.submit_rate_per_s, settings.submit_burst),
        partitioning=handlers.Partitioning(settings.partitions),
        catalog_limits=CatalogLimits(ceilings=ceilings),
        run_limits=RunLimits(max_goal_chars=settings.max_goal_chars, ceilings=ceilings),
        stream_policy=handlers.StreamPolicy(
            block_ms=settings.stream_block_ms, gap_wait_s=settings.stream_gap_wait_s
        ),
        max_request_bytes=settings.max_request_bytes,
        max_trace_events=settings.max_trace_events,
        max_streams=settings.max_streams,
        max_streams_per_tenant=settings.max_streams_per_tenant,
        auth_cache_s=settings.auth_cache_s,
        forbid_self_approval=settings.forbid_self_approval,
        admission=AdmissionGate(
            PostgresTenantBacklog(pool, settings.pg_schema, settings.read_model_schema),
            refresh_ms=settings.admission_refresh_ms,
            unprojected_window_ms=int(settings.admission_unprojected_window_s * 1000),
            retry_after_s=settings.tenant_queue_full_retry_s,
            on_unavailable=_backlog_unavailable,
        ),
    )
    return App(settings=settings, services=services, store=store, publisher=publisher, _closers=closers)
