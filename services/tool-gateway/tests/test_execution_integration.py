"""Execution against real PostgreSQL (ledger, blobs) and the dev services as separate processes.

Effects are counted where they land: in the KV store's and the SMTP sink's record files.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalOutcome,
    ApprovalRequested,
    Caps,
    ModelRef,
    Remaining,
    RunAccepted,
    ToolCall,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallRequested,
)
from tether_devservices.process import spawn
from tether_messaging.blobstore import PostgresBlobStore
from tether_messaging.testing import InMemoryDriver
from tether_messaging.topics import Topics
from tether_tool_gateway.builtin_tools import http_get_spec, kv_put_spec, send_email_spec
from tether_tool_gateway.domain.canonical import canonical_json, idem_key_for, sha256_hex
from tether_tool_gateway.domain.errors import ToolError
from tether_tool_gateway.domain.policy import TrustPolicy
from tether_tool_gateway.entrypoint import GatewayProcessor
from tether_tool_gateway.execution import Completed, Failed, Pending, ToolRunner, Unknown, tool_spec_json
from tether_tool_gateway.executors.builtin import BuiltinExecutor
from tether_tool_gateway.handlers import Deps
from tether_tool_gateway.ledger import Busy, Execute, Intent, Owner, ResolutionStatus
from tether_tool_gateway.ledger.postgres import PostgresLedger
from tether_tool_gateway.ports import ExecutionRequest, MappingSecretProvider

pytestmark = pytest.mark.integration


@pytest.fixture
def kv(tmp_path):
    with spawn("kv", tmp_path / "kv.jsonl") as svc:
        yield svc


@pytest.fixture
def smtp(tmp_path):
    with spawn("smtp", tmp_path / "smtp.jsonl") as svc:
        yield svc


@pytest.fixture
def http(tmp_path):
    with spawn("http", tmp_path / "http.jsonl") as svc:
        yield svc


@pytest.fixture
def pg(pg_schema):
    """make(owner) → a runner for one "gateway instance": its own pool, the shared schema."""
    from psycopg_pool import ConnectionPool

    made: list[tuple[ConnectionPool, ToolRunner]] = []

    def make(owner: Owner, *, lease_ms: int = 30_000, heartbeat_ms: int = 10_000,
             executors: dict | None = None) -> ToolRunner:
        pool = ConnectionPool(pg_schema.base_dsn, min_size=1, max_size=4, open=True)
        ledger = PostgresLedger(pool, schema=pg_schema.name)
        ledger.ensure_schema()
        blobs = PostgresBlobStore(pool, schema=pg_schema.name)
        blobs.ensure_schema()
        runner = ToolRunner(ledger=ledger, executors={"builtin": BuiltinExecutor(), **(executors or {})},
                            blobs=blobs, owner=owner, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms)
        made.append((pool, runner))
        return runner

    yield make
    for pool, runner in made:
        runner.close()
        pool.close()


def make_intent(tool, args, *, run_id="run-1", step=1, call_index=0, partition=0) -> Intent:
    args_json = canonical_json(args)
    return Intent(idem_key=idem_key_for(run_id, step, call_index), run_id=run_id, tenant_id="t1",
                  partition=partition, step=step, call_id=f"{step}.{call_index}", tool_name=tool.name,
                  args_json=args_json, args_hash=sha256_hex(args_json), tool_spec_json=tool_spec_json(tool),
                  idempotent=tool.idempotent)


GW0 = Owner("tool-gateway-0", "boot-1")
GW0_REBORN = Owner("tool-gateway-0", "boot-2")


def applied(records):
    return [r for r in records if r.get("applied")]


# -- the five durability stories --------------------------------------------------------------
def test_a_tool_is_executed_once(pg, kv):
    runner = pg(GW0)
    tool = kv_put_spec(kv.url)
    intent = make_intent(tool, {"key": "once", "value": 1})
    first = runner.run(intent, tool)
    again = runner.run(intent, tool)
    assert isinstance(first, Completed) and not first.replayed
    assert isinstance(again, Completed) and again.replayed and again.result_json == first.result_json
    assert len(kv.records()) == 1 and len(applied(kv.records())) == 1


def test_replay_after_a_crash_with_intent_and_result_does_not_re_execute(pg, kv):
    tool = kv_put_spec(kv.url)
    intent = make_intent(tool, {"key": "crash", "value": 2})
    assert isinstance(pg(GW0).run(intent, tool), Completed)
    # The process died after recording the result but before its outputs were committed:
    # the next incarnation handles the same call again.
    replay = pg(GW0_REBORN).run(intent, tool)
    assert isinstance(replay, Completed) and replay.replayed
    assert len(kv.records()) == 1


def test_intent_without_result_idempotent_kv_put_re_runs_with_the_same_key_one_effect(pg, kv):
    tool = kv_put_spec(kv.url)
    intent = make_intent(tool, {"key": "k1", "value": {"v": 3}})
    dead = pg(GW0)
    claim = dead.ledger.claim(intent, GW0, 30_000)
    assert isinstance(claim, Execute)
    # The effect happened, then the process died before writing the result.
    httpx.put(f"{kv.url}/kv/t1%2Fk1", json={"value": {"v": 3}},  # the tenant's key, as the executor sends it
              headers={"Idempotency-Key": intent.idem_key})
    outcome = pg(GW0_REBORN).run(intent, tool)
    assert isinstance(outcome, Completed) and not outcome.replayed
    assert json.loads(outcome.result_json) == {"key": "k1", "version": 1, "deduplicated": True}
    recs = kv.records()
    assert [r["idempotency_key"] for r in recs] == [intent.idem_key] * 2  # two attempts arrived ...
    assert len(applied(recs)) == 1  # ... one effect
    assert dead.ledger.get(intent.idem_key).attempt == 2


def test_intent_without_result_non_idempotent_email_is_outcome_unknown_and_not_resent(pg, smtp):
    tool = send_email_spec(smtp.host, smtp.port, "agent@tether.test")
    intent = make_intent(tool, {"to": "ops@example.test", "subject": "s", "body": "b"})
    dead = pg(GW0)
    dead.ledger.claim(intent, GW0, 30_000)
    BuiltinExecutor().execute(ExecutionRequest(tool, json.loads(intent.args_json), intent.idem_key, "run-1", "t1", "1.0", 1,
                                      10.0), MappingSecretProvider())  # sent, then the process died
    outcome = pg(GW0_REBORN).run(intent, tool)
    assert isinstance(outcome, Unknown)
    again = pg(Owner("tool-gateway-1", "b")).run(intent, tool)
    assert isinstance(again, Unknown)
    assert len(smtp.records()) == 1
    assert dead.ledger.get(intent.idem_key).resolution.status is ResolutionStatus.OUTCOME_UNKNOWN


def test_two_racing_sweeps_have_one_winner_per_call(pg, kv):
    tool = kv_put_spec(kv.url)
    intents = [make_intent(tool, {"key": f"s{i}", "value": i}, call_index=i) for i in range(12)]
    dead = pg(Owner("tool-gateway-9", "gone"))
    for intent in intents:
        dead.ledger.claim(intent, dead.owner, 0)  # leases already expired: the instance is gone
    one, two = pg(Owner("tool-gateway-1", "b1")), pg(Owner("tool-gateway-2", "b2"))
    barrier = threading.Barrier(2)

    def recover(runner):
        barrier.wait()
        outcomes = []
        while True:
            swept = runner.sweep(0, limit=3)
            if not swept.to_resume and not swept.resolved:
                return outcomes
            outcomes += [runner.resume(claim) for claim in swept.to_resume]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(recover, [one, two]))
    done = [o for outcomes in results for o in outcomes]
    assert sorted(o.call.call_id for o in done) == sorted(i.call_id for i in intents)
    assert all(isinstance(o, Completed) and not o.replayed for o in done)
    recs = kv.records()
    assert len(recs) == 12 and len(applied(recs)) == 12  # each key written by exactly one winner


# -- failure details ---------------------------------------------------------------------------
class FailsWith:
    """An executor whose tool fails (after `delay_s`) with the given detail."""

    def __init__(self, detail: str, delay_s: float = 0.0) -> None:
        self.detail = detail
        self.delay_s = delay_s
        self.calls = 0

    def execute(self, request, secrets):
        self.calls += 1
        time.sleep(self.delay_s)
        raise ToolError("TOOL_ERROR", self.detail, retryable=False)


# PostgreSQL text holds no NUL, and UTF-8 cannot encode a lone surrogate (a JSON "\ud800" decodes to one).
@pytest.mark.parametrize("detail,stored", [
    ("HTTP 500: boom\x00evil", "HTTP 500: boom\\u0000evil"),
    ("the MCP tool reported an error: \ud800", "the MCP tool reported an error: \ufffd"),
])
def test_a_failure_detail_postgres_cannot_store_as_is_resolves_the_call_once_as_failed(pg, detail, stored):
    failing = FailsWith(detail)
    runner = pg(GW0, executors={"failing": failing})
    tool = kv_put_spec("http://127.0.0.1:1").model_copy(update={"executor_kind": "failing"})
    intent = make_intent(tool, {"key": "k", "value": 1})
    first = runner.run(intent, tool)
    assert isinstance(first, Failed) and first.error_code == "TOOL_ERROR" and first.detail == stored
    again = pg(GW0_REBORN, executors={"failing": failing}).run(intent, tool)
    assert isinstance(again, Failed) and again.detail == stored
    assert failing.calls == 1  # resolved once: the replay did not execute again
    resolution = runner.ledger.get(intent.idem_key).resolution
    assert resolution.status is ResolutionStatus.FAILED and resolution.detail == stored


class Returns:
    def __init__(self, value) -> None:
        self.value = value

    def execute(self, request, secrets):
        return self.value


def test_a_result_with_a_nul_or_a_lone_surrogate_is_stored_as_json(pg):
    runner = pg(GW0, executors={"returns": Returns({"a": "x\x00y", "b": "z\ud800"})})
    tool = kv_put_spec("http://127.0.0.1:1").model_copy(update={"executor_kind": "returns"})
    intent = make_intent(tool, {"key": "k", "value": 1})
    outcome = runner.run(intent, tool)
    assert isinstance(outcome, Completed) and json.loads(outcome.result_json) == {"a": "x\x00y", "b": "z\ufffd"}
    assert runner.ledger.get(intent.idem_key).resolution.result_json == outcome.result_json


def test_a_late_failure_with_nul_is_kept_as_the_late_resolution(pg):
    runner = pg(GW0, executors={"failing": FailsWith("HTTP 500: boom\x00evil", delay_s=0.5)})
    tool = send_email_spec("127.0.0.1", 1, "agent@tether.test").model_copy(
        update={"executor_kind": "failing", "timeout_ms": 100})
    intent = make_intent(tool, {"to": "ops@example.test", "subject": "s", "body": "b"})
    outcome = runner.run(intent, tool)
    # send_email is not idempotent and its execution was left running: unknown, not a failure.
    assert isinstance(outcome, Unknown) and "left running" in outcome.detail
    assert runner.ledger.get(intent.idem_key).resolution.status is ResolutionStatus.OUTCOME_UNKNOWN
    deadline = time.monotonic() + 10
    while (late := runner.ledger.get(intent.idem_key).late_resolution) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert late is not None and late.detail == "HTTP 500: boom\\u0000evil"


# -- more of the boundary ---------------------------------------------------------------------
def test_large_result_is_stored_as_a_claim_check_in_postgres(pg, http):
    runner = pg(GW0)
    tool = http_get_spec(["127.0.0.1"], max_body_bytes=300_000)
    outcome = runner.run(make_intent(tool, {"url": f"{http.url}/huge/200000"}), tool)
    assert isinstance(outcome, Completed) and outcome.result_json is None and outcome.untrusted
    page = json.loads(runner.blobs.get(outcome.result_ref.sha256))
    assert len(page["body"]) == 200_000


def test_slow_execution_heartbeats_its_lease(pg, http):
    # Lease and heartbeat wide enough that a starved heartbeat thread on a loaded machine still
    # renews in time; the answer late enough that the checks below run while the call is in flight.
    runner = pg(GW0, lease_ms=3_000, heartbeat_ms=300)
    other = pg(Owner("tool-gateway-1", "b"), lease_ms=3_000)
    tool = http_get_spec(["127.0.0.1"], timeout_ms=40_000)
    intent = make_intent(tool, {"url": f"{http.url}/slow/8000"})
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(runner.run, intent, tool)
        while not http.records():  # the request is in flight
            time.sleep(0.02)
        time.sleep(4.0)  # longer than one lease: only heartbeats keep it
        assert isinstance(other.ledger.claim(intent, other.owner, 3_000), Busy)
        assert isinstance(other.run(intent, tool), Pending)
        outcome = running.result(timeout=30)
    assert isinstance(outcome, Completed)
    assert len(http.records()) == 1


def test_gateway_processor_end_to_end_with_real_adapters(pg, kv, smtp):
    """Decisions through the processor, executions through PostgreSQL and the dev services."""
    runner = pg(GW0)
    processor = GatewayProcessor(Deps(topics=Topics(), policy=TrustPolicy(), runner=runner))
    driver = InMemoryDriver(processor, producer_name="budget")
    tools = [kv_put_spec(kv.url), send_email_spec(smtp.host, smtp.port, "agent@tether.test")]
    names = [t.name for t in tools]
    caps = Caps(max_steps=5, max_wall_clock_ms=60_000, max_tokens=1000, max_cost_usd_micros=1000)
    agent = AgentSpec(agent_id="a", version=1, name="a", instructions="", model=ModelRef(provider="openai", name="m"),
                      tool_allowlist=names, caps=caps)

    def feed(payload):
        return driver.feed_payload(Topics().run_events, payload, run_id="run-e2e", producer="budget")

    feed(RunAccepted(principal_id="p", request_id="r", goal="g", agent=agent, tools=tools, caps=caps,
                     tenant_grants=names, deadline_ms=driver.now_ms + 60_000))
    remaining = Remaining(steps=1, tokens=1, cost_usd_micros=1, wall_clock_ms=1)
    calls = []
    for i, (name, args) in enumerate([("kv_put", {"key": "e2e", "value": "v"}),
                                      ("send_email", {"to": "x@y.test", "subject": "s", "body": "b"})]):
        args_json = canonical_json(args)
        idem = idem_key_for("run-e2e", 1, i)
        feed(ToolCallRequested(step=1, call=ToolCall(call_id=f"1.{i}", call_index=i, idem_key=idem, tool_name=name,
                                                     args_json=args_json, args_hash=sha256_hex(args_json))))
        calls.append((f"1.{i}", idem, sha256_hex(args_json)))
    # An allowed call: the gateway records its go (ToolCallAuthorized) and starts the work.
    (authorized,) = [e.payload for e in feed(ToolCallBudgeted(step=1, call_id="1.0", idem_key=calls[0][1],
                                                              remaining=remaining))]
    assert isinstance(authorized, ToolCallAuthorized) and authorized.call_id == "1.0"
    (req,) = [e.payload for e in feed(ToolCallBudgeted(step=1, call_id="1.1", idem_key=calls[1][1],
                                                       remaining=remaining))]
    assert isinstance(req, ApprovalRequested)
    (put_done,) = [e.payload for e in driver.run_work()]
    assert isinstance(put_done, ToolCallCompleted)
    feed(ApprovalDecided(approval_id=req.approval_id, call_id="1.1", args_hash=calls[1][2],
                         outcome=ApprovalOutcome.APPROVED, approver_id="alice", decided_at_ms=driver.now_ms))
    (mail_done,) = [e.payload for e in driver.run_work()]
    assert isinstance(mail_done, ToolCallCompleted)
    assert len(applied(kv.records())) == 1 and len(smtp.records()) == 1
