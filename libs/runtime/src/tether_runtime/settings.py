"""Typed settings base for every service: shared infrastructure addresses plus per-service knobs."""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _infra(name: str) -> AliasChoices:
    # Infrastructure addresses are the same for every service, so they are read from fixed
    # TETHER_* names whatever the subclass's env prefix is (an alias bypasses the prefix).
    return AliasChoices(name)


class ServiceSettings(BaseSettings):
    """Base class of a service's settings (its composition root reads exactly one of these).

    Shared infrastructure fields come from fixed names (``TETHER_KAFKA_BOOTSTRAP``,
    ``TETHER_PG_DSN``, ``TETHER_REDIS_URL``, ``TETHER_PARTITIONS``, ``TETHER_TOPIC_PREFIX``,
    ``TETHER_TOPIC_REPLICATION_FACTOR``).
    Every other field is read under the subclass's own prefix, e.g. a subclass with
    ``model_config = SettingsConfigDict(env_prefix="TETHER_BUDGET_")`` reads
    ``TETHER_BUDGET_INSTANCE_ID``. See docs/configuration.md.
    """

    model_config = SettingsConfigDict(env_prefix="TETHER_SERVICE_", extra="ignore", populate_by_name=True)

    # -- shared infrastructure (fixed names) ------------------------------------------------
    kafka_bootstrap: str = Field("127.0.0.1:9092", validation_alias=_infra("TETHER_KAFKA_BOOTSTRAP"),
                                 description="Kafka bootstrap servers.")
    pg_dsn: str = Field("postgresql://tether@127.0.0.1:5432/tether", validation_alias=_infra("TETHER_PG_DSN"),
                        description="PostgreSQL DSN (from a Secret in Kubernetes).")
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=_infra("TETHER_REDIS_URL"), description="Redis URL.")
    partitions: int = Field(6, ge=1, validation_alias=_infra("TETHER_PARTITIONS"),
                            description="Partition count of every topic (must match the declared topics).")
    schema_registry_url: str | None = Field(
        None,
        validation_alias=_infra("TETHER_SCHEMA_REGISTRY_URL"),
        description="Confluent Schema Registry URL; when set, records are written in its wire format.",
    )
    schema_write_release: str | None = Field(
        None,
        pattern=r"^(v[0-9]+)?$",  # empty = unset, as the codec reads it
        validation_alias=_infra("TETHER_SCHEMA_WRITE_RELEASE"),
        description="Phase 1 of a rolling upgrade: write every record with this released snapshot's schemas (e.g. "
        "v1) so pods of that release read them; unset in phase 2. Read once per process by the codec "
        "(tether_messaging.serde); a release that cannot write every current record stops start-up. docs/serde.md.",
    )
    topic_prefix: str = Field(
        "",
        validation_alias=_infra("TETHER_TOPIC_PREFIX"),
        description="Prepended to every topic, consumer group and transactional id (isolates tests).",
    )
    topic_replication_factor: int = Field(
        3,
        ge=1,
        validation_alias=_infra("TETHER_TOPIC_REPLICATION_FACTOR"),
        description="Replication factor of the topics a service declares (min.insync.replicas is all replicas but "
        "one, at most 2, at least 1). At most the broker count: the single-broker local stack uses 1. An existing "
        "topic with another factor is logged, not changed.",
    )

    # -- per service (under the subclass's env prefix) --------------------------------------
    instance_id: int = Field(
        0,
        ge=0,
        description="Stable slot of this instance; the transactional id is '<name>-<instance_id>'. Setting it "
        "(a StatefulSet ordinal) also makes the loop's consumer a static group member with the same id.",
    )
    http_host: str = Field("127.0.0.1", description="Address of the metrics/health server.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of the metrics/health server; 0 = ephemeral.")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR.")
    startup_wait_s: float = Field(
        120.0,
        ge=0,
        description="How long start-up retries an unreachable PostgreSQL (with backoff, /readyz not ready) "
        "before the process exits 1.",
    )


