"""Tenancy on the real system: a flooding tenant does not delay a quiet one, and many concurrent runs stay bounded.

Both tests run against one system of their own (six services, the scripted model with no
latency, instant kv_put tools) with tenants created here with limits (docs/tenancy.md).

The load test's size is a parameter: TETHER_E2E_LOAD_RUNS (default 2,000, what fits the CI
time budget on a 2-core machine) and TETHER_E2E_LOAD_CONCURRENT (the tenant's concurrency cap,
default 200); `TETHER_E2E_LOAD_RUNS=10000 pytest tests/e2e/test_tenancy.py -k load` runs the
issue's 10,000 (about 7 minutes here; its time limit grows with the size).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psycopg
import pytest
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import Envelope
from tether_messaging.chain import verify_chain
from tether_messaging.partitioner import home_partition
from tether_messaging.serde import decode_envelope
from tether_run_api.api.status import error_info
from tether_run_api.domain.tenancy import TenantPolicy
from tether_testing.system import ApiClient, SystemConfig, TetherSystem

pytestmark = pytest.mark.e2e

PARTITIONS = 2
SCENARIOS = Path(__file__).parent / "scenarios"
GOAL = "[scenario:tenancy-two-steps] note it"
STEPS_PER_RUN = 2
#: The flooding tenant's concurrency cap; its queue takes the whole flood.
FLOOD_CAP = 8
TERMINAL = {runs_pb.RUN_STATUS_COMPLETED, runs_pb.RUN_STATUS_TERMINATED, runs_pb.RUN_STATUS_REJECTED}
OPEN_STATUSES = ("QUEUED", "ACCEPTED", "RUNNING", "WAITING_APPROVAL", "OUTCOME_UNKNOWN")
SERVICES = ("run-api", "budget", "planner", "tool-gateway", "approval", "projector")


@pytest.fixture(scope="module")
def system(kafka_bootstrap: str, pg_dsn: str, redis_url: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TetherSystem]:
    """A system of its own: the per-replica submit rate limiter out of the way (the tenant limits are tested)."""
    run_api_env = {"TETHER_RUN_API_SUBMIT_RATE_PER_S": "100000", "TETHER_RUN_API_SUBMIT_BURST": "100000"}
    system = TetherSystem(SystemConfig(
        kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, redis_url=redis_url,
        workdir=tmp_path_factory.mktemp("tenancy-system"), partitions=PARTITIONS, scenarios=[SCENARIOS],
        extra_env={"run-api": run_api_env},
    ))
    try:
        system.start()
        yield system
    finally:
        system.stop()
        system.drop_data()


# -- helpers -------------------------------------------------------------------------------------


def add_tenant(system: TetherSystem, tenant_id: str, policy: TenantPolicy) -> tuple[ApiClient, ApiClient]:
    """A tenant with the demo agent and tools and its limits; clients with its member and approver keys."""
    from tether_run_api import admin
    from tether_run_api.adapters.postgres import PostgresStore, open_pool
    from tether_tool_gateway.builtin_tools import builtin_tool_specs

    tools = builtin_tool_specs(kv_url=system.sink_urls["kv"], smtp_host="127.0.0.1", smtp_port=system.smtp_port,
                               email_from="tenancy@localhost", http_allow_hosts=["127.0.0.1"])
    model = system.config.model
    agent = admin.demo_agent_spec(model.provider, model.name, [t.name for t in tools])
    pool = open_pool(system.config.pg_dsn, max_size=2)
    try:
        store = PostgresStore(pool, system.names.run_api_schema)
        setup = admin.bootstrap_demo(store, tenant_id=tenant_id, principal_id=f"{tenant_id}-user",
                                     approver_id=f"{tenant_id}-approver", tools=tools, agent=agent,
                                     now_ms=time.time_ns() // 1_000_000)
        admin.set_tenant_limits(store, tenant_id, policy)
    finally:
        pool.close()
    if setup.key is None or setup.approver_key is None:
        raise AssertionError(f"no keys issued for {tenant_id}")
    return (ApiClient(system.address, setup.key.api_key, timeout_s=60),
            ApiClient(system.address, setup.approver_key.api_key, timeout_s=60))


def tenant_on_home(prefix: str, home: int) -> str:
    """The first tenant id `prefix-N` whose home partition is `home` (to make two tenants share a lane)."""
    return next(f"{prefix}-{n}" for n in range(1000) if home_partition(f"{prefix}-{n}", PARTITIONS) == home)


@dataclass
class Submitted:
    """What a batch of submits got: run ids, and refusals by gRPC code and reason."""

    run_ids: list[str] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)


def submit_one(client: ApiClient) -> tuple[str, str]:
    """('OK', run_id) or (gRPC code, ErrorInfo reason). UNAVAILABLE is retried with the same request id (safe)."""
    request = runs_pb.SubmitRunRequest(request_id=str(uuid.uuid4()), agent_id="demo", goal=GOAL)
    for attempt in range(10):
        try:
            return "OK", client.runs.SubmitRun(request, metadata=client.metadata, timeout=60).run_id
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.UNAVAILABLE and attempt < 9:
                time.sleep(0.2 * (attempt + 1))
                continue
            info, _ = error_info(err)
            return err.code().name, info.reason if info is not None else (err.details() or "")
    raise AssertionError("unreachable")


def submit_many(client: ApiClient, n: int, threads: int = 16) -> Submitted:
    out = Submitted()
    with ThreadPoolExecutor(threads) as pool:
        for code, value in pool.map(lambda _: submit_one(client), range(n)):
            if code == "OK":
                out.run_ids.append(value)
            elif code == "RESOURCE_EXHAUSTED":
                out.refused[value] += 1
            else:
                out.failed[f"{code} {value}"] += 1
    return out


def wait_terminal(client: ApiClient, run_id: str, timeout_s: float = 300) -> runs_pb.Run:
    deadline = time.monotonic() + timeout_s
    while True:
        run = client.get_run(run_id)
        if run.status in TERMINAL:
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} still {runs_pb.RunStatus.Name(run.status)} after {timeout_s}s")
        time.sleep(0.1)


def tenant_statuses(system: TetherSystem, tenant_id: str) -> Counter:
    """The tenant's runs by read-model status."""
    with psycopg.connect(system.config.pg_dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT status, count(*) FROM {}.runs WHERE tenant_id = %s GROUP BY status")
                            .format(sql.Identifier(system.names.read_model_schema)), (tenant_id,)).fetchall()
    return Counter({status: count for status, count in rows})


