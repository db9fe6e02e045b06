"""Policy decisions on tool calls: pure functions of recorded inputs and a versioned policy.

An auditor replaying the log rebuilds the same inputs from RunAccepted, ToolCallRequested, the
outcomes before the decision (taint) and ToolCallBudgeted (its recorded_at_ms), or from
ApprovalDecided, or from ToolCallDeferred (the limiter's recorded answer); runs the policy of
the recorded `policy_version`; and must get the same verdict and `inputs_hash`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, Protocol

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match

from tether_contracts.records import ApprovalOutcome, RiskClass, ToolSpec
from tether_security.argument_schema import SchemaReferenceUnresolvable, argument_validator
from tether_tool_gateway.domain.canonical import canonical_json, sha256_hex
from tether_tool_gateway.domain.constraints import ConstraintsInvalid, check_constraints, parse_constraints
from tether_tool_gateway.domain.policy_document import (
    DAY_MS,
    DEFAULT_APPROVAL_TTL_MS,
    DEFAULT_POLICY_VERSION,
    PREVIOUS_DEFAULT_POLICY_VERSION,
    LoadedPolicy,
    RateLimit,
    default_policies,
    default_policy,
)

__all__ = [
    "DAY_MS", "DEFAULT_APPROVAL_TTL_MS", "Allow", "ApprovalDecisionInputs", "BasicPolicy", "CallDecisionInputs",
    "Decision", "Defer", "Deny", "Policy", "RateAnswer", "RateDecisionInputs", "RequireApproval", "TrustPolicy",
    "Verdict", "approval_id_for", "inputs_hash", "policy_for_run", "validate_args",
]

_log = logging.getLogger(__name__)

_DETAIL_MAX = 500

# Reasons an approval is needed (ApprovalRequested.reasons), in the order they are listed.
POLICY = "POLICY"
RISK_CLASS = "RISK_CLASS"
TAINTED_EGRESS = "TAINTED_EGRESS"

# The rules that let a call run without a human (ToolCallAuthorized.reasons), in checking order.
GRANTED = "GRANTED"  # tool ∈ tenant grants ∩ agent allowlist
IN_DELEGATED_SCOPE = "IN_DELEGATED_SCOPE"  # the run is delegated and its scope holds the tool
ARGS_VALID = "ARGS_VALID"  # args_hash matches and the arguments validate against the tool's schema
CONSTRAINTS_MET = "CONSTRAINTS_MET"  # the tool has argument constraints and the arguments keep them
RISK_CLASS_NEEDS_NO_APPROVAL = "RISK_CLASS_NEEDS_NO_APPROVAL"  # no level requires a human for the class
RISK_CLASS_WAIVED = "RISK_CLASS_WAIVED"  # a level requires one for the class, and a level waives the tool
EGRESS_UNTAINTED = "EGRESS_UNTAINTED"  # the tool has egress and the run has read no untrusted content
# A read-only egress tool on a tainted run whose every argument is a link the run was given (the
# goal or fetched content holds it whole), under a policy with taint.follow_links.
EGRESS_FOLLOWS_LINK = "EGRESS_FOLLOWS_LINK"


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
    tenant_id: str = ""
    agent_id: str = ""
    principal_id: str = ""
    #: RunAccepted.delegated_scope: None = not delegated; a list restricts further (may be empty).
    delegated_scope: Sequence[str] | None = None
    #: Call ids of the untrusted results the log held before this decision (the run's taint).
    tainted_by: Sequence[str] = ()
    #: For a read-only egress tool on a tainted run: each argument leaf (JSON pointer) → the source
    #: holding it whole ("goal" or "tool:<call_id>" of an untrusted result), or None
    #: (`provenance.copied_args`). None when not computed (the rule cannot apply).
    copied_args: Mapping[str, str | None] | None = None
    #: `tools:<name>` of each untrusted MCP tool in the run's snapshot (`RunState.tool_taint`): what
    #: taints the run from its start under taint.mcp_tool_descriptions.
    tool_taint: Sequence[str] = ()
    #: `copied_args` as taint.strict_link_sources reads it (`provenance.linked_args`): computed for a
    #: read-only egress tool on a run tainted by an outcome or by `tool_taint`; None otherwise.
    linked_args: Mapping[str, str | None] | None = None

    def canonical(self, *, with_copied_args: bool = False, strict_links: bool = False,
                  with_tool_taint: bool = False) -> dict[str, Any]:
        """The inputs as hashed: only what the decision reads, named explicitly (schema growth
        of ToolSpec must not change the hash of an old decision). `copied_args` is hashed only by
        a policy that reads it (taint.follow_links; under taint.strict_link_sources the strict
        `linked_args` are hashed as `copied_args`, on a run the policy deems tainted), `tool_taint`
        only by one with taint.mcp_tool_descriptions, so older policies' hashes do not change."""
        t = self.tool
        extra: dict[str, Any] = {}
        if with_tool_taint:
            extra["tool_taint"] = sorted(set(self.tool_taint))
        links = self.linked_args if strict_links else self.copied_args
        tainted = bool(self.tainted_by) or (with_tool_taint and bool(self.tool_taint))
        if with_copied_args and links is not None and tainted:
            extra["copied_args"] = dict(sorted(links.items()))
        return extra | {
            "kind": "call",
            "tenant_id": self.tenant_id,
            "agent_id": self.agent_id,
            "principal_id": self.principal_id,
            "tool_name": self.tool_name,
            "args_json": self.args_json,
            "args_hash": self.args_hash,
            "tool": None if t is None else {
                "name": t.name,
                "version": t.version,
                "args_schema_json": t.args_schema_json,
                "risk_class": t.risk_class.value,
                "egress": t.egress,
                "untrusted_source": t.untrusted_source,
                "constraints_json": t.constraints_json,
            },
            "tenant_grants": sorted(set(self.tenant_grants)),
            "agent_allowlist": sorted(set(self.agent_allowlist)),
            "delegated_scope": None if self.delegated_scope is None else sorted(set(self.delegated_scope)),
            "tainted_by": sorted(set(self.tainted_by)),
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


@dataclass(frozen=True)
class RateAnswer:
    """What the rate limiter said; recorded, because the limiter's state is not in the log."""

    allowed: bool
    retry_after_ms: int = 0


@dataclass(frozen=True)
class RateDecisionInputs:
    """An allowed call that had to ask the rate limiter, and its answer."""

    tenant_id: str
    tool_name: str
    call_id: str
    idem_key: str
    attempt: int
    limit: RateLimit
    answer: RateAnswer
    decided_at_ms: int

    def canonical(self) -> dict[str, Any]:
        return {
            "kind": "rate_limit",
            "tenant_id": self.tenant_id,
            "tool_name": self.tool_name,
            "call_id": self.call_id,
            "idem_key": self.idem_key,
            "attempt": self.attempt,
            "limit": self.limit.canonical(),
            "answer": {"allowed": self.answer.allowed, "retry_after_ms": self.answer.retry_after_ms},
            "decided_at_ms": self.decided_at_ms,
        }


# -- verdicts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Allow:
    """Execute the call (after the rate limiter, if the policy limits the tool).

    `reasons` (a call decision only) are the rules that let it run, recorded in ToolCallAuthorized.
    """

    reasons: tuple[str, ...] = ()


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


@dataclass(frozen=True)
class Defer:
    """Rate limited: run the call again at `not_before_ms` (not a refusal)."""

    reason_code: str
    retry_after_ms: int
    not_before_ms: int


Verdict = Allow | Deny | RequireApproval | Defer


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

    @property
    def counts_tool_taint(self) -> bool:
        """The policy deems a run tainted by the untrusted MCP tools of its snapshot
        (taint.mcp_tool_descriptions): the approver is shown them as what tainted the run."""
        ...

    def decide_call(self, inputs: CallDecisionInputs) -> Decision:
        """Decide a budgeted call: deny, require approval, or allow."""
        ...

    def decide_approval(self, inputs: ApprovalDecisionInputs) -> Decision:
        """Decide a parked call once its approval is decided: allow or deny."""
        ...

    def rate_limit_for(self, tenant_id: str, tool_name: str) -> RateLimit | None:
        """The rate limit an allowed call of this tenant and tool must pass, if any."""
        ...

    def decide_rate(self, inputs: RateDecisionInputs) -> Decision:
        """Allow, or defer to the time the limiter's recorded answer names."""
        ...


# -- shared rules ------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _validator(schema_json: str, formats: tuple[str, ...]) -> Draft202012Validator:
    schema = json.loads(schema_json)
    Draft202012Validator.check_schema(schema)
    # Never fetches a $ref, and asserts the formats with checks of its own: the verdict depends on the
    # recorded schema and the policy version only, not on the network or on what is installed.
    return argument_validator(schema, formats)


def _short(text: str) -> str:
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 1] + "…"


