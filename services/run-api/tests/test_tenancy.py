"""Tenant limits at the door: lane shares, the approximate backlog check (TENANT_QUEUE_FULL + RetryInfo), QUEUED runs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace

import grpc
import psycopg
import pytest
from google.rpc import error_details_pb2
from psycopg import sql
from typer.testing import CliRunner

from tether_api.v1 import (
    agent_service_pb2 as agents_pb,
    agent_service_pb2_grpc as agents_grpc,
    run_service_pb2 as runs_pb,
    run_service_pb2_grpc as runs_grpc,
    types_pb2 as types_pb,
)
from tether_messaging.partitioner import home_partition, partition_for
from tether_messaging.serde import open_payload
from tether_projector.adapters.postgres import DDL as READ_MODEL_DDL
from tether_run_api import admin, handlers
from tether_run_api.adapters.backlog import PostgresTenantBacklog
from tether_run_api.adapters.postgres import PostgresStore, migrate, open_pool
from tether_run_api.api.server import start_server
from tether_run_api.api.servicers import Services
from tether_run_api.api.status import error_info
from tether_run_api.cli import main as cli
from tether_run_api.cli.client import CliError
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_MEMBER, Principal, hash_api_key
from tether_run_api.domain.errors import BackendUnavailable, InvalidArgument, TenantQueueFull
from tether_run_api.domain.tenancy import (
    SPLIT_LIMITS,
    AdmissionGate,
    TenantPolicy,
    lane_limits,
    lane_share,
    limits_below_spread,
)
from tether_run_api.domain.views import RunStatus, RunView, Submission
from tether_run_api.testing import (
    FakeApiKeys,
    FakeCatalog,
    FakeLedger,
    FakeLiveEvents,
    FakePublisher,
    FakeReadModel,
    FakeTenantBacklog,
)

# -- lane shares -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("total", "spread", "shares"), [
    (10, 1, [10]), (10, 3, [4, 3, 3]), (2, 4, [1, 1, 1, 1]), (0, 3, [0, 0, 0]), (7, 7, [1] * 7),
])
def test_a_total_is_split_over_the_spread_with_at_least_one_per_lane(total, spread, shares) -> None:
    assert [lane_share(total, spread, lane) for lane in range(spread)] == shares


def test_each_partition_of_the_spread_carries_its_lanes_share() -> None:
    policy = TenantPolicy(spread=3, max_concurrent_runs=10, max_queued_runs=100, spend_cap_usd_micros=5_000_000,
                          spend_window_ms=86_400_000, tokens_per_minute=90_000)
    home = home_partition("acme", 6)
    lanes = [lane_limits(policy, "acme", (home + i) % 6, 6) for i in range(3)]
    assert [x.max_concurrent_runs for x in lanes] == [4, 3, 3]
    assert [x.max_queued_runs for x in lanes] == [34, 33, 33]
    assert sum(x.spend_cap_usd_micros for x in lanes) == 5_000_000
    assert sum(x.tokens_per_minute for x in lanes) == 90_000
    assert {(x.spend_window_ms, x.spread) for x in lanes} == {(86_400_000, 3)}
    unlimited = lane_limits(TenantPolicy(), "acme", home, 6)
    assert (unlimited.max_concurrent_runs, unlimited.max_queued_runs, unlimited.spread) == (0, 0, 1)


def _lanes_of(policy: TenantPolicy, tenant: str, partitions: int) -> dict[int, object]:
    """The limits of every lane the tenant's runs are routed to (by partition)."""
    used = {partition_for(tenant, f"run-{r}", partitions, policy.lanes(partitions)) for r in range(500)}
    return {p: lane_limits(policy, tenant, p, partitions) for p in used}


