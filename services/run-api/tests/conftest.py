"""Fixtures: a run-api wired to the real stack under unique names (schemas, topic prefix, Redis key prefix)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import psycopg
import pytest
import redis
from confluent_kafka.admin import AdminClient
from psycopg import sql

from tether_run_api.api.server import RunningServer, start_server
from tether_run_api.bootstrap import App, build_app
from tether_run_api.settings import RunApiSettings

# The projector's read-model DDL (tether_projector.adapters.postgres.DDL), so these tests run
# run-api's queries against the tables the projector really creates.
READ_MODEL_DDL = """
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
    withdrawn_at_ms   bigint
);
CREATE INDEX IF NOT EXISTS approvals_tenant_status ON {s}.approvals (tenant_id, status, requested_at_ms, approval_id);
CREATE INDEX IF NOT EXISTS approvals_run ON {s}.approvals (run_id);
"""


@dataclass
class Stack:
    """A run-api on an ephemeral port, its settings, and clients of what it talks to."""

    settings: RunApiSettings
    app: App
    server: RunningServer
    channel: grpc.Channel
    redis: redis.Redis

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def pg(self) -> psycopg.Connection:
        return psycopg.connect(self.settings.pg_dsn, autocommit=True)


def _settings(kafka_bootstrap: str, pg_dsn: str, redis_url: str) -> RunApiSettings:
    tag = uuid.uuid4().hex[:10]
    return RunApiSettings(
        kafka_bootstrap=kafka_bootstrap,
        pg_dsn=pg_dsn,
        redis_url=redis_url,
        partitions=3,
        topic_prefix=f"test-{tag}.",
        pg_schema=f"run_api_{tag}",
        read_model_schema=f"read_model_{tag}",
        live_key_prefix=f"test-{tag}:",
        port=0,
        grpc_workers=16,
        max_streams=4,
        max_request_bytes=256 * 1024,
        max_receive_message_bytes=1024 * 1024,
        stream_block_ms=100,
        stream_gap_wait_s=2.0,
        pg_pool_size=8,
        auth_cache_s=0.0,
    )


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, pg_dsn: str, redis_url: str) -> Iterator[Stack]:
    settings = _settings(kafka_bootstrap, pg_dsn, redis_url)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(READ_MODEL_DDL).format(s=sql.Identifier(settings.read_model_schema)))
    app = build_app(settings)
    server = start_server(app.services, host="127.0.0.1", port=0, workers=settings.grpc_workers,
                          max_receive_message_bytes=settings.max_receive_message_bytes)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    client = redis.Redis.from_url(redis_url)
    try:
        yield Stack(settings, app, server, channel, client)
    finally:
        channel.close()
        server.stop(0)
        app.close()
        for key in client.scan_iter(match=f"{settings.live_key_prefix}*"):
            client.delete(key)
        client.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for schema in (settings.pg_schema, settings.read_model_schema):
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        ours = [t for t in admin.list_topics(timeout=30).topics if t.startswith(settings.topic_prefix)]
        if ours:
            for fut in admin.delete_topics(ours, operation_timeout=30).values():
                fut.result(timeout=60)