def validate_args(tool: ToolSpec, args_json: str, formats: Iterable[str] = ()) -> str | None:
    """None if `args_json` validates against the tool's JSON Schema (draft 2020-12), with `format`
    asserted for `formats` (the policy document's arguments.assert_formats), else why not."""
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        return f"arguments are not JSON: {exc.msg}"
    try:
        validator = _validator(tool.args_schema_json, tuple(sorted(set(formats))))
    except (json.JSONDecodeError, SchemaError) as exc:
        return f"the tool's argument schema is invalid: {getattr(exc, 'message', str(exc))}"
    try:
        error = best_match(validator.iter_errors(args))
    except SchemaReferenceUnresolvable as exc:
        # A $ref to another document (never fetched) or to nothing in the schema: no call can be checked.
        return _short(f"the tool's argument schema is unusable: a $ref to {getattr(exc, 'ref', '?')!r} resolves to "
                      "nothing in the schema (another document is never fetched)")
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return _short(f"{where}: {error.message}")


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


def _rate_verdict(i: RateDecisionInputs) -> Verdict:
    if i.answer.allowed:
        return Allow()
    wait = max(1, i.answer.retry_after_ms)
    return Defer("RATE_LIMITED", wait, i.decided_at_ms + wait)


# -- the legacy basic policy -------------------------------------------------------------------
@dataclass(frozen=True)
class BasicPolicy:
    """The first policy (version basic/1): known tool, tenant grants ∩ agent allowlist, valid
    arguments, and a human approval for irreversible tools. Kept so decisions recorded under
    basic/1 can still be re-derived; new deployments use TrustPolicy."""

    version: str = "basic/1"
    approval_ttl_ms: int = DEFAULT_APPROVAL_TTL_MS
    approval_risk_classes: frozenset[RiskClass] = field(default_factory=lambda: frozenset({RiskClass.IRREVERSIBLE}))

    @property
    def counts_tool_taint(self) -> bool:
        return False

    @staticmethod
    def canonical(i: CallDecisionInputs) -> dict[str, Any]:
        tool = None
        if i.tool is not None:
            tool = i.tool.to_avro()
            if tool.get("constraints_json") == "{}":
                del tool["constraints_json"]  # the field did not exist when basic/1 decided
        return {
            "kind": "call",
            "tool_name": i.tool_name,
            "args_json": i.args_json,
            "args_hash": i.args_hash,
            "tool": tool,
            "tenant_grants": sorted(set(i.tenant_grants)),
            "agent_allowlist": sorted(set(i.agent_allowlist)),
            "recorded_at_ms": i.recorded_at_ms,
        }

    def decide_call(self, inputs: CallDecisionInputs) -> Decision:
        return Decision(self._call_verdict(inputs), self.version, inputs_hash(self.version, self.canonical(inputs)))

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
            return RequireApproval((RISK_CLASS,), i.recorded_at_ms + self.approval_ttl_ms)
        return Allow((GRANTED, ARGS_VALID, RISK_CLASS_NEEDS_NO_APPROVAL))

    def decide_approval(self, inputs: ApprovalDecisionInputs) -> Decision:
        return Decision(_approval_verdict(inputs), self.version, inputs_hash(self.version, inputs.canonical()))

    def rate_limit_for(self, tenant_id: str, tool_name: str) -> RateLimit | None:
        return None

    def decide_rate(self, inputs: RateDecisionInputs) -> Decision:
        return Decision(_rate_verdict(inputs), self.version, inputs_hash(self.version, inputs.canonical()))


