"""A harness driving the gateway processor in memory: fake executor, fake ledger, in-memory blobs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalOutcome,
    Caps,
    ModelRef,
    Remaining,
    RunAccepted,
    ToolCall,
    ToolCallBudgeted,
    ToolCallRequested,
    ToolSpec,
)
from tether_messaging.blobstore import InMemoryBlobStore
from tether_messaging.envelopes import make_envelope
from tether_messaging.serde import decode
from tether_messaging.testing import InMemoryDriver
from tether_messaging.topics import Topics
from tether_tool_gateway.builtin_tools import builtin_tool_specs
from tether_tool_gateway.domain.canonical import canonical_json, idem_key_for, sha256_hex
from tether_tool_gateway.domain.policy import Policy, TrustPolicy
from tether_tool_gateway.domain.policy_document import parse_policy
from tether_tool_gateway.domain.results import ResultLimits
from tether_tool_gateway.entrypoint import GatewayProcessor
from tether_tool_gateway.execution import ToolRunner
from tether_tool_gateway.handlers import Deps
from tether_tool_gateway.ledger import Owner
from tether_tool_gateway.ports import ExecutionRequest, Executor, SecretProvider
from tether_tool_gateway.testing import InMemoryLedger, InMemoryRateLimiter

TOPICS = Topics()
OWNER = Owner("tool-gateway-0", "boot-1")


class FakeExecutor(Executor):
    """Records every request; answers with `behaviour(request)` (default: echo the args)."""

    def __init__(self) -> None:
        self.requests: list[ExecutionRequest] = []
        self.behaviour: Callable[[ExecutionRequest], Any] = lambda r: {"ok": True, "args": r.args}

    def execute(self, request: ExecutionRequest, secrets: SecretProvider) -> Any:
        self.requests.append(request)
        self.secrets = secrets  # what the runner handed over (behaviours may resolve from it)
        return self.behaviour(request)


def default_tools() -> list[ToolSpec]:
    return builtin_tool_specs(kv_url="http://127.0.0.1:1", smtp_host="127.0.0.1", smtp_port=1,
                              email_from="agent@tether.test", http_allow_hosts=["127.0.0.1"])


@dataclass
class Call:
    run_id: str
    step: int
    call_index: int
    tool_name: str
    args_json: str

    @property
    def call_id(self) -> str:
        return f"{self.step}.{self.call_index}"

    @property
    def idem_key(self) -> str:
        return idem_key_for(self.run_id, self.step, self.call_index)

    @property
    def args_hash(self) -> str:
        return sha256_hex(self.args_json)


@dataclass
class Harness:
    tools: list[ToolSpec] = field(default_factory=default_tools)
    limits: ResultLimits = field(default_factory=ResultLimits)
    ledger: InMemoryLedger = field(default_factory=InMemoryLedger)
    owner: Owner = OWNER
    #: A policy document (JSON text), or None for the built-in default.
    policy_json: str | None = None
    #: The runner's secret provider and redactor (None: none known, nothing redacted).
    secrets: Any = None
    redactor: Any = None

    def __post_init__(self) -> None:
        self.executor = FakeExecutor()
        self.blobs = InMemoryBlobStore()
        # The limiter's clock follows the driver's, so tests move one clock.
        self.limiter = InMemoryRateLimiter(clock_ms=lambda: self.driver.now_ms)
        self.runner = ToolRunner(ledger=self.ledger, executors={"builtin": self.executor}, blobs=self.blobs,
                                 owner=self.owner, limits=self.limits, lease_ms=60_000, heartbeat_ms=20,
                                 limiter=self.limiter, secrets=self.secrets, redactor=self.redactor)
        self.policy: Policy = TrustPolicy() if self.policy_json is None else TrustPolicy(parse_policy(self.policy_json))
        self.processor = GatewayProcessor(Deps(topics=TOPICS, policy=self.policy, runner=self.runner,
                                               recheck_ms=1_000, stall_ms=60_000), sweep_interval_ms=5_000)
        self.driver = InMemoryDriver(self.processor, producer_name="budget")
        self.fed: list = []  # every envelope fed as the run event log, in order

    def feed(self, payload, run_id: str = "run-1", tenant_id: str = "t1"):
        env = make_envelope(payload, run_id=run_id, tenant_id=tenant_id, event_id=f"budget:{run_id}:{len(self.fed)}",
                            producer="budget", recorded_at_ms=self.driver.now_ms)
        return self._append(env)

    def log(self, emitted):
        """Feed the gateway's own outputs back as the sequenced log would (budget appends them)."""
        out = []
        for e in emitted:
            out.extend(self._append(e.envelope))
        return out

    def _append(self, env):
        seq = sum(1 for e in self.fed if e.run_id == env.run_id) + 1
        env = env.model_copy(update={"seq": seq})
        self.fed.append(env)
        return self.driver.feed(TOPICS.run_events, env)

    def run_log(self, run_id: str = "run-1"):
        """The run's log as fed so far: (envelope, payload) in sequence order."""
        return [(e, decode(e.payload)) for e in self.fed if e.run_id == run_id]

    def accept(self, run_id: str = "run-1", grants: list[str] | None = None, allowlist: list[str] | None = None,
               *, goal: str = "g", scope: list[str] | None = None, agent_id: str = "a1", tenant_id: str = "t1"):
        names = [t.name for t in self.tools]
        caps = Caps(max_steps=10, max_wall_clock_ms=600_000, max_tokens=100_000, max_cost_usd_micros=1_000_000)
        agent = AgentSpec(agent_id=agent_id, version=1, name="agent", instructions="be useful",
                          model=ModelRef(provider="openai", name="m"),
                          tool_allowlist=names if allowlist is None else allowlist, caps=caps)
        return self.feed(RunAccepted(principal_id="p1", request_id="r1", goal=goal, agent=agent, tools=self.tools,
                                     caps=caps, tenant_grants=names if grants is None else grants,
                                     delegated_scope=scope, deadline_ms=self.driver.now_ms + 600_000),
                         run_id, tenant_id=tenant_id)

    def request(self, tool_name: str, args: Any, *, run_id: str = "run-1", step: int = 1, call_index: int = 0,
                args_json: str | None = None, provenance_json: str = "{}") -> Call:
        call = Call(run_id, step, call_index, tool_name, canonical_json(args) if args_json is None else args_json)
        self.feed(ToolCallRequested(step=step, call=ToolCall(call_id=call.call_id, call_index=call_index,
                                                             idem_key=call.idem_key, tool_name=tool_name,
                                                             args_json=call.args_json, args_hash=call.args_hash),
                                    provenance_json=provenance_json),
                  run_id)
        return call

    def budget(self, call: Call):
        remaining = Remaining(steps=5, tokens=1000, cost_usd_micros=1000, wall_clock_ms=1000)
        return self.feed(ToolCallBudgeted(step=call.step, call_id=call.call_id, idem_key=call.idem_key,
                                          remaining=remaining), call.run_id)

    def decide(self, call: Call, approval_id: str, outcome: ApprovalOutcome, *, args_hash: str | None = None,
               decided_at_ms: int | None = None, approver: str = "alice", comment: str = ""):
        return self.feed(ApprovalDecided(approval_id=approval_id, call_id=call.call_id,
                                         args_hash=call.args_hash if args_hash is None else args_hash,
                                         outcome=outcome, approver_id=approver, comment=comment,
                                         decided_at_ms=self.driver.now_ms if decided_at_ms is None else decided_at_ms),
                         call.run_id)

    def call_state(self, call: Call):
        return self.driver.states[call.run_id].calls[call.call_id]


@pytest.fixture
def gw():
    h = Harness()
    yield h
    h.runner.close()


@pytest.fixture
def make_harness():
    made: list[Harness] = []

    def make(**kw) -> Harness:
        h = Harness(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.runner.close()


@pytest.fixture
def release():
    """An event blocked executors wait on; set at teardown so no thread outlives the test."""
    ev = threading.Event()
    yield ev
    ev.set()
