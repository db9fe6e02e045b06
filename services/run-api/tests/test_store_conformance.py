"""One conformance suite for the Catalog, SubmitLedger and ReadModel ports, run against the fakes and PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from tether_api.v1 import approval_service_pb2 as approvals_pb
from tether_contracts.records import AgentSpec, Caps, ModelRef, RiskClass, ToolSpec
from tether_projector.adapters.postgres import DDL as READ_MODEL_DDL
from tether_run_api import admin
from tether_run_api.adapters.postgres import PostgresStore, migrate, open_pool
from tether_run_api.adapters.read_model import PostgresReadModel
from tether_run_api.api.convert import approval_pb
from tether_run_api.domain.errors import (
    AgentAlreadyExists,
    AgentVersionConflict,
    Category,
    InvalidArgument,
    RequestIdReused,
    UnstorableValue,
)
from tether_run_api.domain.views import ApprovalView, RefusedDecisionView, Submission
from tether_run_api.ports import Idempotency
from tether_run_api.testing import FakeCatalog, FakeLedger, FakeReadModel


class FakeStore:
    """The fakes behind one object, shaped like PostgresStore for this suite."""

    def __init__(self) -> None:
        self.catalog = FakeCatalog()
        self.ledger = FakeLedger()

    def __getattr__(self, name: str):
        return getattr(self.catalog if hasattr(self.catalog, name) else self.ledger, name)

    def ensure_tenant(self, tenant_id: str, display_name: str | None = None, spread: int | None = None) -> int | None:
        previous = self.catalog.spreads.get(tenant_id)
        if spread is not None or previous is None:
            self.catalog.spreads[tenant_id] = spread or 1
        return previous


@pytest.fixture(params=["fake", pytest.param("postgres", marks=pytest.mark.integration)])
def store(request) -> Iterator[object]:
    if request.param == "fake":
        yield FakeStore()
        return
    dsn = request.getfixturevalue("pg_dsn")
    schema = f"run_api_conf_{uuid.uuid4().hex[:10]}"
    pool = open_pool(dsn, max_size=4)
    try:
        migrate(pool, schema)
        migrate(pool, schema)  # idempotent
        yield PostgresStore(pool, schema)
    finally:
        pool.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _refused_row(a: ApprovalView) -> Jsonb | None:
    """The projector's `refused_decision` column for the view (tether_projector.domain.project)."""
    r = a.refused_decision
    if r is None:
        return None
    return Jsonb({"approver_id": r.approver_id, "approve": r.approve, "comment": r.comment,
                  "decided_at_ms": r.decided_at_ms, "reason": r.reason, "seq": 9})


class ReadModelRows:
    """A ReadModel (the fake or the PostgreSQL one) and a way to store the projector's rows under it."""

    def __init__(self, read_model: object, add_approval) -> None:
        self.read_model = read_model
        self.add_approval = add_approval


@pytest.fixture(params=["fake", pytest.param("postgres", marks=pytest.mark.integration)])
def read_model(request) -> Iterator[ReadModelRows]:
    if request.param == "fake":
        fake = FakeReadModel()

        def add_fake(tenant_id: str, a: ApprovalView) -> None:
            fake.approvals[(tenant_id, a.approval_id)] = a

        yield ReadModelRows(fake, add_fake)
        return
    dsn = request.getfixturevalue("pg_dsn")
    schema = f"read_model_conf_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(READ_MODEL_DDL).format(s=sql.Identifier(schema)))
    pool = open_pool(dsn, max_size=2)

    def add_row(tenant_id: str, a: ApprovalView) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL(
                "INSERT INTO {}.approvals (approval_id, tenant_id, run_id, call_id, args_hash, status, "
                "requested_at_ms, expires_at_ms, refused_decision) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)").format(
                sql.Identifier(schema)),
                (a.approval_id, tenant_id, a.run_id, a.call_id, a.args_hash, a.status, a.requested_at_ms,
                 a.expires_at_ms, _refused_row(a)))

    try:
        yield ReadModelRows(PostgresReadModel(pool, schema), add_row)
    finally:
        pool.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def agent(agent_id: str = "a", version: int = 0, instructions: str = "x") -> AgentSpec:
    return AgentSpec(agent_id=agent_id, version=version, name="A", instructions=instructions,
                     model=ModelRef(provider="openai", name="m"), tool_allowlist=["t1", "t2"],
                     caps=Caps(max_steps=1, max_wall_clock_ms=2, max_tokens=3, max_cost_usd_micros=4))


