"""Builds the projector and its adapters from settings (no I/O besides what callers ask for)."""

from __future__ import annotations

from typing import Any

import redis
from prometheus_client import REGISTRY, CollectorRegistry

from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.adapters.redis_live import RedisLiveState
from tether_projector.entrypoint import ProjectorProcessor, unknown_schema_reasons
from tether_projector.handlers import Deps
from tether_projector.metrics import ProjectorMetrics
from tether_projector.settings import ProjectorSettings


def build_live(settings: ProjectorSettings) -> RedisLiveState:
    """The Redis live state the settings describe (connects lazily)."""
    return RedisLiveState(
        redis.Redis.from_url(settings.redis_url),
        prefix=settings.redis_key_prefix,
        stream_maxlen=settings.stream_maxlen,
        live_ttl_s=settings.live_ttl_s,
        ended_ttl_s=settings.ended_ttl_s,
    )


def build_deps(settings: ProjectorSettings, *, registry: CollectorRegistry = REGISTRY) -> Deps:
    """Read model, live state and metrics as the settings describe them."""
    return Deps(
        read_model=PostgresReadModel(settings.pg_dsn, settings.read_model_schema),
        live=build_live(settings),
        metrics=ProjectorMetrics(registry),
    )


def build_processor(settings: ProjectorSettings, *, registry: CollectorRegistry = REGISTRY) -> ProjectorProcessor:
    """The projector processor wired from settings."""
    return ProjectorProcessor(
        build_deps(settings, registry=registry),
        settings.input_topic(),
        read_model_attempts=settings.read_model_attempts,
    )


def loop_options(settings: ProjectorSettings) -> dict[str, Any]:
    """The projector's overrides of the shared loop's configuration (`LoopConfig` fields)."""
    # At-least-once, not transactional: the projector produces nothing but dead letters, and its
    # effects (the batch's rows, written in before_commit) are idempotent (an event at or below its
    # run's last_seq is skipped), so a replay after a crash before the offset commit is harmless.
    # A handler error, or a failure projecting the batch (PostgreSQL still unavailable after
    # read_model_attempts), stops the process with nothing committed (the batch is replayed after
    # the restart) rather than dead-lettering events. An event whose schema this build does not know
    # (unknown_schema_reasons) does not stop it: the loop blocks that event's partition at it,
    # uncommitted (tether_loop_blocked = 1, /readyz 503), while the other partitions flow, until a
    # build that reads it takes the partition. Corrupt or unsealed records are dead-lettered.
    return {"transactional": False, "handler_errors": "fail",
            "fail_on_decode_errors": unknown_schema_reasons(settings.schema_registry_url)}


def declare_topics(settings: ProjectorSettings) -> None:
    """Create the shared topics and the projector's (unused, empty) changelog if missing; idempotent.

    The loop looks up its service's changelog on every assignment even without per-run state.
    """
    from tether_messaging.admin import declare_topics as declare

    declare(settings.kafka_bootstrap, settings.partitions, [ProjectorProcessor.name], prefix=settings.topic_prefix,
            replication_factor=settings.topic_replication_factor)
