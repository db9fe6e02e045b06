"""Synthetic, valid run event logs for tests: sealed envelopes in the order the budget appends them."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field

from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    Caps,
    Envelope,
    ModelCallCompleted,
    ModelCallFailed,
    ModelRef,
    Remaining,
    RiskClass,
    RunAccepted,
    RunCompleted,
    RunRejected,
    RunTerminated,
    StepGranted,
    TerminationReport,
    ToolCall,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
    ToolSpec,
    Usage,
)
from tether_messaging.chain import GENESIS_HASH, seal
from tether_messaging.envelopes import derived_id, make_envelope
from tether_projector.ports import LogEvent

MODEL = ModelRef(provider="openai", name="gpt-test")
CAPS = Caps(max_steps=20, max_wall_clock_ms=600_000, max_tokens=100_000, max_cost_usd_micros=1_000_000)


def idem_key(run_id: str, step: int, call_index: int) -> str:
    return hashlib.sha256(f"{run_id}\x1f{step}\x1f{call_index}".encode()).hexdigest()


def canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class RunLog:
    """Appends events to one run's chain the way the budget does (seq from 1, prev_hash, hash).

    Every builder method appends one sealed envelope and returns it; `events` holds them in order.
    """

    run_id: str
    tenant_id: str = "tenant-a"
    now_ms: int = 1_700_000_000_000
    events: list[Envelope] = field(default_factory=list)
    _prev_hash: str = GENESIS_HASH

    def append(self, payload: AvroRecord, *what: object, producer: str = "budget") -> Envelope:
        self.now_ms += 7
        env = make_envelope(
            payload,
            run_id=self.run_id,
            tenant_id=self.tenant_id,
            event_id=derived_id(self.run_id, payload.AVRO_NAME, *what),
            producer=producer,
            recorded_at_ms=self.now_ms,
        )
        sealed = seal(env, len(self.events) + 1, self._prev_hash)
        self._prev_hash = sealed.hash or ""
        self.events.append(sealed)
        return sealed

    def log_events(self) -> list[LogEvent]:
        from tether_messaging.serde import open_payload

        return [LogEvent(e, open_payload(e)) for e in self.events]

    # -- budget ------------------------------------------------------------------------------
    def accepted(self, goal: str = "find things", tools: tuple[str, ...] = ("search", "send_mail")) -> Envelope:
        specs = [
            ToolSpec(name=t, version=1, description=t, args_schema_json="{}",
                     risk_class=RiskClass.IRREVERSIBLE if t == "send_mail" else RiskClass.READ_ONLY,
                     idempotent=t != "send_mail", untrusted_source=False, executor_kind="builtin")
            for t in tools
        ]
        agent = AgentSpec(agent_id="agent-1", version=3, name="Researcher", instructions="be brief", model=MODEL,
                          tool_allowlist=list(tools), caps=CAPS)
        return self.append(
            RunAccepted(principal_id="alice", request_id=f"req-{self.run_id}", goal=goal, agent=agent, tools=specs,
                        caps=CAPS, tenant_grants=list(tools), deadline_ms=self.now_ms + 600_000),
            "RunAccepted",
        )

    def rejected(self, reason: str = "INVALID_CAPS") -> Envelope:
        return self.append(RunRejected(request_id=f"req-{self.run_id}", reason_code=reason, detail="no"), "RunRejected")

    def step(self, n: int, loop_warning: str | None = None) -> Envelope:
        remaining = Remaining(steps=CAPS.max_steps - n, tokens=90_000, cost_usd_micros=900_000, wall_clock_ms=500_000)
        return self.append(StepGranted(step=n, remaining=remaining, loop_warning=loop_warning), "StepGranted", n)

    def budgeted(self, n: int, i: int) -> Envelope:
        remaining = Remaining(steps=CAPS.max_steps - n, tokens=80_000, cost_usd_micros=800_000, wall_clock_ms=400_000)
        return self.append(
            ToolCallBudgeted(step=n, call_id=f"{n}.{i}", idem_key=idem_key(self.run_id, n, i), remaining=remaining),
            "ToolCallBudgeted", f"{n}.{i}",
        )

    def terminated(self, reason: str, *, steps_done: int = 0, usage: Usage | None = None,
                   done: list[str] | None = None, pending: list[str] | None = None) -> Envelope:
        report = TerminationReport(reason_code=reason, detail=f"stopped: {reason}", steps_done=steps_done,
                                   tool_calls_done=done or [], pending=pending or [], usage=usage or Usage(),
                                   suggested_next_action="retry later")
        return self.append(RunTerminated(reason_code=reason, report=report), "RunTerminated")

    # -- planner -----------------------------------------------------------------------------
    def model(self, n: int, k: int, usage: Usage | None = None, text: str | None = "thinking") -> Envelope:
        usage = usage or Usage(input_tokens=100 * n, output_tokens=10 * n, cost_usd_micros=50 * n)
        return self.append(
            ModelCallCompleted(step=n, model=MODEL, usage=usage, assistant_text=text, tool_call_count=k,
                               finish_reason="tool_calls" if k else "stop", latency_ms=120 + n, attempts=1),
            "ModelCallCompleted", n, producer="planner",
        )

    def model_failed(self, n: int, code: str = "PROVIDER_ERROR") -> Envelope:
        return self.append(
            ModelCallFailed(step=n, error_code=code, detail="503 from provider", attempts=3,
                            usage=Usage(input_tokens=7, output_tokens=0, cost_usd_micros=3)),
            "ModelCallFailed", n, producer="planner",
        )

    def request(self, n: int, i: int, tool: str = "search", args: dict | None = None) -> Envelope:
        args_json = canonical(args if args is not None else {"q": f"{n}.{i}"})
        call = ToolCall(call_id=f"{n}.{i}", call_index=i, idem_key=idem_key(self.run_id, n, i), tool_name=tool,
                        args_json=args_json, args_hash=hashlib.sha256(args_json.encode()).hexdigest())
        return self.append(ToolCallRequested(step=n, call=call, provenance_json='{"q":"model"}'),
                           "ToolCallRequested", f"{n}.{i}", producer="planner")

    def completed(self, n: int, answer: str, usage: Usage) -> Envelope:
        return self.append(RunCompleted(step=n, answer=answer, usage=usage), "RunCompleted", producer="planner")

    # -- tool-gateway ------------------------------------------------------------------------
    def tool_completed(self, n: int, i: int, tool: str = "search", result: object = None,
                       replayed: bool = False) -> Envelope:
        return self.append(
            ToolCallCompleted(step=n, call_id=f"{n}.{i}", idem_key=idem_key(self.run_id, n, i), tool_name=tool,
                              result_json=canonical(result if result is not None else {"hits": [n, i]}),
                              duration_ms=30 + i, replayed=replayed),
            "ToolCallCompleted", f"{n}.{i}", producer="tool-gateway",
        )

    def tool_failed(self, n: int, i: int, tool: str = "search", code: str = "TIMEOUT") -> Envelope:
        return self.append(
            ToolCallFailed(step=n, call_id=f"{n}.{i}", idem_key=idem_key(self.run_id, n, i), tool_name=tool,
                           error_code=code, detail="took too long", retryable=True),
            "ToolCallFailed", f"{n}.{i}", producer="tool-gateway",
        )

    def tool_authorized(self, n: int, i: int, tool: str = "search") -> Envelope:
        return self.append(
            ToolCallAuthorized(step=n, call_id=f"{n}.{i}", idem_key=idem_key(self.run_id, n, i), tool_name=tool,
                               tool_version=1, args_hash="cd" * 32, risk_class=RiskClass.READ_ONLY,
                               reasons=["GRANTED", "ARGS_VALID", "RISK_CLASS_NEEDS_NO_APPROVAL"],
                               policy_version="p1", inputs_hash="ef" * 32),
            "ToolCallAuthorized", f"{n}.{i}", producer="tool-gateway",
        )

    def tool_denied(self, n: int, i: int, tool: str = "search", reason: str = "TOOL_NOT_ALLOWED") -> Envelope:
        return self.append(
            ToolCallDenied(step=n, call_id=f"{n}.{i}", idem_key=idem_key(self.run_id, n, i), tool_name=tool,
                           reason_code=reason, detail="not for you", policy_version="p1", inputs_hash="ab" * 32),
            "ToolCallDenied", f"{n}.{i}", producer="tool-gateway",
        )

    def tool_unknown(self, n: int, i: int, tool: str = "send_mail") -> Envelope:
        return self.append(
            ToolCallOutcomeUnknown(step=n, call_id=f"{n}.{i}", idem_key=idem_key(self.run_id, n, i), tool_name=tool,
                                   detail="crashed mid-call"),
            "ToolCallOutcomeUnknown", f"{n}.{i}", producer="tool-gateway",
        )

    def approval_requested(self, n: int, i: int, tool: str = "send_mail", reasons: tuple[str, ...] = ("RISK_CLASS",),
                           approval_id: str | None = None) -> Envelope:
        args_json = canonical({"q": f"{n}.{i}"})
        approval_id = approval_id or f"apr-{self.run_id}-{n}.{i}"
        return self.append(
            ApprovalRequested(approval_id=approval_id, step=n, call_id=f"{n}.{i}",
                              idem_key=idem_key(self.run_id, n, i), tool_name=tool, args_json=args_json,
                              args_hash=hashlib.sha256(args_json.encode()).hexdigest(),
                              risk_class=RiskClass.IRREVERSIBLE, reasons=list(reasons),
                              provenance_json='{"q":"goal"}', expires_at_ms=self.now_ms + 3_600_000,
                              policy_version="p1", inputs_hash="cd" * 32),
            "ApprovalRequested", approval_id, producer="tool-gateway",
        )

    # -- approval ----------------------------------------------------------------------------
    def approval_decided(self, n: int, i: int, outcome: ApprovalOutcome, approval_id: str | None = None) -> Envelope:
        args_json = canonical({"q": f"{n}.{i}"})
        approval_id = approval_id or f"apr-{self.run_id}-{n}.{i}"
        return self.append(
            ApprovalDecided(approval_id=approval_id, call_id=f"{n}.{i}",
                            args_hash=hashlib.sha256(args_json.encode()).hexdigest(), outcome=outcome,
                            approver_id="bob" if outcome != ApprovalOutcome.EXPIRED else "system",
                            comment="ok" if outcome == ApprovalOutcome.APPROVED else "no",
                            decided_at_ms=self.now_ms + 1),
            "ApprovalDecided", approval_id, producer="approval",
        )

    def approval_decision_refused(self, n: int, i: int, *, approver: str = "bob", approve: bool = True,
                                  approval_id: str | None = None) -> Envelope:
        """A decision recorded in time that the approval service read after the approval had expired."""
        approval_id = approval_id or f"apr-{self.run_id}-{n}.{i}"
        return self.append(
            ApprovalDecisionRefused(approval_id=approval_id, call_id=f"{n}.{i}", approver_id=approver,
                                    approve=approve, comment="looks fine", reason="DECISION_AFTER_EXPIRY",
                                    detail="read after the approval had expired", decided_at_ms=self.now_ms - 5_000,
                                    expires_at_ms=self.now_ms - 1_000),
            "ApprovalDecisionRefused", approval_id, approver, producer="approval",
        )


# -- scenarios ---------------------------------------------------------------------------------
def happy_run(run_id: str, tenant_id: str = "tenant-a") -> RunLog:
    """Two steps: two searches (one through an approval), then a final answer."""
    log = RunLog(run_id, tenant_id)
    log.accepted()
    log.step(1)
    log.model(1, 2)
    log.request(1, 0)
    log.budgeted(1, 0)
    log.request(1, 1, "send_mail")
    log.budgeted(1, 1)
    log.tool_completed(1, 0)
    log.approval_requested(1, 1)
    log.approval_decided(1, 1, ApprovalOutcome.APPROVED)
    log.tool_completed(1, 1, "send_mail", {"sent": True})
    log.step(2)
    log.model(2, 0, text="the answer is 42")
    log.completed(2, "42", Usage(input_tokens=300, output_tokens=30, cost_usd_micros=150))
    return log


def troubled_run(run_id: str, tenant_id: str = "tenant-a") -> RunLog:
    """A denial, a failure and an unknown outcome a human resolves; then the model fails and the run stops."""
    log = RunLog(run_id, tenant_id)
    log.accepted()
    log.step(1)
    log.model(1, 3)
    for i, tool in enumerate(("search", "search", "send_mail")):
        log.request(1, i, tool)
        log.budgeted(1, i)
    log.tool_denied(1, 0)
    log.tool_failed(1, 1)
    log.tool_unknown(1, 2)
    apr = f"unk-{run_id}"
    log.approval_requested(1, 2, reasons=("OUTCOME_UNKNOWN",), approval_id=apr)
    log.approval_decided(1, 2, ApprovalOutcome.APPROVED, approval_id=apr)
    log.step(2, loop_warning="you repeat yourself")
    log.model_failed(2)
    log.terminated("MODEL_FAILED", steps_done=1,
                   usage=Usage(input_tokens=107, output_tokens=10, cost_usd_micros=53),
                   done=["1.0 search DENIED", "1.1 search FAILED", "1.2 send_mail RESOLVED"])
    return log


def cancelled_while_waiting(run_id: str, tenant_id: str = "tenant-a") -> RunLog:
    """A call waits for approval when the run is cancelled: the approval is withdrawn."""
    log = RunLog(run_id, tenant_id)
    log.accepted()
    log.step(1)
    log.model(1, 1)
    log.request(1, 0, "send_mail")
    log.budgeted(1, 0)
    log.approval_requested(1, 0)
    log.terminated("CANCELLED", steps_done=1, pending=[f"approval apr-{run_id}-1.0"])
    return log


def expired_with_a_late_decision(run_id: str, tenant_id: str = "tenant-a") -> RunLog:
    """An approval expires; the approver's decision, made in time, is read only after it (refused); the run goes on."""
    log = RunLog(run_id, tenant_id)
    log.accepted()
    log.step(1)
    log.model(1, 1)
    log.request(1, 0, "send_mail")
    log.budgeted(1, 0)
    log.approval_requested(1, 0)
    log.approval_decided(1, 0, ApprovalOutcome.EXPIRED)
    log.tool_denied(1, 0, "send_mail", "APPROVAL_EXPIRED")
    log.step(2)
    log.approval_decision_refused(1, 0)
    log.model(2, 0)
    log.completed(2, "sent nothing", Usage(input_tokens=200, output_tokens=20, cost_usd_micros=100))
    return log


