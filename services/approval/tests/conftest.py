"""A harness around the approval processor on the in-memory driver, speaking the run protocol."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from tether_approval.domain.decisions import ApprovalPolicy
from tether_approval.domain.state import RunApprovals
from tether_approval.entrypoint import ApprovalProcessor
from tether_approval.handlers import Deps
from tether_approval.metrics import ApprovalMetrics
from tether_approval.notifier import ApprovalNotification, ApproverNotifier, Delivery, NotificationFailed
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    ApprovalRequested,
    Caps,
    DecideApproval,
    ModelRef,
    RiskClass,
    RunAccepted,
    ToolCall,
    ToolCallRequested,
    ToolSpec,
)
from tether_messaging.envelopes import derived_id, make_envelope
from tether_messaging.testing import Emitted, InMemoryDriver
from tether_messaging.topics import Topics

T0 = 1_700_000_000_000
ARGS = {"to": "ceo@example.com", "subject": "hi"}


def canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


ARGS_JSON = canonical(ARGS)
ARGS_HASH = sha(ARGS_JSON)


def tool(name: str = "send_email", risk: RiskClass = RiskClass.IRREVERSIBLE, *, idempotent: bool = False) -> ToolSpec:
    return ToolSpec(name=name, version=1, description=name, args_schema_json="{}", risk_class=risk,
                    idempotent=idempotent, untrusted_source=False, executor_kind="builtin", egress=True)


@dataclass
class FakeNotifier:
    """An ApproverNotifier that records what it was asked to send, and can be told to fail."""

    sent: list[ApprovalNotification] = field(default_factory=list)
    fail: bool = False

    def notify(self, notification: ApprovalNotification) -> Delivery:
        self.sent.append(notification)
        if self.fail:
            raise NotificationFailed("receiver down", attempts=4)
        return Delivery(200, 1)


class Harness:
    """Drives one approval processor; the other services' records are made like theirs."""

    T0 = T0
    ARGS = ARGS
    ARGS_JSON = ARGS_JSON
    ARGS_HASH = ARGS_HASH
    tool = staticmethod(tool)

    def __init__(self, policy: ApprovalPolicy | None = None, notifier: ApproverNotifier | None = None) -> None:
        self.registry = CollectorRegistry()
        self.topics = Topics()
        self.notifier = notifier
        self.deps = Deps(topics=self.topics, policy=policy or ApprovalPolicy(),
                         metrics=ApprovalMetrics(self.registry), notifier=notifier)
        self.driver = InMemoryDriver(ApprovalProcessor(self.deps), producer_name="approval", now_ms=T0)
        self._seq = 0

    # -- feeding ----------------------------------------------------------------------------
    def event(self, payload: AvroRecord, run_id: str = "r1", *, tenant: str = "t1", what: object = None) -> list[Emitted]:
        """A record of the run event log (as budget appends it)."""
        self._seq += 1
        event_id = derived_id(run_id, "event", what if what is not None else self._seq)
        return self.driver.feed_payload(self.topics.run_events, payload, run_id=run_id, tenant_id=tenant,
                                        event_id=event_id, producer="budget")

    def accepted(self, run_id: str = "r1", *, tenant: str = "t1", principal: str = "alice",
                 tools: list[ToolSpec] | None = None) -> list[Emitted]:
        model = ModelRef(provider="openai", name="m")
        caps = Caps(max_steps=5, max_wall_clock_ms=600_000, max_tokens=10_000, max_cost_usd_micros=1_000_000)
        return self.event(RunAccepted(
            principal_id=principal, request_id="req", goal="mail the ceo",
            agent=AgentSpec(agent_id="a", version=1, name="a", instructions="i", model=model,
                            tool_allowlist=["send_email"], caps=caps),
            tools=tools if tools is not None else [tool()], caps=caps, tenant_grants=["send_email"],
            deadline_ms=T0 + 600_000,
        ), run_id, tenant=tenant, what="accepted")

    def requested_call(self, run_id: str = "r1", *, call_id: str = "1.0", tenant: str = "t1",
                       tool_name: str = "send_email") -> list[Emitted]:
        step, index = (int(x) for x in call_id.split("."))
        call = ToolCall(call_id=call_id, call_index=index, idem_key=sha(f"{run_id}\x1f{step}\x1f{index}"),
                        tool_name=tool_name, args_json=ARGS_JSON, args_hash=ARGS_HASH)
        return self.event(ToolCallRequested(step=step, call=call, provenance_json='{"to":"goal"}'), run_id,
                          tenant=tenant, what=("requested", call_id))

    def approval_request(self, approval_id: str = "apr_1", *, call_id: str = "1.0", expires_in_ms: int = 60_000,
                         args_hash: str = ARGS_HASH, run_id: str = "r1") -> ApprovalRequested:
        step, index = (int(x) for x in call_id.split("."))
        return ApprovalRequested(
            approval_id=approval_id, step=step, call_id=call_id, idem_key=sha(f"{run_id}\x1f{step}\x1f{index}"),
            tool_name="send_email", args_json=ARGS_JSON, args_hash=args_hash, risk_class=RiskClass.IRREVERSIBLE,
            reasons=["RISK_CLASS"], provenance_json='{"to":"goal"}', expires_at_ms=self.driver.now_ms + expires_in_ms,
            policy_version="p1", inputs_hash="0" * 64,
        )

    def requested(self, approval_id: str = "apr_1", *, run_id: str = "r1", tenant: str = "t1",
                  **kwargs) -> list[Emitted]:
        return self.event(self.approval_request(approval_id, run_id=run_id, **kwargs), run_id, tenant=tenant,
                          what=("approval", approval_id))

    def decide(self, approve: bool = True, *, approval_id: str = "apr_1", approver: str = "bob",
               roles: tuple[str, ...] = ("approver",), args_hash: str = ARGS_HASH, call_id: str = "1.0",
               tenant: str = "t1", run_id: str = "r1", comment: str = "",
               recorded_at_ms: int | None = None) -> list[Emitted]:
        """An approver's decision as run-api records it: at the driver's clock, or at `recorded_at_ms`
        (a command recorded earlier and read only now, behind a backlog)."""
        cmd = DecideApproval(approval_id=approval_id, call_id=call_id, args_hash=args_hash, approver_id=approver,
                             approver_roles=list(roles), approve=approve, comment=comment)
        self._seq += 1
        self.last_command_id = derived_id(run_id, "DecideApproval", approval_id, approver, self._seq)
        envelope = make_envelope(cmd, run_id=run_id, tenant_id=tenant, event_id=self.last_command_id,
                                 producer="run-api",
                                 recorded_at_ms=self.driver.now_ms if recorded_at_ms is None else recorded_at_ms)
        return self.driver.feed(self.topics.commands, envelope)

    # -- looking ----------------------------------------------------------------------------
    def state(self, run_id: str = "r1") -> RunApprovals | None:
        return self.driver.states.get(run_id)

    def refusals(self, reason: str) -> float:
        return self.registry.get_sample_value("tether_approval_refusals_total", {"reason": reason}) or 0.0

    def decisions(self, outcome: str) -> float:
        return self.registry.get_sample_value("tether_approval_decisions_total", {"outcome": outcome}) or 0.0

    def webhook(self, result: str) -> float:
        return self.registry.get_sample_value("tether_approval_webhook_total", {"result": result}) or 0.0


@pytest.fixture
def h() -> Harness:
    """A harness with an accepted run r1 (submitted by alice in tenant t1) and no webhook."""
    harness = Harness()
    harness.accepted()
    return harness


@pytest.fixture
def make_harness():
    """Build a harness with a policy and/or a fake webhook (`webhook=True`, or `"failing"`) or a given
    notifier; run r1 accepted."""

    def make(policy: ApprovalPolicy | None = None, webhook: bool | str = False,
             notifier: ApproverNotifier | None = None) -> Harness:
        if notifier is None and webhook:
            notifier = FakeNotifier(fail=webhook == "failing")
        harness = Harness(policy, notifier)
        harness.accepted()
        return harness

    return make
