"""UpdateAgent retried with a version precondition: the stored request is replayed before the precondition
is checked, against the fake catalog and real PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from tether_run_api import handlers
from tether_run_api.adapters.postgres import PostgresStore, migrate, open_pool
from tether_run_api.domain.auth import ROLE_ADMIN, Principal
from tether_run_api.domain.catalog import AgentDraft, CapsDraft, CatalogLimits
from tether_run_api.domain.errors import AgentVersionConflict, RequestIdReused
from tether_run_api.ports import Idempotency
from tether_run_api.testing import FakeCatalog

ROOT = Principal("acme", "root", frozenset({ROLE_ADMIN}))


@pytest.fixture(params=["fake", pytest.param("postgres", marks=pytest.mark.integration)])
def catalog(request) -> Iterator[object]:
    if request.param == "fake":
        yield FakeCatalog()
        return
    dsn = request.getfixturevalue("pg_dsn")
    schema = f"run_api_replay_{uuid.uuid4().hex[:10]}"
    pool = open_pool(dsn, max_size=2)
    try:
        migrate(pool, schema)
        yield PostgresStore(pool, schema)
    finally:
        pool.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def draft(instructions: str) -> AgentDraft:
    return AgentDraft(agent_id="helper", display_name="Helper", instructions=instructions, model_provider="openai",
                      model_name="m", tool_allowlist=("t1",),
                      caps=CapsDraft(max_steps=5, max_wall_clock_ms=60_000, max_tokens=10_000,
                                     max_cost_usd_micros=100_000))


def update(catalog, instructions: str, expected: int, request_id: str, now_ms: int = 20):
    return handlers.update_agent(draft(instructions), ["instructions"], expected, request_id, principal=ROOT,
                                 now_ms=now_ms, catalog=catalog, limits=CatalogLimits())


def test_a_retried_update_with_a_precondition_returns_its_first_answer(catalog) -> None:
    handlers.create_agent(draft("v1"), "", principal=ROOT, now_ms=10, catalog=catalog, limits=CatalogLimits())
    first = update(catalog, "v2", 1, "upd-1")
    assert first.spec.version == 2
    # The first answer was lost; the client retries the very same request (based on version 1).
    again = update(catalog, "v2", 1, "upd-1", now_ms=99)
    assert again == first
    assert catalog.get_agent("acme", "helper").spec.version == 2  # nothing stored twice


def test_a_reused_request_id_with_another_body_is_request_id_reused_not_a_conflict(catalog) -> None:
    handlers.create_agent(draft("v1"), "", principal=ROOT, now_ms=10, catalog=catalog, limits=CatalogLimits())
    update(catalog, "v2", 1, "upd-1")
    with pytest.raises(RequestIdReused):
        update(catalog, "something else", 1, "upd-1")
    # A new request based on the stale version is still a conflict.
    with pytest.raises(AgentVersionConflict):
        update(catalog, "v3", 1, "upd-2")


def test_replayed_agent_is_none_for_a_new_request_and_the_stored_version_for_a_known_one(catalog) -> None:
    idem = Idempotency("create-1", "h1")
    assert catalog.replayed_agent("acme", "CreateAgent", idem) is None
    created = handlers.create_agent(draft("v1"), "", principal=ROOT, now_ms=10, catalog=catalog,
                                    limits=CatalogLimits())
    stored = catalog.create_agent("acme", created.spec.model_copy(update={"agent_id": "other"}), "root", 11, idem)
    assert catalog.replayed_agent("acme", "CreateAgent", idem) == stored
    assert catalog.replayed_agent("acme", "UpdateAgent", idem) is None  # per operation
    assert catalog.replayed_agent("other-tenant", "CreateAgent", idem) is None  # per tenant
    with pytest.raises(RequestIdReused):
        catalog.replayed_agent("acme", "CreateAgent", Idempotency("create-1", "h2"))