@pytest.mark.parametrize("policy", [
    TenantPolicy(spread=4, max_concurrent_runs=2, max_queued_runs=8),  # stored before limits were checked
    TenantPolicy(spread=4, max_concurrent_runs=10, max_queued_runs=3),
    TenantPolicy(spread=4, max_concurrent_runs=10, spend_cap_usd_micros=1, spend_window_ms=60_000),
    TenantPolicy(spread=4, tokens_per_minute=2),
    TenantPolicy(spread=5, max_concurrent_runs=7, max_queued_runs=5, spend_cap_usd_micros=11, tokens_per_minute=9),
    TenantPolicy(spread=6, max_concurrent_runs=3),  # spread larger than the partition count below as well
])
def test_the_lanes_a_tenant_uses_add_up_to_each_of_its_totals(policy) -> None:
    lanes = _lanes_of(policy, "acme", 5)
    expected = policy.lanes(5)
    assert len(lanes) == expected and {x.spread for x in lanes.values()} == {expected}
    for name in SPLIT_LIMITS:
        assert sum(getattr(x, name) for x in lanes.values()) == getattr(policy, name), name


def test_a_stored_tenant_with_a_limit_below_its_spread_uses_fewer_lanes() -> None:
    assert TenantPolicy(spread=4, max_concurrent_runs=2, max_queued_runs=8).lanes(6) == 2
    assert TenantPolicy(spread=4, max_concurrent_runs=8, tokens_per_minute=3).lanes(6) == 3
    assert TenantPolicy(spread=4, max_concurrent_runs=4).lanes(6) == 4  # 0 = no limit does not count
    assert TenantPolicy(spread=4).lanes(3) == 3 and TenantPolicy(spread=4, max_queued_runs=1).lanes(6) == 1


def test_limits_below_the_spread_are_named_with_the_spread_and_the_minimum() -> None:
    bad = limits_below_spread(TenantPolicy(spread=4, max_concurrent_runs=2, max_queued_runs=4,
                                           spend_cap_usd_micros=3, spend_window_ms=1, tokens_per_minute=0))
    assert [(v.field, v.reason) for v in bad] == [("max_concurrent_runs", "LIMIT_BELOW_SPREAD"),
                                                  ("spend_cap_usd_micros", "LIMIT_BELOW_SPREAD")]
    assert "2 is below the tenant's spread 4" in bad[0].description and "minimum is 4" in bad[0].description
    assert limits_below_spread(TenantPolicy(spread=4, max_concurrent_runs=4, max_queued_runs=100)) == []


# -- the door's check ------------------------------------------------------------------------------


