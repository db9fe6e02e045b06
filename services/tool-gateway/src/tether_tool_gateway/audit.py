"""Re-derives the gateway's decisions of a run from its sequenced events, as an auditor does.

Pure: no Kafka or database. Feed one run's log in sequence order (envelope + decoded payload);
the audit folds it the way the gateway does (`handlers.call_decision_inputs`, the run's taint and
provenance sources at each ToolCallBudgeted), runs the policy each decision event names, and
reports every event that does not follow from its inputs — a wrong verdict, reason, detail,
inputs hash, expiry, provenance or approval id, an unknown policy version — and every call that
executed although its recorded decision did not allow it.

An allowed call's decision is its ToolCallAuthorized (reasons, inputs hash, args hash, risk
class re-derived like any other decision). Logs written before that event existed have none for
allowed calls; with `allow_version` set, the audit checks that each call executed without a
recorded decision is allowed under that policy version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalOutcome,
    ApprovalRequested,
    Envelope,
    RunAccepted,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallDeferred,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
)
from tether_tool_gateway.domain.policy import (
    Allow,
    ApprovalDecisionInputs,
    CallDecisionInputs,
    Decision,
    Defer,
    Deny,
    Policy,
    RateAnswer,
    RateDecisionInputs,
    RequireApproval,
    approval_id_for,
)
from tether_tool_gateway.domain.state import CallState, RunState
from tether_tool_gateway.handlers import call_decision_inputs, call_provenance, read_outcome

_APPROVAL_DENIALS = frozenset({"APPROVAL_REJECTED", "APPROVAL_EXPIRED"})


@dataclass(frozen=True)
class Mismatch:
    """One event that does not follow from the recorded inputs (or an effect without a go)."""

    run_id: str
    seq: int | None
    event_type: str
    call_id: str
    problem: str


@dataclass
class _Call:
    state: CallState
    inputs: CallDecisionInputs | None = None
    #: The provenance the gateway shows under a policy that does not count the snapshot's MCP
    #: tools as taint, and under one that does (`handlers.call_provenance`).
    provenance_json: str = ""
    provenance_json_tool_taint: str = ""
    verdict: str = ""  # "allow", "deny", "approval", "approved", "rejected" as recorded
    approval: ApprovalRequested | None = None
    decided: ApprovalDecided | None = None


@dataclass
class GatewayAudit:
    """Checks the gateway's decisions of one run; `policies` maps policy_version → Policy."""

    policies: Mapping[str, Policy]
    allow_version: str | None = None
    mismatches: list[Mismatch] = field(default_factory=list)
    _run: RunState | None = None
    _calls: dict[str, _Call] = field(default_factory=dict)

    def check(self, events: Iterable[tuple[Envelope, AvroRecord]]) -> list[Mismatch]:
        for envelope, payload in events:
            self.observe(envelope, payload)
        return self.mismatches

    def observe(self, env: Envelope, payload: AvroRecord) -> None:
        """Fold one sequenced event and check it if it is a gateway decision or an effect."""
        if isinstance(payload, RunAccepted):
            run = RunState(tenant_id=env.tenant_id, principal_id=payload.principal_id,
                           agent_id=payload.agent.agent_id, agent_allowlist=list(payload.agent.tool_allowlist),
                           tenant_grants=list(payload.tenant_grants),
                           delegated_scope=None if payload.delegated_scope is None else list(payload.delegated_scope),
                           tools={t.name: t for t in payload.tools})
            run.read_goal(payload.goal)
            self._run = run
            return
        run = self._run
        if run is None:
            return
        if isinstance(payload, ToolCallRequested):
            c = payload.call
            state = CallState(call_id=c.call_id, step=payload.step, call_index=c.call_index, idem_key=c.idem_key,
                              tool_name=c.tool_name, args_json=c.args_json, args_hash=c.args_hash,
                              provenance_json=payload.provenance_json)
            run.calls[c.call_id] = state
            self._calls[c.call_id] = _Call(state)
        elif isinstance(payload, ToolCallBudgeted):
            call = self._calls.get(payload.call_id)
            if call is not None:
                # The decision's inputs are the log as it stood here: the taint so far, this clock.
                call.inputs = call_decision_inputs(run, call.state, recorded_at_ms=env.recorded_at_ms)
                call.provenance_json = call_provenance(run, call.state)
                call.provenance_json_tool_taint = call_provenance(run, call.state, tool_taint=True)
        elif isinstance(payload, ApprovalRequested):
            self._check_approval_requested(env, payload)
        elif isinstance(payload, ApprovalDecided):
            call = self._calls.get(payload.call_id)
            if call is not None:
                call.decided = payload
        elif isinstance(payload, ToolCallAuthorized):
            self._check_authorized(env, payload)
        elif isinstance(payload, ToolCallDenied):
            self._check_denied(env, payload)
        elif isinstance(payload, ToolCallDeferred):
            self._check_deferred(env, payload)
        elif isinstance(payload, ToolCallCompleted | ToolCallFailed | ToolCallOutcomeUnknown):
            self._check_effect(env, payload)
            read_outcome(run, payload)

    # -- checks --------------------------------------------------------------------------------
    def _report(self, env: Envelope, call_id: str, problem: str) -> None:
        self.mismatches.append(Mismatch(env.run_id, env.seq, env.event_type, call_id, problem))

    def _policy(self, env: Envelope, call_id: str, version: str) -> Policy | None:
        policy = self.policies.get(version)
        if policy is None:
            self._report(env, call_id, f"policy version {version!r} is unknown to the audit")
        return policy

    def _decided_call(self, env: Envelope, call_id: str, version: str) -> tuple[_Call, Decision] | None:
        call = self._calls.get(call_id)
        if call is None or call.inputs is None:
            self._report(env, call_id, "a decision on a call that was never requested and budgeted")
            return None
        policy = self._policy(env, call_id, version)
        if policy is None:
            return None
        return call, policy.decide_call(call.inputs)

    def _check_approval_requested(self, env: Envelope, ev: ApprovalRequested) -> None:
        found = self._decided_call(env, ev.call_id, ev.policy_version)
        if found is None:
            return
        call, d = found
        call.verdict, call.approval = "approval", ev
        v = d.verdict
        if not isinstance(v, RequireApproval):
            self._report(env, ev.call_id, f"the policy says {_describe(v)}, not an approval")
            return
        policy = self.policies[ev.policy_version]
        shown = call.provenance_json_tool_taint if policy.counts_tool_taint else call.provenance_json
        expected = {
            "reasons": (list(v.reasons), ev.reasons),
            "expires_at_ms": (v.expires_at_ms, ev.expires_at_ms),
            "inputs_hash": (d.inputs_hash, ev.inputs_hash),
            "args_hash": (call.state.args_hash, ev.args_hash),
            "approval_id": (approval_id_for(env.run_id, call.state.idem_key, call.state.args_hash), ev.approval_id),
            "provenance_json": (shown, ev.provenance_json),
        }
        for name, (want, got) in expected.items():
            if want != got:
                self._report(env, ev.call_id, f"{name} is {got!r}; the inputs give {want!r}")

    def _check_authorized(self, env: Envelope, ev: ToolCallAuthorized) -> None:
        found = self._decided_call(env, ev.call_id, ev.policy_version)
        if found is None:
            return
        call, d = found
        if call.verdict:
            self._report(env, ev.call_id, f"authorized after the call was already decided ({call.verdict})")
            return
        call.verdict = "allow"
        v = d.verdict
        if not isinstance(v, Allow):
            self._report(env, ev.call_id, f"the policy says {_describe(v)}, not allow")
            return
        tool = call.inputs.tool if call.inputs is not None else None
        expected = {
            "reasons": (list(v.reasons), ev.reasons),
            "inputs_hash": (d.inputs_hash, ev.inputs_hash),
            "args_hash": (call.state.args_hash, ev.args_hash),
            "tool_name": (call.state.tool_name, ev.tool_name),
            "tool_version": (tool.version if tool else None, ev.tool_version),
            "risk_class": (tool.risk_class if tool else None, ev.risk_class),
        }
        for name, (want, got) in expected.items():
            if want != got:
                self._report(env, ev.call_id, f"{name} is {got!r}; the inputs give {want!r}")

    def _check_denied(self, env: Envelope, ev: ToolCallDenied) -> None:
        if ev.reason_code in _APPROVAL_DENIALS:
            self._check_approval_denial(env, ev)
            return
        found = self._decided_call(env, ev.call_id, ev.policy_version)
        if found is None:
            return
        call, d = found
        call.verdict = "deny"
        v = d.verdict
        if not isinstance(v, Deny):
            self._report(env, ev.call_id, f"the policy says {_describe(v)}, not a denial")
        elif (v.reason_code, v.detail) != (ev.reason_code, ev.detail):
            self._report(env, ev.call_id, f"denied {ev.reason_code} ({ev.detail!r}); the inputs give "
                                          f"{v.reason_code} ({v.detail!r})")
        if d.inputs_hash != ev.inputs_hash:
            self._report(env, ev.call_id, f"inputs_hash is {ev.inputs_hash}; the inputs give {d.inputs_hash}")

    def _check_approval_denial(self, env: Envelope, ev: ToolCallDenied) -> None:
        call = self._calls.get(ev.call_id)
        if call is None or call.approval is None or call.decided is None:
            self._report(env, ev.call_id, f"{ev.reason_code} without an approval request and its decision")
            return
        policy = self._policy(env, ev.call_id, ev.policy_version)
        if policy is None:
            return
        decided = call.decided
        d = policy.decide_approval(ApprovalDecisionInputs(
            approval_id=decided.approval_id, call_args_hash=call.state.args_hash,
            approval_expires_at_ms=call.approval.expires_at_ms, decided_args_hash=decided.args_hash,
            outcome=decided.outcome, approver_id=decided.approver_id, comment=decided.comment,
            decided_at_ms=decided.decided_at_ms))
        call.verdict = "rejected"
        if not isinstance(d.verdict, Deny) or d.verdict.reason_code != ev.reason_code:
            self._report(env, ev.call_id, f"denied {ev.reason_code}; the decision gives {_describe(d.verdict)}")
        if d.inputs_hash != ev.inputs_hash:
            self._report(env, ev.call_id, f"inputs_hash is {ev.inputs_hash}; the inputs give {d.inputs_hash}")

    def _check_deferred(self, env: Envelope, ev: ToolCallDeferred) -> None:
        run = self._run
        policy = self._policy(env, ev.call_id, ev.policy_version)
        if policy is None or run is None:
            return
        limit = policy.rate_limit_for(run.tenant_id, ev.tool_name)
        if limit is None:
            self._report(env, ev.call_id, f"deferred, but policy {ev.policy_version} sets no rate limit for the tool")
            return
        d = policy.decide_rate(RateDecisionInputs(
            tenant_id=run.tenant_id, tool_name=ev.tool_name, call_id=ev.call_id, idem_key=ev.idem_key,
            attempt=ev.attempt, limit=limit, answer=RateAnswer(False, ev.retry_after_ms),
            decided_at_ms=ev.decided_at_ms))
        v = d.verdict
        if not isinstance(v, Defer) or (v.not_before_ms, v.reason_code) != (ev.not_before_ms, ev.reason_code):
            self._report(env, ev.call_id, f"deferred to {ev.not_before_ms}; the recorded answer gives {_describe(v)}")
        if d.inputs_hash != ev.inputs_hash:
            self._report(env, ev.call_id, f"inputs_hash is {ev.inputs_hash}; the inputs give {d.inputs_hash}")

    def _check_effect(self, env: Envelope, ev: ToolCallCompleted | ToolCallFailed | ToolCallOutcomeUnknown) -> None:
        call = self._calls.get(ev.call_id)
        if call is None or call.inputs is None:
            self._report(env, ev.call_id, "an outcome for a call that was never requested and budgeted")
            return
        if call.verdict == "allow":
            return  # its ToolCallAuthorized was checked when it was folded
        if call.verdict == "deny" or call.verdict == "rejected":
            self._report(env, ev.call_id, "the call ran although it was denied")
        elif call.verdict == "approval":
            decided = call.decided
            if decided is None or decided.outcome is not ApprovalOutcome.APPROVED \
                    or decided.args_hash != call.state.args_hash:
                self._report(env, ev.call_id, "the call ran without an approval of its arguments")
        elif self.allow_version is not None:
            policy = self._policy(env, ev.call_id, self.allow_version)
            if policy is not None and not isinstance(v := policy.decide_call(call.inputs).verdict, Allow):
                self._report(env, ev.call_id, f"the call ran without a decision; {self.allow_version} says "
                                              f"{_describe(v)}")


def _describe(v: object) -> str:
    if isinstance(v, Deny):
        return f"deny {v.reason_code} ({v.detail})"
    if isinstance(v, RequireApproval):
        return f"approval {list(v.reasons)}"
    if isinstance(v, Defer):
        return f"defer to {v.not_before_ms}"
    return "allow"