def tool(name: str = "t1", description: str = "d") -> ToolSpec:
    return ToolSpec(name=name, version=0, description=description, args_schema_json='{"type":"object"}',
                    risk_class=RiskClass.WRITE, idempotent=True, untrusted_source=False, executor_kind="builtin")


def sub(tenant: str, request_id: str, run_id: str, request_hash: str = "h") -> Submission:
    return Submission(tenant_id=tenant, request_id=request_id, request_hash=request_hash, run_id=run_id,
                      principal_id="p", agent_id="a", agent_version=1, goal="g", partition=2, envelope=b"\x01\x02",
                      created_at_ms=5)


def test_agent_versions(store) -> None:
    v1 = store.create_agent("t", agent(), "root", 10, None)
    assert v1.spec.version == 1 and v1.created_by == "root"
    with pytest.raises(AgentAlreadyExists):
        store.create_agent("t", agent(), "root", 10, None)
    store.create_agent("other", agent(), "root", 10, None)  # ids are per tenant
    v2 = store.add_agent_version("t", agent(version=2, instructions="y"), "root", 11, None)
    assert v2.spec.instructions == "y"
    with pytest.raises(AgentVersionConflict):
        store.add_agent_version("t", agent(version=2, instructions="z"), "root", 12, None)
    assert store.get_agent("t", "a").spec.version == 2
    assert store.get_agent("t", "a", 1).spec.instructions == "x"
    assert store.get_agent("t", "a", 3) is None and store.get_agent("nobody", "a") is None
    got = store.get_agent("t", "a", 1)
    assert got.spec == v1.spec and got.created_at_ms == 10


def test_idempotent_creates_return_the_first_result(store) -> None:
    idem = Idempotency("req-1", "hash-1")
    first = store.create_agent("t", agent(), "root", 10, idem)
    assert store.create_agent("t", agent(), "root", 99, idem) == first
    with pytest.raises(RequestIdReused):
        store.create_agent("t", agent("b"), "root", 10, Idempotency("req-1", "hash-2"))
    t1 = store.register_tool("t", tool(), "root", 10, Idempotency("req-2", "h"))
    assert store.register_tool("t", tool(), "root", 10, Idempotency("req-2", "h")) == t1
    assert store.get_tool("t", "t1").spec.version == 1


def test_list_agents_returns_latest_versions_in_pages(store) -> None:
    for agent_id in ("c", "a", "b"):
        store.create_agent("t", agent(agent_id), "root", 1, None)
    store.add_agent_version("t", agent("b", 2, "new"), "root", 2, None)
    assert [(a.spec.agent_id, a.spec.version) for a in store.list_agents("t", None, 10)] == \
        [("a", 1), ("b", 2), ("c", 1)]
    assert [a.spec.agent_id for a in store.list_agents("t", "a", 1)] == ["b"]


def test_tools_versions_disable_and_latest_enabled(store) -> None:
    assert store.register_tool("t", tool(), "root", 1, None).spec.version == 1
    assert store.register_tool("t", tool(description="v2"), "root", 2, None).spec.version == 2
    store.register_tool("t", tool("t2"), "root", 3, None)
    assert store.disable_tool("t", "t1", 2) == [2]
    assert store.disable_tool("t", "t1", 2) == []
    assert store.disable_tool("t", "t1", 7) is None and store.disable_tool("t", "zz", None) is None
    latest = {t.spec.name: t.spec.version for t in store.latest_enabled_tools("t", ["t1", "t2", "t3"])}
    assert latest == {"t1": 1, "t2": 1}
    assert [(t.spec.name, t.disabled) for t in store.list_tools("t", None, 10, True)] == [("t1", True), ("t2", False)]
    assert [t.spec.name for t in store.list_tools("t", None, 10, False)] == ["t2"]
    assert store.disable_tool("t", "t1", None) == [1]
    assert [t.spec.name for t in store.latest_enabled_tools("t", ["t1", "t2"])] == ["t2"]
    assert store.latest_enabled_tools("other", ["t1"]) == []


