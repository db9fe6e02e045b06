"""A harness around the budget processor on the in-memory driver, speaking the run protocol."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tether_budget.domain.decisions import AdmissionPolicy, Retention, idem_key
from tether_budget.domain.ledger import Ledger
from tether_budget.domain.loopguard import LoopGuard
from tether_budget.domain.tenancy import TenantLedger, tenant_key
from tether_budget.entrypoint import BudgetProcessor
from tether_budget.handlers import Deps
from tether_budget.metrics import BudgetMetrics
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalOutcome,
    ApprovalRequested,
    CancelRun,
    Caps,
    Envelope,
    ModelCallCompleted,
    ModelCallFailed,
    ModelRef,
    RiskClass,
    RunCompleted,
    SubmitRun,
    TenantLimits,
    ToolCall,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
    ToolSpec,
    Usage,
)
from tether_messaging.chain import verify_chain
from tether_messaging.envelopes import derived_id, make_envelope
from tether_messaging.serde import decode
from tether_messaging.testing import Emitted, InMemoryDriver
from tether_messaging.topics import COMMANDS, RUN_EVENTS, RUN_INTAKE, Topics

MODEL = ModelRef(provider="openai", name="gpt-test")


def tool(name: str, *, pollable: bool = False, idempotent: bool = True) -> ToolSpec:
    return ToolSpec(
        name=name,
        version=1,
        description=name,
        args_schema_json="{}",
        risk_class=RiskClass.READ_ONLY,
        idempotent=idempotent,
        untrusted_source=False,
        executor_kind="builtin",
        pollable=pollable,
    )


def caps(**over: int) -> Caps:
    values = dict(max_steps=10, max_wall_clock_ms=600_000, max_tokens=100_000, max_cost_usd_micros=1_000_000)
    values.update(over)
    return Caps(**values)


class Harness:
    """Drives one budget processor; planner/gateway/approval records are made like theirs."""

    caps = staticmethod(caps)
    tool = staticmethod(tool)

    def __init__(self, retention: Retention | None = None) -> None:
        self.registry = CollectorRegistry()
        self.deps = Deps(
            topics=Topics(),
            policy=AdmissionPolicy(),
            guard=LoopGuard(),
            retention=retention or Retention(ended_ledger_ms=60_000, tombstone_ms=600_000),
            metrics=BudgetMetrics(self.registry),
        )
        self.driver = InMemoryDriver(BudgetProcessor(self.deps))
        self.calls: dict[tuple[str, str], ToolCall] = {}

    # -- commands --------------------------------------------------------------------------
    def submit(self, run_id: str = "r1", *, tenant: str = "t1", principal: str = "alice", request_id: str | None = None,
               run_caps: Caps | None = None, tools: list[ToolSpec] | None = None, event_id: str | None = None,
               limits: TenantLimits | None = None) -> list[AvroRecord]:
        cmd = SubmitRun(
            request_id=request_id or f"req-{run_id}",
            principal_id=principal,
            goal="find a cheap flight",
            agent=AgentSpec(agent_id="a1", version=1, name="agent", instructions="be useful", model=MODEL,
                            tool_allowlist=["search", "fetch", "job_status"], caps=caps()),
            tools=tools if tools is not None else [tool("search"), tool("fetch"), tool("job_status", pollable=True)],
            caps=run_caps or caps(),
            tenant_grants=["search", "fetch", "job_status"],
            tenant_limits=limits,
        )
        return self.send(COMMANDS, cmd, run_id, tenant=tenant, event_id=event_id or derived_id(run_id, "SubmitRun"),
                         producer="run-api")

    def cancel(self, run_id: str = "r1", *, tenant: str = "t1", principal: str = "alice") -> list[AvroRecord]:
        return self.send(COMMANDS, CancelRun(principal_id=principal, reason="changed my mind"), run_id, tenant=tenant,
                         event_id=derived_id(run_id, "CancelRun", principal), producer="run-api")

    # -- planner ---------------------------------------------------------------------------
    def model(self, step: int, k: int, run_id: str = "r1", *, tokens: int = 100, cost: int = 1_000,
              text: str | None = None) -> list[AvroRecord]:
        ev = ModelCallCompleted(step=step, model=MODEL, usage=Usage(input_tokens=tokens // 2, output_tokens=tokens - tokens // 2,
                                cost_usd_micros=cost), assistant_text=text, tool_call_count=k,
                                finish_reason="tool_calls" if k else "stop", latency_ms=5)
        return self.intake(ev, run_id, what=("ModelCallCompleted", step), producer="planner")

    def model_failed(self, step: int, code: str, run_id: str = "r1") -> list[AvroRecord]:
        ev = ModelCallFailed(step=step, error_code=code, detail="boom", attempts=3, usage=Usage(input_tokens=10))
        return self.intake(ev, run_id, what=("ModelCallFailed", step), producer="planner")

    def request(self, step: int, index: int, run_id: str = "r1", *, tool_name: str = "search",
                args: dict | None = None) -> list[AvroRecord]:
        args_json = json.dumps(args if args is not None else {"q": f"s{step}c{index}"}, sort_keys=True, separators=(",", ":"))
        call = ToolCall(call_id=f"{step}.{index}", call_index=index, idem_key=idem_key(run_id, step, index),
                        tool_name=tool_name, args_json=args_json, args_hash=hashlib.sha256(args_json.encode()).hexdigest())
        self.calls[(run_id, call.call_id)] = call
        return self.intake(ToolCallRequested(step=step, call=call), run_id, what=("ToolCallRequested", call.call_id),
                           producer="planner")

    def complete(self, run_id: str = "r1", *, step: int = 1) -> list[AvroRecord]:
        return self.intake(RunCompleted(step=step, answer="done", usage=Usage()), run_id, what=("RunCompleted",),
                           producer="planner")

    # -- gateway / approval ----------------------------------------------------------------
    def _call(self, run_id: str, call_id: str) -> ToolCall:
        return self.calls[(run_id, call_id)]

    def done(self, call_id: str, run_id: str = "r1", *, result: str = '{"ok": true}') -> list[AvroRecord]:
        c = self._call(run_id, call_id)
        ev = ToolCallCompleted(step=int(call_id.split(".")[0]), call_id=call_id, idem_key=c.idem_key,
                               tool_name=c.tool_name, result_json=result, duration_ms=3)
        return self.intake(ev, run_id, what=("ToolCallCompleted", call_id), producer="tool-gateway")

    def failed(self, call_id: str, run_id: str = "r1", *, code: str = "TOOL_ERROR") -> list[AvroRecord]:
        c = self._call(run_id, call_id)
        ev = ToolCallFailed(step=int(call_id.split(".")[0]), call_id=call_id, idem_key=c.idem_key, tool_name=c.tool_name,
                            error_code=code, detail="it broke", retryable=True)
        return self.intake(ev, run_id, what=("ToolCallFailed", call_id), producer="tool-gateway")

    def denied(self, call_id: str, run_id: str = "r1", *, reason: str = "TOOL_NOT_ALLOWED") -> list[AvroRecord]:
        c = self._call(run_id, call_id)
        ev = ToolCallDenied(step=int(call_id.split(".")[0]), call_id=call_id, idem_key=c.idem_key, tool_name=c.tool_name,
                            reason_code=reason, detail="not for you", policy_version="p1", inputs_hash="0" * 64)
        return self.intake(ev, run_id, what=("ToolCallDenied", call_id), producer="tool-gateway")

    def unknown(self, call_id: str, run_id: str = "r1") -> list[AvroRecord]:
        c = self._call(run_id, call_id)
        ev = ToolCallOutcomeUnknown(step=int(call_id.split(".")[0]), call_id=call_id, idem_key=c.idem_key,
                                    tool_name=c.tool_name, detail="crashed mid-call")
        return self.intake(ev, run_id, what=("ToolCallOutcomeUnknown", call_id), producer="tool-gateway")

    def approval_requested(self, call_id: str, run_id: str = "r1", *, approval_id: str = "ap1") -> list[AvroRecord]:
        c = self._call(run_id, call_id)
        ev = ApprovalRequested(approval_id=approval_id, step=int(call_id.split(".")[0]), call_id=call_id,
                               idem_key=c.idem_key, tool_name=c.tool_name, args_json=c.args_json, args_hash=c.args_hash,
                               risk_class=RiskClass.IRREVERSIBLE, reasons=["RISK_CLASS"], expires_at_ms=self.driver.now_ms + 10**9,
                               policy_version="p1", inputs_hash="0" * 64)
        return self.intake(ev, run_id, what=("ApprovalRequested", approval_id), producer="tool-gateway")

    def decided(self, call_id: str, outcome: ApprovalOutcome, run_id: str = "r1", *, approval_id: str = "ap1") -> list[AvroRecord]:
        c = self._call(run_id, call_id)
        ev = ApprovalDecided(approval_id=approval_id, call_id=call_id, args_hash=c.args_hash, outcome=outcome,
                             approver_id="bob", decided_at_ms=self.driver.now_ms)
        return self.intake(ev, run_id, what=("ApprovalDecided", approval_id), producer="approval")

    # -- plumbing --------------------------------------------------------------------------
    def envelope(self, payload: AvroRecord, run_id: str, *, tenant: str = "t1", event_id: str, producer: str) -> Envelope:
        return make_envelope(payload, run_id=run_id, tenant_id=tenant, event_id=event_id, producer=producer,
                             recorded_at_ms=self.driver.now_ms)

    def send(self, topic: str, payload: AvroRecord, run_id: str, *, tenant: str = "t1", event_id: str,
             producer: str) -> list[AvroRecord]:
        emitted = self.driver.feed(topic, self.envelope(payload, run_id, tenant=tenant, event_id=event_id, producer=producer))
        return [e.payload for e in emitted]

    def intake(self, payload: AvroRecord, run_id: str, *, what: tuple, producer: str, tenant: str = "t1") -> list[AvroRecord]:
        return self.send(RUN_INTAKE, payload, run_id, tenant=tenant, event_id=derived_id(run_id, *what), producer=producer)

    def tick(self) -> list[AvroRecord]:
        return [e.payload for e in self.driver.tick()]

    def log(self, run_id: str = "r1") -> list[Envelope]:
        return [e.envelope for e in self.driver.emitted if e.topic == RUN_EVENTS and e.envelope.run_id == run_id]

    def log_payloads(self, run_id: str = "r1") -> list[AvroRecord]:
        return [decode(e.payload) for e in self.log(run_id)]

    def ledger(self, run_id: str = "r1") -> Ledger | None:
        return self.driver.states.get(run_id)

    def tenant(self, tenant_id: str = "t1") -> TenantLedger | None:
        return self.driver.states.get(tenant_key(tenant_id))

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def all_emitted(self) -> list[Emitted]:
        return self.driver.emitted

    def step(self, step: int, k: int, run_id: str = "r1", **model) -> list[AvroRecord]:
        """A whole step: the model proposes k calls, all complete; returns what the last outcome produced."""
        self.model(step, k, run_id, **model)
        for i in range(k):
            self.request(step, i, run_id)
        out: list[AvroRecord] = []
        for i in range(k):
            out = self.done(f"{step}.{i}", run_id)
        return out


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    # Whatever a test did, the log it produced must be one intact, gap-free chain per run.
    log = [e.envelope for e in h.driver.emitted if e.topic == RUN_EVENTS]
    assert verify_chain(log) == []
    for run_id in {e.run_id for e in log}:
        seqs = [e.seq for e in log if e.run_id == run_id]
        assert seqs == list(range(1, len(seqs) + 1))
    assert all(e.topic == RUN_EVENTS for e in h.driver.emitted)
