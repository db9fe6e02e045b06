"""Policy decisions on tool calls: pure functions of recorded inputs and a versioned policy.

An auditor replaying the log rebuilds the same `CallDecisionInputs` from RunAccepted,
ToolCallRequested and ToolCallBudgeted (its recorded_at_ms), runs the policy of the recorded
`policy_version`, and must get the same verdict and `inputs_hash`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match

from tether_contracts.records import ApprovalOutcome, RiskClass, ToolSpec
from tether_tool_gateway.domain.canonical import canonical_json, sha256_hex

DAY_MS = 24 * 60 * 60 * 1000
DEFAULT_APPROVAL_TTL_MS = 7 * DAY_MS
_DETAIL_MAX = 500


# -- inputs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallDecisionInputs:
    """Everything a call decision may depend on, all taken from the log."""

    tool_name: str
    args_json: str
    args_hash: str
    tool: ToolSpec | None
    tenant_grants: Sequence[str]
    agent_allowlist: Sequence[str]
    recorded_at_ms: int  # ToolCallBudgeted's recorded time: the decision's clock

    def canonical(self) -> dict[str, Any]:
        return {
            "kind": "call",
            "tool_name": self.tool_name,
            "args_json": self.args_json,
            "args_hash": self.args_hash,
            "tool": None if self.tool is None else self.tool.to_avro(),
            "tenant_grants": sorted(set(self.tenant_grants)),
            "agent_allowlist": sorted(set(self.agent_allowlist)),
            "recorded_at_ms": self.recorded_at_ms,
        }


@dataclass(frozen=True)
class ApprovalDecisionInputs:
    """A pending approval and the ApprovalDecided that answers it."""

    approval_id: str
    call_args_hash: str
    approval_expires_at_ms: int
    decided_args_hash: str
    outcome: ApprovalOutcome
    approver_id: str
    comment: str
    decided_at_ms: int

    def canonical(self) -> dict[str, Any]:
        return {
            "kind": "approval",
            "approval_id": self.approval_id,
            "call_args_hash": self.call_args_hash,
            "approval_expires_at_ms": self.approval_expires_at_ms,
            "decided_args_hash": self.decided_args_hash,
            "outcome": self.outcome.value,
            "approver_id": self.approver_id,
            "comment": self.comment,
            "decided_at_ms": self.decided_at_ms,
        }


# -- verdicts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Allow:
    """Execute the call."""


@dataclass(frozen=True)
class Deny:
    """Refuse the call with a ToolCallDenied reason code."""

    reason_code: str
    detail: str


@dataclass(frozen=True)
class RequireApproval:
    """Park the call until a human decides."""

    reasons: tuple[str, ...]
    expires_at_ms: int


Verdict = Allow | Deny | RequireApproval


@dataclass(frozen=True)
class Decision:
    """A verdict with what an auditor needs to re-derive it."""

    verdict: Verdict
    policy_version: str
    inputs_hash: str


def inputs_hash(policy_version: str, canonical_inputs: dict[str, Any]) -> str:
    """SHA-256 of the canonical decision inputs under a policy version."""
    return sha256_hex(canonical_json({"policy_version": policy_version, "inputs": canonical_inputs}))


# -- the port ----------------------------------------------------------------------------------
class Policy(Protocol):
    """Decides whether a tool call may run. Must be a pure function of its inputs: the same
    inputs and version give the same decision on every instance and every replay."""

    version: str

    def decide_call(self, inputs: CallDecisionInputs) -> Decision:
        """Decide a budgeted call: deny, require approval, or allow."""
        ...

    def decide_approval(self, inputs: ApprovalDecisionInputs) -> Decision:
        """Decide a parked call once its approval is decided: allow or deny."""
        ...


# -- the basic policy --------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Draft202012Validator:
    schema = json.loads(schema_json)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _short(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 1] + "…"


def validate_args(tool: ToolSpec, args_json: str) -> str | None:
    """None if `args_json` validates against the tool's JSON Schema (draft 2020-12), else why not."""
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        return f"arguments are not JSON: {exc.msg}"
    try:
        validator = _validator(tool.args_schema_json)
    except (json.JSONDecodeError, SchemaError) as exc:
        return f"the tool's argument schema is invalid: {getattr(exc, 'message', str(exc))}"
    error = best_match(validator.iter_errors(args))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return _short(f"{where}: {error.message}")


@dataclass(frozen=True)
class BasicPolicy:
    """The basic trust-boundary policy: known tool, granted and allowlisted, valid arguments,
    and a human approval for irreversible tools.

    Capabilities here are tenant grants ∩ agent allowlist; delegated scope, taint, argument
    constraints and rate limits belong to a later policy version behind the same port.
    """

    version: str = "basic/1"
    approval_ttl_ms: int = DEFAULT_APPROVAL_TTL_MS
    approval_risk_classes: frozenset[RiskClass] = field(default_factory=lambda: frozenset({RiskClass.IRREVERSIBLE}))

    def decide_call(self, inputs: CallDecisionInputs) -> Decision:
        return Decision(self._call_verdict(inputs), self.version, inputs_hash(self.version, inputs.canonical()))

    def _call_verdict(self, i: CallDecisionInputs) -> Verdict:
        if i.tool is None:
            return Deny("UNKNOWN_TOOL", f"no tool named {i.tool_name!r} is registered for this run")
        if i.tool_name not in set(i.tenant_grants) or i.tool_name not in set(i.agent_allowlist):
            return Deny("TOOL_NOT_ALLOWED", f"tool {i.tool_name!r} is not granted to this run's tenant and agent")
        if sha256_hex(i.args_json) != i.args_hash:
            return Deny("INVALID_ARGS", "args_hash does not match args_json")
        problem = validate_args(i.tool, i.args_json)
        if problem is not None:
            return Deny("INVALID_ARGS", problem)
        if i.tool.risk_class in self.approval_risk_classes:
            return RequireApproval(("RISK_CLASS",), i.recorded_at_ms + self.approval_ttl_ms)
        return Allow()

    def decide_approval(self, inputs: ApprovalDecisionInputs) -> Decision:
        return Decision(self._approval_verdict(inputs), self.version, inputs_hash(self.version, inputs.canonical()))

    @staticmethod
    def _approval_verdict(i: ApprovalDecisionInputs) -> Verdict:
        if i.decided_args_hash != i.call_args_hash:
            return Deny("APPROVAL_REJECTED", "the approval was given for different arguments than the call's")
        if i.outcome is ApprovalOutcome.EXPIRED:
            return Deny("APPROVAL_EXPIRED", "nobody decided the approval before it expired")
        if i.outcome is ApprovalOutcome.REJECTED:
            why = f": {i.comment}" if i.comment else ""
            return Deny("APPROVAL_REJECTED", _short(f"rejected by {i.approver_id}{why}"))
        if i.decided_at_ms > i.approval_expires_at_ms:
            return Deny("APPROVAL_EXPIRED", "the approval was given after it had expired")
        return Allow()


def approval_id_for(run_id: str, idem_key: str, args_hash: str) -> str:
    """A deterministic approval id, bound to the call and its arguments."""
    return "apr_" + sha256_hex(f"{run_id}\x1f{idem_key}\x1f{args_hash}")[:32]