def rejected_run(run_id: str, tenant_id: str = "tenant-a") -> RunLog:
    log = RunLog(run_id, tenant_id)
    log.rejected()
    return log


def random_run(run_id: str, rng: random.Random, tenant_id: str = "tenant-a") -> RunLog:
    """A protocol-following run with random steps, calls, outcomes, approvals and ending."""
    log = RunLog(run_id, tenant_id)
    if rng.random() < 0.05:
        log.rejected()
        return log
    log.accepted()
    usage_total = Usage()
    for n in range(1, rng.randint(1, 5) + 1):
        log.step(n, loop_warning="warn" if rng.random() < 0.1 else None)
        if rng.random() < 0.1:
            log.model_failed(n)
            log.terminated("MODEL_FAILED", steps_done=n - 1)
            return log
        k = rng.choice([0, 0, 1, 2, 3])
        u = Usage(input_tokens=rng.randint(1, 999), output_tokens=rng.randint(1, 99), cost_usd_micros=rng.randint(1, 99))
        usage_total = Usage(input_tokens=usage_total.input_tokens + u.input_tokens,
                            output_tokens=usage_total.output_tokens + u.output_tokens,
                            cost_usd_micros=usage_total.cost_usd_micros + u.cost_usd_micros)
        log.model(n, k, u)
        if k == 0:
            log.completed(n, f"answer {n}", usage_total)
            return log
        for i in range(k):
            log.request(n, i, rng.choice(["search", "send_mail"]))
            log.budgeted(n, i)
        for i in range(k):
            roll = rng.random()
            if roll < 0.5:
                log.tool_completed(n, i, replayed=rng.random() < 0.2)
            elif roll < 0.6:
                log.tool_failed(n, i)
            elif roll < 0.7:
                log.tool_denied(n, i)
            elif roll < 0.85:
                log.approval_requested(n, i)
                outcome = rng.choice(list(ApprovalOutcome))
                if rng.random() < 0.2:
                    log.terminated("CANCELLED", steps_done=n)
                    return log
                log.approval_decided(n, i, outcome)
                if outcome == ApprovalOutcome.APPROVED:
                    log.tool_completed(n, i, "send_mail")
                else:
                    reason = "APPROVAL_REJECTED" if outcome == ApprovalOutcome.REJECTED else "APPROVAL_EXPIRED"
                    log.tool_denied(n, i, "send_mail", reason)
            else:
                log.tool_unknown(n, i)
                apr = f"unk-{run_id}-{n}.{i}"
                log.approval_requested(n, i, reasons=("OUTCOME_UNKNOWN",), approval_id=apr)
                outcome = rng.choice(list(ApprovalOutcome))
                log.approval_decided(n, i, outcome, approval_id=apr)
                if outcome != ApprovalOutcome.APPROVED:
                    log.terminated("OUTCOME_UNKNOWN" if outcome == ApprovalOutcome.REJECTED else "APPROVAL_TIMEOUT",
                                   steps_done=n)
                    return log
    log.terminated("STEP_CAP", steps_done=n, usage=usage_total)
    return log
