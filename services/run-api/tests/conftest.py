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

from tether_projector.adapters.postgres import DDL as PROJECTOR_DDL
from tether_run_api.api.server import RunningServer, start_server
from tether_run_api.bootstrap import App, build_app
from tether_run_api.settings import RunApiSettings

# run-api's queries run against the tables the projector really creates: its own DDL.
READ_MODEL_DDL = PROJECTOR_DDL


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