# -- the trust policy --------------------------------------------------------------------------
@dataclass(frozen=True)
class TrustPolicy:
    """The trust boundary's policy, driven by a versioned policy document (docs/policy.md).

    In order: unknown tool → UNKNOWN_TOOL; not in tenant grants ∩ agent allowlist ∩ delegated
    scope → TOOL_NOT_ALLOWED; args hash or JSON Schema (with the document's arguments.assert_formats
    asserted) → INVALID_ARGS; the tool's argument
    constraints → CONSTRAINT_VIOLATION; then a human is needed for any of POLICY (the document
    names the tool), RISK_CLASS (the tool's class needs approval at the deployment, tenant or
    agent level and no level waives the tool) and TAINTED_EGRESS (the run has read untrusted
    content and the tool has egress, unless the document lets a read-only tool follow a link the
    run was given: taint.follow_links); otherwise allow, subject to the rate limit.
    """

    loaded: LoadedPolicy = field(default_factory=default_policy)

    @property
    def version(self) -> str:
        return self.loaded.policy_version

    @property
    def counts_tool_taint(self) -> bool:
        return self.loaded.document.taint.mcp_tool_descriptions

    def decide_call(self, inputs: CallDecisionInputs) -> Decision:
        taint = self.loaded.document.taint
        canonical = inputs.canonical(with_copied_args=taint.follow_links, strict_links=taint.strict_link_sources,
                                     with_tool_taint=taint.mcp_tool_descriptions)
        return Decision(self._call_verdict(inputs), self.version, inputs_hash(self.version, canonical))

    def _tainted(self, i: CallDecisionInputs) -> bool:
        """The run has read untrusted content: an outcome, or (taint.mcp_tool_descriptions) the
        description of an untrusted MCP tool in its snapshot."""
        return bool(i.tainted_by) or (self.loaded.document.taint.mcp_tool_descriptions and bool(i.tool_taint))

    def _follows_link(self, tool: ToolSpec, i: CallDecisionInputs) -> bool:
        """taint.follow_links: a READ_ONLY tool whose arguments are a flat object of declared
        properties with string values, every one a whole token of the goal or of an untrusted
        result (`provenance.copied_args`, or `linked_args` under taint.strict_link_sources). The
        shape keeps data out of places the sources are not searched for: object keys the schema
        does not fix, numbers, nesting."""
        taint = self.loaded.document.taint
        if not taint.follow_links or tool.risk_class != RiskClass.READ_ONLY:
            return False
        copied = i.linked_args if taint.strict_link_sources else i.copied_args
        if not copied:
            return False
        args = json.loads(i.args_json)
        declared = json.loads(tool.args_schema_json).get("properties") or {}
        if not isinstance(args, dict) or not args or not isinstance(declared, dict):
            return False
        for key, value in args.items():
            pointer = "/" + key.replace("~", "~0").replace("/", "~1")
            if key not in declared or not isinstance(value, str) or not copied.get(pointer):
                return False
        return True

    def _call_verdict(self, i: CallDecisionInputs) -> Verdict:
        tool = i.tool
        if tool is None:
            return Deny("UNKNOWN_TOOL", f"no tool named {i.tool_name!r} is registered for this run")
        missing = []
        if i.tool_name not in set(i.tenant_grants):
            missing.append("not granted to this principal by the tenant")
        if i.tool_name not in set(i.agent_allowlist):
            missing.append("not on the agent's allowlist")
        if i.delegated_scope is not None and i.tool_name not in set(i.delegated_scope):
            missing.append("outside the run's delegated scope")
        if missing:
            return Deny("TOOL_NOT_ALLOWED", f"tool {i.tool_name!r} is {'; '.join(missing)}")
        if sha256_hex(i.args_json) != i.args_hash:
            return Deny("INVALID_ARGS", "args_hash does not match args_json")
        problem = validate_args(tool, i.args_json, self.loaded.document.arguments.assert_formats)
        if problem is not None:
            return Deny("INVALID_ARGS", problem)
        try:
            constraints = parse_constraints(tool.constraints_json)
        except ConstraintsInvalid as exc:
            return Deny("CONSTRAINT_VIOLATION", _short(f"the tool's constraints cannot be checked: {exc}"))
        try:
            violations = check_constraints(constraints, json.loads(i.args_json))
        except Exception as exc:  # a checker bug must deny the call, not dead-letter the record
            _log.exception("constraint check of %s failed; denying the call", i.tool_name)
            return Deny("CONSTRAINT_VIOLATION",
                        f"the arguments cannot be checked against the tool's constraints ({type(exc).__name__})")
        if violations:
            return Deny("CONSTRAINT_VIOLATION", _short("; ".join(v.describe() for v in violations)))
        need = self.loaded.approval_for(i.tenant_id, i.agent_id, i.tool_name)
        reasons = []
        if need.required_by_policy:
            reasons.append(POLICY)
        if tool.risk_class in need.risk_classes and not need.waived:
            reasons.append(RISK_CLASS)
        tainted = self._tainted(i)
        follows_link = bool(tool.egress and tainted) and self._follows_link(tool, i)
        if tool.egress and tainted and not follows_link:
            reasons.append(TAINTED_EGRESS)
        if reasons:
            return RequireApproval(tuple(reasons), i.recorded_at_ms + self.loaded.document.approval_ttl_ms)
        allowed = [GRANTED]
        if i.delegated_scope is not None:
            allowed.append(IN_DELEGATED_SCOPE)
        allowed.append(ARGS_VALID)
        if constraints.rules:
            allowed.append(CONSTRAINTS_MET)
        allowed.append(RISK_CLASS_WAIVED if tool.risk_class in need.risk_classes else RISK_CLASS_NEEDS_NO_APPROVAL)
        if tool.egress:
            allowed.append(EGRESS_FOLLOWS_LINK if follows_link else EGRESS_UNTAINTED)
        return Allow(tuple(allowed))

    def decide_approval(self, inputs: ApprovalDecisionInputs) -> Decision:
        return Decision(_approval_verdict(inputs), self.version, inputs_hash(self.version, inputs.canonical()))

    def rate_limit_for(self, tenant_id: str, tool_name: str) -> RateLimit | None:
        return self.loaded.rate_limit_for(tenant_id, tool_name)

    def decide_rate(self, inputs: RateDecisionInputs) -> Decision:
        return Decision(_rate_verdict(inputs), self.version, inputs_hash(self.version, inputs.canonical()))