def test_grants_and_spread(store) -> None:
    store.ensure_tenant("t", "", 3)
    store.grant("t", "*", ["a", "b"])
    store.grant("t", "alice", ["c"])
    assert store.grants_for("t", "alice") == ["a", "b", "c"]
    assert store.grants_for("t", "bob") == ["a", "b"]
    assert store.grants_for("other", "alice") == []
    assert store.tenant_spread("t") == 3 and store.tenant_spread("unknown") == 1
    # Re-creating a tenant without a spread (a repeated set-up) keeps it; the previous one is returned.
    assert store.ensure_tenant("t", "renamed") == 3 and store.tenant_spread("t") == 3
    assert store.ensure_tenant("t", None, 2) == 3 and store.tenant_spread("t") == 2
    assert store.ensure_tenant("new") is None and store.tenant_spread("new") == 1


def test_submit_ledger_claims_once_per_tenant_and_request(store) -> None:
    first = store.claim(sub("t", "r1", "RUN1"))
    assert first.run_id == "RUN1" and not first.delivered
    assert store.claim(sub("t", "r1", "RUN2")).run_id == "RUN1"
    assert store.claim(sub("u", "r1", "RUN3")).run_id == "RUN3"
    store.mark_delivered("t", "r1")
    assert store.get("t", "r1").delivered and store.get("t", "r1").envelope == b"\x01\x02"
    assert store.find_run("t", "RUN1").partition == 2
    assert store.find_run("u", "RUN1") is None and store.get("t", "nope") is None
    store.claim(sub("t", "r2", "RUN5"))
    store.claim(sub("t", "r3", "RUN4"))
    assert [s.run_id for s in store.list_runs("t", None, 10)] == ["RUN5", "RUN4", "RUN1"]
    assert [s.run_id for s in store.list_runs("t", "RUN5", 1)] == ["RUN4"]
    assert {s.run_id for s in store.undelivered(6, 10)} == {"RUN3", "RUN5", "RUN4"}  # RUN1 was delivered
    assert store.undelivered(5, 10) == []  # created at 5: not before 5


@pytest.mark.integration
def test_a_value_postgres_cannot_store_is_invalid_argument_not_internal(pg_dsn: str) -> None:
    # The backstop behind validation: psycopg's DataError (here a U+0000 in a text parameter,
    # which it refuses itself) becomes UnstorableValue, an INVALID_ARGUMENT refusal.
    schema = f"run_api_nul_{uuid.uuid4().hex[:10]}"
    pool = open_pool(pg_dsn, max_size=2)
    try:
        migrate(pool, schema)
        store = PostgresStore(pool, schema)
        with pytest.raises(UnstorableValue) as err:
            store.claim(replace(sub("t", "r1", "RUN1"), goal="find\x00things"))
        assert err.value.category is Category.INVALID_ARGUMENT and err.value.reason == "UNSTORABLE_VALUE"
        with pytest.raises(UnstorableValue):
            store.create_agent("t", agent(instructions="a\x00b"), "root", 10, None)
        # Also out of a column's range: a number, not a character.
        with pytest.raises(UnstorableValue) as err:
            store.create_agent("t", agent().model_copy(update={"caps": Caps(
                max_steps=2**40, max_wall_clock_ms=2, max_tokens=3, max_cost_usd_micros=4)}), "root", 10, None)
        assert err.value.metadata["sqlstate"] == "22003"
        assert store.find_run("t", "RUN1") is None and store.get_agent("t", "a") is None
    finally:
        pool.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_operator_text_with_a_nul_character_is_refused_before_the_store() -> None:
    untouched = object()  # any store call would fail: validation must refuse first
    with pytest.raises(InvalidArgument) as err:
        admin.issue_key(untouched, "acme", "ali\x00ce", ["member"], label="l\x00")  # type: ignore[arg-type]
    assert {v.field for v in err.value.violations} == {"principal_id", "label"}
    with pytest.raises(InvalidArgument):
        admin.create_tenant(untouched, "acme", display_name="A\x00")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        admin.grant_tools(untouched, "acme", "b\x00b", ["web_search"])  # type: ignore[arg-type]