class CapCeilingSettings(BaseSettings):
    """The service-wide ceilings on the caps a run may ask for, read from the budget service's names
    (``TETHER_BUDGET_CEILING_MAX_STEPS``, ...) whatever the subclass's prefix: the budget enforces
    them (CAPS_ABOVE_CEILING) and run-api refuses an agent or a submit above them up front, so both
    must read the same values. Mixed into BudgetSettings and RunApiSettings."""

    ceiling_max_steps: int = Field(1_000, ge=1, validation_alias=_infra("TETHER_BUDGET_CEILING_MAX_STEPS"),
                                   description="Highest max_steps a run may have: the budget rejects a run above it "
                                   "(CAPS_ABOVE_CEILING), run-api refuses such an agent or submit (INVALID_ARGUMENT).")
    ceiling_max_wall_clock_ms: int = Field(7 * 24 * 3_600_000, ge=1,
                                           validation_alias=_infra("TETHER_BUDGET_CEILING_MAX_WALL_CLOCK_MS"),
                                           description="Highest max_wall_clock_ms (budget and run-api, as above).")
    ceiling_max_tokens: int = Field(50_000_000, ge=1, validation_alias=_infra("TETHER_BUDGET_CEILING_MAX_TOKENS"),
                                    description="Highest max_tokens (budget and run-api, as above).")
    ceiling_max_cost_usd_micros: int = Field(1_000_000_000, ge=1,
                                             validation_alias=_infra("TETHER_BUDGET_CEILING_MAX_COST_USD_MICROS"),
                                             description="Highest max_cost_usd_micros (budget and run-api, as above).")
    ceiling_max_tool_calls: int = Field(10_000, ge=0, validation_alias=_infra("TETHER_BUDGET_CEILING_MAX_TOOL_CALLS"),
                                        description="Highest max_tool_calls (budget and run-api, as above).")


class LoopServiceSettings(ServiceSettings):
    """Settings of a service on the run loop (`tether_messaging.loop`): the base fields plus the
    loop's knobs, read under the subclass's prefix like the rest. run-api, which has no loop,
    inherits `ServiceSettings` and so reads none of them."""

    batch_max_ms: int = Field(100, ge=1, description="Longest a loop batch collects input before it commits.")
    batch_max_messages: int = Field(500, ge=1, description="Most input records per loop batch/transaction.")
    work_threads: int = Field(8, ge=1, description="Threads running slow work (model calls, tool executions).")
    tenant_weights: dict[str, int] = Field(
        default_factory=dict,
        description='Share of the worker pool per tenant while several wait (JSON, e.g. {"big-co": 3}); others get 1.',
    )
    session_timeout_ms: int = Field(
        10_000, ge=6_000, description="Consumer group session timeout: how soon a dead instance's partitions move."
    )
    transaction_timeout_ms: int = Field(
        10_000,
        ge=1_000,
        description="Kafka transaction timeout of the loop's producer; a batch stops handling input at half of it "
        "and commits. A crashed slot that never returns stalls readers of its partitions this long.",
    )
    revoke_drain_ms: int = Field(
        5_000,
        ge=0,
        description="On a rebalance, how long the loop waits for running work of the revoked partitions to finish "
        "and commits its outcome before handing them over (the group waits meanwhile).",
    )
    kafka_retry_backoff_ms: int = Field(
        5,
        ge=1,
        le=1_000,
        description="First backoff of the loop producer's retried Kafka requests (librdkafka retry.backoff.ms; later "
        "retries double up to 1 s). Short, so back-to-back transactions do not wait 100 ms on CONCURRENT_TRANSACTIONS.",
    )
    noop_commit_ms: int = Field(
        1_000,
        ge=0,
        description="A batch that changed nothing (its records passed over, or handled without emitting, putting "
        "state or starting work) commits no transaction; its offsets go with the next commit, or at most this long "
        "after the last. 0 = commit every batch.",
    )
    state_dir: str | None = Field(
        None,
        description="Directory for the loop's per-run state store (an SQLite cache of the changelog, deleted at "
        "shutdown); default: the system's temporary directory. Local disk, not a memory filesystem.",
    )
    state_cache_runs: int = Field(
        256, ge=1, description="Decoded run states the loop keeps in memory (LRU); the others stay on disk until read."
    )