@cache
def _earlier_defaults() -> dict[str, TrustPolicy]:
    return {p.policy_version: TrustPolicy(p) for p in default_policies()[1:]}


def policy_for_run(policy: Policy, run_default_version: str | None) -> Policy:
    """The policy a run's decisions are made under (docs/policy.md, "Runs in flight across an upgrade").

    A gateway given a policy document decides every run under it. A gateway on the built-in
    default decides each run under the default of the release that accepted it
    (`RunState.default_policy_version`; None, a state checkpointed before that field, is
    default/2): a newer default may read what an older release's state does not hold (default/3's
    `Source.requests_before`), where the gateway restoring that state and an auditor folding the log
    would reach different decisions. The decision events name the version, so the audit runs the
    same one. A version this release does not know (a newer release's, after a rollback) gets the
    current default.
    """
    if not isinstance(policy, TrustPolicy) or policy.version != DEFAULT_POLICY_VERSION:
        return policy
    version = run_default_version or PREVIOUS_DEFAULT_POLICY_VERSION
    return _earlier_defaults().get(version, policy)


def approval_id_for(run_id: str, idem_key: str, args_hash: str) -> str:
    """A deterministic approval id, bound to the call and its arguments."""
    return "apr_" + sha256_hex(f"{run_id}\x1f{idem_key}\x1f{args_hash}")[:32]