def test_an_expired_approval_shows_the_decision_that_came_too_late(read_model: ReadModelRows) -> None:
    late = RefusedDecisionView(approver_id="bob", approve=True, comment="fine", decided_at_ms=1_000,
                               reason="DECISION_AFTER_EXPIRY")
    read_model.add_approval("t", ApprovalView("apr_1", "RUN1", "1.0", "a" * 64, "EXPIRED", requested_at_ms=1,
                                              expires_at_ms=1_500, refused_decision=late))
    read_model.add_approval("t", ApprovalView("apr_2", "RUN1", "1.1", "a" * 64, "EXPIRED", requested_at_ms=2,
                                              expires_at_ms=1_500))
    [first, second] = read_model.read_model.list_approvals("t", "EXPIRED", None, None, 10, 2_000)
    assert (first.refused_decision, second.refused_decision) == (late, None)
    pb = approval_pb(first, 2_000)
    assert (pb.status, pb.refused_decision.approver_id, pb.refused_decision.approve, pb.refused_decision.reason,
            pb.refused_decision.decide_time.ToMilliseconds()) == (
        approvals_pb.APPROVAL_STATUS_EXPIRED, "bob", True, "DECISION_AFTER_EXPIRY", 1_000)
    assert not approval_pb(second, 2_000).HasField("refused_decision")


def test_list_approvals_filters_on_the_effective_status(read_model: ReadModelRows) -> None:
    # The status a listing filters on is the one its rows show (ApprovalView.effective_status at now):
    # a stored PENDING past expires_at_ms is EXPIRED; at expires_at_ms, or with no expiry, it is PENDING.
    now = 1_700_000_000_000
    stored = {"late": ("PENDING", now - 1), "due": ("PENDING", now), "open": ("PENDING", None),
              "old": ("EXPIRED", now - 5000), "done": ("APPROVED", now - 1), "r2": ("PENDING", now - 1)}
    for i, (approval_id, (status, expires)) in enumerate(stored.items()):
        run_id = "RUN2" if approval_id == "r2" else "RUN1"
        read_model.add_approval("t", ApprovalView(approval_id, run_id, "1.0", "a" * 64, status,
                                                  requested_at_ms=i, expires_at_ms=expires))
    read_model.add_approval("u", ApprovalView("theirs", "RUN1", "1.0", "a" * 64, "PENDING", expires_at_ms=now - 1))
    rm = read_model.read_model

    def ids(status: str, run_id: str | None = None, after: tuple[int, str] | None = None, limit: int = 10):
        rows = rm.list_approvals("t", status, run_id, after, limit, now)
        assert {a.effective_status(now) for a in rows} <= {status}
        return [a.approval_id for a in rows]

    assert ids("PENDING") == ["due", "open"]
    assert ids("EXPIRED") == ["late", "old", "r2"]
    assert ids("EXPIRED", "RUN1") == ["late", "old"] and ids("EXPIRED", "RUN2") == ["r2"]
    assert ids("EXPIRED", after=(0, "late"), limit=1) == ["old"]
    assert ids("APPROVED") == ["done"] and ids("REJECTED") == []
    # The same rows a moment earlier: "late" and "r2" were still in time.
    assert [a.approval_id for a in rm.list_approvals("t", "PENDING", None, None, 10, now - 1)] == \
        ["late", "due", "open", "r2"]
