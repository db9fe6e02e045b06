"""Fixtures: the projector's adapters on the real PostgreSQL and Redis, isolated per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tether_projector.adapters.postgres import PostgresReadModel


@pytest.fixture
def pg_read_model(pg_dsn: str) -> Iterator[PostgresReadModel]:
    """A read model in a fresh schema (created by the adapter itself), dropped afterwards."""
    model = PostgresReadModel(pg_dsn, f"test_rm_{uuid.uuid4().hex[:12]}")
    model.ensure_schema()
    yield model
    model.drop_schema()
    model.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A unique key prefix; every key under it is deleted afterwards."""
    prefix = f"test-projector-{uuid.uuid4().hex[:12]}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        redis_client.delete(*keys)