def wait_drained(system: TetherSystem, tenant_id: str, expected: int, timeout_s: float) -> Counter:
    """Wait until the read model shows `expected` runs of the tenant, none of them open."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = tenant_statuses(system, tenant_id)
        if sum(statuses.values()) >= expected and not any(statuses[s] for s in OPEN_STATUSES):
            return statuses
        if time.monotonic() > deadline:
            raise AssertionError(f"tenant {tenant_id} not drained after {timeout_s}s: {dict(statuses)}")
        time.sleep(0.5)


def read_log(system: TetherSystem, timeout_s: float = 120) -> dict[str, list[Envelope]]:
    """Every committed run event, by run, read from offset 0 as an auditor would."""
    topic = system.names.topics.run_events
    consumer = Consumer({"bootstrap.servers": system.config.kafka_bootstrap, "group.id": f"{topic}.tenancy-audit",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    runs: dict[str, list[Envelope]] = {}
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < PARTITIONS:
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic} not read to its end in {timeout_s}s")
            for msg in consumer.consume(1000, timeout=0.5):
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        done.add(msg.partition())
                        continue
                    raise AssertionError(msg.error().str())
                env = decode_envelope(msg.value())
                runs.setdefault(env.run_id, []).append(env)
    finally:
        consumer.close()
    return runs


def types(events: list[Envelope]) -> list[str]:
    return [e.event_type.removeprefix("tether.v1.") for e in events]


# -- fairness -----------------------------------------------------------------------------------------


@dataclass
class Phase:
    flood: int
    submitted: Submitted
    b_run: str
    b_status: int
    a_steps_during_b: int
    a_steps_total: int
    a_admitted_after_b: int
    b_latency_s: float


def run_phase(system: TetherSystem, flood: int, home: int) -> tuple[Phase, ApiClient, list[str]]:
    """Tenant A floods `flood` runs, then tenant B (same home partition: one lane) submits one run."""
    a_id, b_id = tenant_on_home(f"flood{flood}", home), tenant_on_home(f"quiet{flood}", home)
    a, _ = add_tenant(system, a_id, TenantPolicy(max_concurrent_runs=FLOOD_CAP, max_queued_runs=2 * flood))
    b, _ = add_tenant(system, b_id, TenantPolicy(max_concurrent_runs=FLOOD_CAP, max_queued_runs=2 * flood))
    try:
        submitted = submit_many(a, flood)
        b_submitted_ms = time.time_ns() // 1_000_000
        started = time.monotonic()
        code, b_run = submit_one(b)
        assert code == "OK", (code, b_run)
        b_final = wait_terminal(b, b_run)
        b_latency_s = time.monotonic() - started
        log = read_log(system)
    finally:
        b.close()
    b_end = log[b_run][-1].recorded_at_ms
    a_grants = [e for r in submitted.run_ids for e in log.get(r, []) if e.event_type == "tether.v1.StepGranted"]
    phase = Phase(
        flood=flood,
        submitted=submitted,
        b_run=b_run,
        b_status=b_final.status,
        a_steps_during_b=sum(1 for e in a_grants if b_submitted_ms <= e.recorded_at_ms <= b_end),
        a_steps_total=flood * STEPS_PER_RUN,
        a_admitted_after_b=sum(1 for r in submitted.run_ids for e in log.get(r, [])
                               if e.event_type == "tether.v1.RunAccepted" and e.recorded_at_ms > b_end),
        b_latency_s=b_latency_s,
    )
    assert verify_chain(log[b_run]) == [] and types(log[b_run])[-1] == "RunCompleted"
    return phase, a, submitted.run_ids


def test_a_flooding_tenant_does_not_delay_a_quiet_tenant_on_the_same_lane(system: TetherSystem) -> None:
    # Both tenants share one home partition (the worst case with spread 1): B's records queue
    # in the same Kafka partitions as A's flood. What keeps B fast is the budget's tenant queue
    # (A's backlog waits there, not in the partition) and the fair work queue of every loop.
    home = 0
    small, a_small, a_small_runs = run_phase(system, 100, home)
    a_small.close()
    wait_drained(system, tenant_on_home("flood100", home), 100, timeout_s=300)
    big, a_big, a_big_runs = run_phase(system, 1_000, home)
    report = {p.flood: {"accepted": len(p.submitted.run_ids), "refused": dict(p.submitted.refused),
                        "a_steps_during_b": p.a_steps_during_b, "a_admitted_after_b": p.a_admitted_after_b,
                        "b_latency_s": round(p.b_latency_s, 2)} for p in (small, big)}
    print("tenancy fairness:", json.dumps(report))

    for p in (small, big):
        assert not p.submitted.failed, p.submitted.failed
        assert len(p.submitted.run_ids) + sum(p.submitted.refused.values()) == p.flood
        assert p.b_status == runs_pb.RUN_STATUS_COMPLETED
    assert len(big.submitted.run_ids) == 1_000  # the queue took the whole flood
    # B did not wait for A's backlog: A still had queued runs that were admitted after B ended.
    assert big.a_admitted_after_b > 0, report
    # B's cost, counted in A's steps done while B was in the system, does not grow with the
    # flood: ten times the flood, and B still saw no more than a bound set by A's concurrency
    # cap (each of B's two steps waits at most a few rounds of A's eight running runs), far
    # below A's 2,000 steps. (Not compared with the small flood's number: the two are measured
    # minutes apart on a machine busier in the big phase, and that ratio failed on noise alone;
    # the report prints both.)
    one_round = FLOOD_CAP * STEPS_PER_RUN
    assert big.a_steps_during_b <= 6 * one_round, report
    assert small.a_steps_during_b <= 6 * one_round, report

    # Leave nothing running for the next test: cancel A's flood (queued runs end at once).
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda run_id: _cancel(a_big, run_id), a_big_runs))
    a_big.close()
    wait_drained(system, tenant_on_home("flood1000", home), 1_000, timeout_s=300)


def _cancel(client: ApiClient, run_id: str) -> None:
    try:
        client.runs.CancelRun(runs_pb.CancelRunRequest(run_id=run_id), metadata=client.metadata, timeout=60)
    except grpc.RpcError as err:
        if err.code() is not grpc.StatusCode.FAILED_PRECONDITION:  # RUN_ALREADY_FINISHED
            raise


# -- load: many concurrent runs held ------------------------------------------------------------------

LOAD_RUNS = int(os.environ.get("TETHER_E2E_LOAD_RUNS", "2000"))
HELD_GOAL = "[scenario:tenancy-held] report it"
#: Inputs of each service's consumer group (docs/architecture.md).
GROUP_INPUTS = {"budget": ("commands", "run_intake"), "planner": ("run_events",), "tool-gateway": ("run_events",),
                "approval": ("run_events", "commands"), "projector": ("run_events",)}


def rss_mb(system: TetherSystem) -> dict[str, float]:
    """Resident memory of each service process, MB."""
    out = {}
    for name in SERVICES:
        with open(f"/proc/{system.processes[name].pid}/status") as fh:
            kb = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        out[name] = round(kb / 1024, 1)
    return out


class MemoryWatch:
    """Samples the services' RSS about once a second in the background; keeps each one's peak."""

    def __init__(self, system: TetherSystem) -> None:
        import threading

        self.system = system
        self.peak: dict[str, float] = rss_mb(system)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for name, mb in rss_mb(self.system).items():
                self.peak[name] = max(self.peak[name], mb)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def unconsumed_records(system: TetherSystem) -> dict[str, int]:
    """Per consumer group: committed records on its inputs after its committed offsets (its lag,
    counted in records, so transaction markers do not count)."""
    topics = system.names.topics
    admin = AdminClient({"bootstrap.servers": system.config.kafka_bootstrap})
    consumer = Consumer({"bootstrap.servers": system.config.kafka_bootstrap, "group.id": f"{topics.prefix}lag-audit",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    lag: dict[str, int] = {}
    try:
        for service, inputs in GROUP_INPUTS.items():
            group = topics.group_id(service)
            wanted = [TopicPartition(getattr(topics, t), p) for t in inputs for p in range(PARTITIONS)]
            found = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, wanted)])[group].result()
            starts = [TopicPartition(tp.topic, tp.partition, max(tp.offset, 0)) for tp in found.topic_partitions]
            consumer.assign(starts)
            pending, count = {(tp.topic, tp.partition) for tp in starts}, 0
            deadline = time.monotonic() + 60
            while pending and time.monotonic() < deadline:
                for msg in consumer.consume(1000, timeout=0.5):
                    if msg.error():
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            pending.discard((msg.topic(), msg.partition()))
                        continue
                    count += 1
            consumer.unassign()
            lag[service] = count if not pending else -1
    finally:
        consumer.close()
    return lag


def wait_for(what: str, check, timeout_s: float, interval_s: float = 1.0):
    """Poll `check` until it returns a truthy value (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached after {timeout_s:.0f}s")
        time.sleep(interval_s)


def pending_approvals(client: ApiClient) -> list[tuple[str, str]]:
    from tether_api.v1 import approval_service_pb2 as approvals_pb

    out, token = [], ""
    while True:
        page = client.approvals.ListApprovals(approvals_pb.ListApprovalsRequest(page_size=500, page_token=token),
                                              metadata=client.metadata, timeout=60)
        out += [(a.approval_id, a.args_hash) for a in page.approvals]
        token = page.next_page_token
        if not token:
            return out


def submit_held(client: ApiClient) -> tuple[str, str]:
    request = runs_pb.SubmitRunRequest(request_id=str(uuid.uuid4()), agent_id="demo", goal=HELD_GOAL)
    for attempt in range(10):
        try:
            return "OK", client.runs.SubmitRun(request, metadata=client.metadata, timeout=60).run_id
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.UNAVAILABLE and attempt < 9:
                time.sleep(0.2 * (attempt + 1))
                continue
            info, _ = error_info(err)
            return err.code().name, info.reason if info is not None else (err.details() or "")
    raise AssertionError("unreachable")


# pytest's default 600 s fits the default size; the 10,000 takes ~7 minutes here, longer on a busy machine.
@pytest.mark.timeout(max(600, LOAD_RUNS // 3))
def test_many_concurrent_runs_stay_bounded_and_overload_is_resource_exhausted(system: TetherSystem) -> None:
    # Every run asks for an approval in step 1 and parks there (holding no thread), so the runs
    # stay in the system until the test approves them: half of the submits fill the tenant's
    # slots, a quarter its queue, and the last quarter is overload whatever the machine's speed.
    n = LOAD_RUNS
    cap, queue = n // 2, n // 4
    tenant = "load"
    client, approver = add_tenant(system, tenant, TenantPolicy(max_concurrent_runs=cap, max_queued_runs=queue))
    baseline = rss_mb(system)
    watch = MemoryWatch(system)
    started = time.monotonic()
    try:
        submitted = Submitted()
        with ThreadPoolExecutor(16) as pool:
            for code, value in pool.map(lambda _: submit_held(client), range(n)):
                if code == "OK":
                    submitted.run_ids.append(value)
                elif code == "RESOURCE_EXHAUSTED":
                    submitted.refused[value] += 1
                else:
                    submitted.failed[f"{code} {value}"] += 1
        submit_s = time.monotonic() - started

        # Held: every slot parked on its approval, the queue full, nothing left to consume.
        def held() -> Counter | None:
            statuses = tenant_statuses(system, tenant)
            settled = statuses["WAITING_APPROVAL"] == cap and statuses["QUEUED"] == queue
            return statuses if settled and sum(statuses.values()) == len(submitted.run_ids) else None

        held_statuses = wait_for("all slots parked and the queue full", held, timeout_s=900)
        held_s = time.monotonic() - started
        held_lag = wait_for("consumer lag recovered while held",
                            lambda: (lag := unconsumed_records(system)) and all(v == 0 for v in lag.values()) and lag,
                            timeout_s=300)
        held_rss = rss_mb(system)

        # Released: approve in waves until every accepted run has completed.
        decided: set[str] = set()

        def drained() -> Counter | None:
            fresh = [a for a in pending_approvals(approver) if a[0] not in decided]
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda a: approver.decide(a[0], a[1], approve=True), fresh))
            decided.update(a for a, _ in fresh)
            statuses = tenant_statuses(system, tenant)
            return statuses if not any(statuses[s] for s in OPEN_STATUSES) else None

        final_statuses = wait_for("every accepted run completed", drained, timeout_s=1800, interval_s=2.0)
        drain_s = time.monotonic() - started
        final_lag = wait_for("consumer lag recovered after the drain",
                             lambda: (lag := unconsumed_records(system)) and all(v == 0 for v in lag.values()) and lag,
                             timeout_s=300)
    finally:
        peak = watch.stop()
        client.close()
        approver.close()
    final_rss = rss_mb(system)
    rejected = final_statuses["REJECTED"]
    report = {
        "runs": n, "cap": cap, "queue": queue, "accepted_by_api": len(submitted.run_ids),
        "refused_at_door": dict(submitted.refused), "rejected_by_budget": rejected,
        "held": dict(held_statuses), "final": dict(final_statuses), "approvals": len(decided),
        "submit_s": round(submit_s, 1), "held_after_s": round(held_s, 1), "drained_after_s": round(drain_s, 1),
        "rss_mb": {"baseline": baseline, "held": held_rss, "peak": peak, "final": final_rss},
        "lag_held": held_lag, "lag_final": final_lag,
    }
    print("tenancy load:", json.dumps(report))

    # Overload showed as RESOURCE_EXHAUSTED (or, for the race the door cannot see, the budget's
    # RunRejected TENANT_QUEUE_FULL), never as a failure; exactly the overload was refused.
    assert not submitted.failed, report
    assert set(submitted.refused) <= {"TENANT_QUEUE_FULL"}, report
    assert sum(submitted.refused.values()) + rejected == n - cap - queue, report
    assert final_statuses["COMPLETED"] == cap + queue and set(final_statuses) <= {"COMPLETED", "REJECTED"}, report
    assert len(decided) == cap + queue
    # Memory stays bounded: what the held runs cost each service is small per run (they hold no
    # thread and no work; their state is a ledger/fold entry), not a leak of the whole run.
    for name in SERVICES:
        growth = peak[name] - baseline[name]
        assert growth <= 64 + 0.1 * (cap + queue), (name, growth, report)  # 100 KB per held run, 64 MB slack