class Counter:
    """A TenantBacklog with a settable answer."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.reads = 0
        self.down = False

    def backlog(self, tenant_id: str, submitted_since_ms: int) -> int:
        self.reads += 1
        if self.down:
            raise BackendUnavailable("read model", "down")
        return self.value


POLICY = TenantPolicy(max_concurrent_runs=2, max_queued_runs=3)


def test_the_gate_refuses_at_capacity_and_counts_what_it_let_through_between_reads() -> None:
    gauge = Counter(3)
    gate = AdmissionGate(gauge, refresh_ms=1_000, retry_after_s=2.5)
    gate.admit("acme", POLICY, 0)
    gate.admit("acme", POLICY, 10)  # 3 read + 1 let through = 4 < 5
    with pytest.raises(TenantQueueFull) as err:
        gate.admit("acme", POLICY, 20)  # 5 = 2 running + 3 queued
    assert gauge.reads == 1
    assert err.value.retry_after_s == 2.5 and err.value.metadata == {"tenant_id": "acme", "backlog": "5", "limit": "5"}
    gauge.value = 1  # runs finished; the next read sees it
    gate.admit("acme", POLICY, 1_000)
    assert gauge.reads == 2


def test_tenants_are_counted_apart_and_unlimited_tenants_are_not_read() -> None:
    gauge = Counter(4)
    gate = AdmissionGate(gauge)
    gate.admit("acme", POLICY, 0)
    with pytest.raises(TenantQueueFull):
        gate.admit("acme", POLICY, 1)
    gauge.value = 0
    gate.admit("other", POLICY, 1)
    reads = gauge.reads
    for i in range(100):
        gate.admit("free", TenantPolicy(), i)
    assert gauge.reads == reads


def test_without_its_gauge_the_door_lets_submits_through() -> None:
    gauge = Counter(99)
    gauge.down = True
    seen: list[str] = []
    gate = AdmissionGate(gauge, on_unavailable=lambda tenant, exc: seen.append(tenant))
    gate.admit("acme", POLICY, 0)
    assert seen == ["acme"]


# -- the backlog gauge: one conformance suite for the fake and PostgreSQL -----------------------------


class FakeBacklogWorld:
    def __init__(self) -> None:
        self.read_model = FakeReadModel()
        self.ledger = FakeLedger()
        self.gauge = FakeTenantBacklog(self.read_model, self.ledger)

    def submitted(self, sub: Submission) -> None:
        self.ledger.claim(sub)

    def projected(self, tenant: str, run_id: str, status: str) -> None:
        self.read_model.runs[(tenant, run_id)] = RunView(run_id=run_id, status=_API_STATUS[status])


_API_STATUS = {"QUEUED": RunStatus.QUEUED, "ACCEPTED": RunStatus.RUNNING, "RUNNING": RunStatus.RUNNING,
               "WAITING_APPROVAL": RunStatus.WAITING, "COMPLETED": RunStatus.COMPLETED,
               "TERMINATED": RunStatus.TERMINATED, "REJECTED": RunStatus.REJECTED}


class PostgresBacklogWorld:
    def __init__(self, pool, run_api_schema: str, read_model_schema: str) -> None:
        self.pool = pool
        self.store = PostgresStore(pool, run_api_schema)
        self.read_model_schema = read_model_schema
        self.gauge = PostgresTenantBacklog(pool, run_api_schema, read_model_schema)

    def submitted(self, sub: Submission) -> None:
        self.store.claim(sub)

    def projected(self, tenant: str, run_id: str, status: str) -> None:
        with self.pool.connection() as conn:
            conn.execute(
                sql.SQL("INSERT INTO {}.runs (run_id, tenant_id, status, created_at_ms, updated_at_ms, last_seq, "
                        "last_hash, state) VALUES (%s, %s, %s, 0, 0, 1, '', '{{}}')").format(
                    sql.Identifier(self.read_model_schema)),
                (run_id, tenant, status),
            )


@pytest.fixture(params=["fake", pytest.param("postgres", marks=pytest.mark.integration)])
def backlog_world(request) -> Iterator[object]:
    if request.param == "fake":
        yield FakeBacklogWorld()
        return
    dsn = request.getfixturevalue("pg_dsn")
    tag = uuid.uuid4().hex[:10]
    run_api_schema, read_model_schema = f"run_api_backlog_{tag}", f"read_model_backlog_{tag}"
    pool = open_pool(dsn, max_size=2)
    try:
        migrate(pool, run_api_schema)
        world = PostgresBacklogWorld(pool, run_api_schema, read_model_schema)
        with pytest.raises(BackendUnavailable):  # no read model yet: the door must be told, not crash
            world.gauge.backlog("acme", 0)
        with pool.connection() as conn:
            conn.execute(sql.SQL(READ_MODEL_DDL).format(s=sql.Identifier(read_model_schema)))
        yield world
    finally:
        pool.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for schema in (run_api_schema, read_model_schema):
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _sub(tenant: str, n: int, created_at_ms: int) -> Submission:
    return Submission(tenant_id=tenant, request_id=f"req-{n}", request_hash="h", run_id=f"run-{tenant}-{n:03d}",
                      principal_id="p", agent_id="a", agent_version=1, goal="g", partition=0, envelope=b"x",
                      created_at_ms=created_at_ms)


def test_backlog_counts_open_projected_runs_and_recent_unprojected_submits(backlog_world) -> None:
    w = backlog_world
    for n, status in enumerate(["QUEUED", "ACCEPTED", "RUNNING", "WAITING_APPROVAL", "COMPLETED", "TERMINATED",
                                "REJECTED"]):
        w.submitted(_sub("acme", n, 1_000))
        w.projected("acme", f"run-acme-{n:03d}", status)
    w.submitted(_sub("acme", 50, 5_000))  # not projected yet, recent
    w.submitted(_sub("acme", 51, 100))  # not projected, older than the window: not counted
    w.submitted(_sub("other", 1, 5_000))
    w.projected("other", "run-other-002", "RUNNING")
    assert w.gauge.backlog("acme", 1_000) == 4 + 1
    assert w.gauge.backlog("other", 1_000) == 2
    assert w.gauge.backlog("nobody", 0) == 0


# -- submit: the command carries the lane's limits; the door refuses with RetryInfo ---------------

ADMIN_KEY = "tk_admin_" + "a" * 30
MEMBER_KEY = "tk_member_" + "b" * 30


def auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


@pytest.fixture
def api() -> Iterator[tuple[Services, runs_grpc.RunServiceStub, agents_grpc.AgentServiceStub]]:
    keys = FakeApiKeys()
    keys.keys[hash_api_key(ADMIN_KEY)] = Principal("acme", "root", frozenset({ROLE_ADMIN}))
    keys.keys[hash_api_key(MEMBER_KEY)] = Principal("acme", "alice", frozenset({ROLE_MEMBER}))
    catalog, ledger, read_model = FakeCatalog(), FakeLedger(), FakeReadModel()
    catalog.policies["acme"] = TenantPolicy(spread=2, max_concurrent_runs=2, max_queued_runs=2,
                                            tokens_per_minute=1_000)
    services = Services(
        keys=keys, catalog=catalog, ledger=ledger, read_model=read_model, live=FakeLiveEvents(),
        publisher=FakePublisher(), limiter=SubmitRateLimiter(1000, 1000), partitioning=handlers.Partitioning(6),
        admission=AdmissionGate(FakeTenantBacklog(read_model, ledger), retry_after_s=3.0),
    )
    server = start_server(services, port=0, workers=8, max_receive_message_bytes=256 * 1024)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        agents = agents_grpc.AgentServiceStub(channel)
        agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agents_pb.Agent(
            agent_id="helper", display_name="Helper", instructions="Help.",
            model=types_pb.ModelRef(provider="openai", name="m"),
            caps=types_pb.Caps(max_steps=5, max_wall_clock_ms=60_000, max_tokens=1000, max_cost_usd_micros=1000))),
            metadata=auth(ADMIN_KEY))
        yield services, runs_grpc.RunServiceStub(channel), agents
    finally:
        channel.close()
        server.stop(0)


def test_over_its_capacity_a_tenant_gets_resource_exhausted_with_retry_info(api) -> None:
    services, runs, _ = api
    ids = [runs.SubmitRun(runs_pb.SubmitRunRequest(request_id=f"r{i}", agent_id="helper", goal="g"),
                          metadata=auth(MEMBER_KEY)).run_id for i in range(4)]
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r4", agent_id="helper", goal="g"),
                       metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    info, details = error_info(err.value)
    assert info.reason == "TENANT_QUEUE_FULL" and info.metadata["limit"] == "4"
    [retry] = [d for d in details if isinstance(d, error_details_pb2.RetryInfo)]
    assert retry.retry_delay.ToMilliseconds() == 3_000
    # A retry of an accepted submit is still answered (idempotency comes before the check).
    again = runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r0", agent_id="helper", goal="g"),
                           metadata=auth(MEMBER_KEY))
    assert again.run_id == ids[0]
    # Every command carries the limits of its run's lane (spread 2: half of each total).
    published = services.publisher.published
    assert len(published) == 4
    for envelope, partition in published:
        limits = open_payload(envelope).tenant_limits
        lane = (partition - home_partition("acme", 6)) % 6
        assert lane in (0, 1) and limits.spread == 2
        assert (limits.max_concurrent_runs, limits.max_queued_runs, limits.tokens_per_minute) == (1, 1, 500)


def test_a_stored_tenant_with_a_cap_below_its_spread_is_not_given_more_than_its_cap(api) -> None:
    # Stored before the admin use case checked limits against the spread: spread 4, cap 2. Its
    # runs go to 2 lanes of 1 slot each, not 4 lanes of "at least 1" (which would be 4 slots).
    services, runs, _ = api
    services.catalog.policies["acme"] = TenantPolicy(spread=4, max_concurrent_runs=2, max_queued_runs=8)
    for i in range(10):
        runs.SubmitRun(runs_pb.SubmitRunRequest(request_id=f"s{i}", agent_id="helper", goal="g"),
                       metadata=auth(MEMBER_KEY))
    lanes: dict[int, tuple[int, int, int]] = {}
    for envelope, partition in services.publisher.published:
        limits = open_payload(envelope).tenant_limits
        lanes[(partition - home_partition("acme", 6)) % 6] = (limits.max_concurrent_runs, limits.max_queued_runs,
                                                              limits.spread)
    assert set(lanes) == {0, 1}
    assert sorted(lanes.values()) == [(1, 4, 2), (1, 4, 2)]


def test_a_cancel_of_a_run_not_in_the_ledger_goes_to_the_lanes_its_submit_used() -> None:
    catalog, ledger, read_model, publisher = FakeCatalog(), FakeLedger(), FakeReadModel(), FakePublisher()
    catalog.policies["acme"] = TenantPolicy(spread=4, max_concurrent_runs=2)
    run_ids = [f"01J{n:023d}" for n in range(20)]
    for run_id in run_ids:  # restored from elsewhere: the read model has them, this ledger does not
        read_model.runs[("acme", run_id)] = RunView(run_id=run_id, status=RunStatus.RUNNING)
        handlers.cancel_run(run_id, "", principal=Principal("acme", "alice", frozenset({ROLE_MEMBER})), now_ms=1,
                            read_model=read_model, ledger=ledger, publisher=publisher,
                            partitioning=handlers.Partitioning(6), catalog=catalog)
    assert [p for _, p in publisher.published] == [partition_for("acme", r, 6, 2) for r in run_ids]


def test_a_queued_run_reads_as_queued(api) -> None:
    services, runs, _ = api
    run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="q1", agent_id="helper", goal="g"),
                            metadata=auth(MEMBER_KEY)).run_id
    services.read_model.runs[("acme", run_id)] = RunView(run_id=run_id, status=RunStatus.QUEUED, goal="g")
    run = runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=auth(MEMBER_KEY)).run
    assert run.status == runs_pb.RUN_STATUS_QUEUED


def test_tenant_limits_are_validated_by_the_admin_use_case() -> None:
    store = LimitsStore()
    admin.set_tenant_limits(store, "acme", TenantPolicy(max_concurrent_runs=5, max_queued_runs=50))
    assert store.saved["acme"].max_queued_runs == 50
    with pytest.raises(InvalidArgument) as err:
        admin.set_tenant_limits(store, "acme", TenantPolicy(max_concurrent_runs=-1, max_queued_runs=3))
    assert [v.field for v in err.value.violations] == ["max_concurrent_runs", "max_queued_runs"]
    with pytest.raises(InvalidArgument):
        admin.set_tenant_limits(store, "ghost", TenantPolicy(max_concurrent_runs=1))


class LimitsStore:
    """The store calls of the tenant use cases, for tenant acme only."""

    def __init__(self, spread: int = 1) -> None:
        self.spread = spread
        self.saved: dict[str, TenantPolicy] = {}

    def tenant_spread(self, tenant_id: str) -> int:
        return self.spread if tenant_id == "acme" else 1

    def tenant_policy(self, tenant_id: str) -> TenantPolicy:
        return replace(self.saved.get(tenant_id, TenantPolicy()), spread=self.tenant_spread(tenant_id))

    def ensure_tenant(self, tenant_id: str, display_name: str | None = None, spread: int | None = None) -> int:
        previous = self.spread
        if spread is not None:
            self.spread = spread
        return previous

    def set_tenant_limits(self, tenant_id: str, policy: TenantPolicy) -> bool:
        if tenant_id != "acme":
            return False
        self.saved[tenant_id] = policy
        return True


def test_limits_below_the_tenants_spread_are_refused() -> None:
    store = LimitsStore(spread=4)
    with pytest.raises(InvalidArgument) as err:
        admin.set_tenant_limits(store, "acme", TenantPolicy(max_concurrent_runs=2, max_queued_runs=8,
                                                             tokens_per_minute=3))
    assert [(v.field, v.reason) for v in err.value.violations] == [("max_concurrent_runs", "LIMIT_BELOW_SPREAD"),
                                                                   ("tokens_per_minute", "LIMIT_BELOW_SPREAD")]
    assert err.value.reason == "INVALID_ARGUMENT" and err.value.metadata == {
        "fields": "max_concurrent_runs,tokens_per_minute"}
    assert "spread 4" in err.value.message and "minimum is 4" in err.value.message
    assert store.saved == {}
    # The policy's own spread is not the tenant's: the stored one counts.
    with pytest.raises(InvalidArgument):
        admin.set_tenant_limits(store, "acme", TenantPolicy(spread=1, max_concurrent_runs=2))
    admin.set_tenant_limits(store, "acme", TenantPolicy(max_concurrent_runs=4, max_queued_runs=0,
                                                        spend_cap_usd_micros=0, tokens_per_minute=4))
    assert store.saved["acme"].max_concurrent_runs == 4


def test_a_spread_above_the_tenants_limits_is_refused() -> None:
    store = LimitsStore(spread=1)
    admin.set_tenant_limits(store, "acme", TenantPolicy(max_concurrent_runs=3, max_queued_runs=6))
    with pytest.raises(InvalidArgument) as err:
        admin.create_tenant(store, "acme", spread=4)
    [violation] = err.value.violations
    assert (violation.field, violation.reason) == ("max_concurrent_runs", "LIMIT_BELOW_SPREAD")
    assert "3 is below the tenant's spread 4" in violation.description
    assert store.spread == 1
    admin.create_tenant(store, "acme", spread=3)
    assert store.spread == 3
    admin.create_tenant(store, "new", spread=8)  # no limits yet


def test_the_admin_cli_refuses_a_limit_below_the_spread_with_its_exit_code(monkeypatch) -> None:
    store = LimitsStore(spread=4)
    monkeypatch.setattr(cli, "_store", lambda: store)
    result = CliRunner().invoke(cli.app, ["admin", "tenant-limits", "acme", "--max-concurrent-runs", "2"])
    assert isinstance(result.exception, CliError) and result.exception.exit_code == cli.EXIT_INVALID_ARGUMENT
    message = str(result.exception)
    assert message.startswith("INVALID_ARGUMENT: ") and "max_concurrent_runs: 2 is below the tenant's spread 4" in message
    assert "minimum is 4" in message and store.saved == {}
    result = CliRunner().invoke(cli.app, ["admin", "tenant-limits", "acme", "--max-concurrent-runs", "4"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli.app, ["admin", "create-tenant", "acme", "--spread", "5"])
    assert isinstance(result.exception, CliError) and result.exception.exit_code == cli.EXIT_INVALID_ARGUMENT
    assert "max_concurrent_runs: 4 is below the tenant's spread 5" in str(result.exception) and store.spread == 4


@pytest.mark.integration
def test_the_catalog_stores_tenant_limits(pg_dsn: str) -> None:
    schema = f"run_api_limits_{uuid.uuid4().hex[:10]}"
    pool = open_pool(pg_dsn, max_size=2)
    try:
        migrate(pool, schema)
        store = PostgresStore(pool, schema)
        admin.create_tenant(store, "acme", spread=3)
        assert store.tenant_policy("acme") == TenantPolicy(spread=3)
        policy = TenantPolicy(spread=3, max_concurrent_runs=7, max_queued_runs=70, spend_cap_usd_micros=9,
                              spend_window_ms=60_000, tokens_per_minute=1_000)
        with pytest.raises(InvalidArgument):  # below the stored spread
            admin.set_tenant_limits(store, "acme", replace(policy, max_concurrent_runs=2))
        admin.set_tenant_limits(store, "acme", policy)
        with pytest.raises(InvalidArgument):  # a spread above a stored limit
            admin.create_tenant(store, "acme", spread=8)
        admin.create_tenant(store, "acme", spread=3)  # re-creating (bootstrap-demo does) keeps the limits
        migrate(pool, schema)  # and so does a second migration
        assert store.tenant_policy("acme") == policy
        assert store.tenant_policy("nobody") == TenantPolicy()
    finally:
        pool.close()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))

