"""The versioned policy document: which calls need a human, and the rate limits per (tenant, tool).

The document is JSON written by operators (docs/policy.md). Its `policy_version` is
`<version>@<sha256 of the document's canonical JSON, 12 hex>`, so a document edited without a
version bump still gets a new policy version, and an auditor holding the file can tell it is
the one a decision event names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tether_contracts.records import RiskClass
from tether_security.argument_schema import check_assertable
from tether_tool_gateway.domain.canonical import canonical_json, sha256_hex

DAY_MS = 24 * 60 * 60 * 1000
DEFAULT_APPROVAL_TTL_MS = 7 * DAY_MS
WILDCARD = "*"


class PolicyDocumentInvalid(ValueError):
    """The policy document is not valid JSON or does not follow docs/policy.md."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApprovalRules(_Strict):
    """Approval rules at one level (the whole deployment, a tenant, or one agent of a tenant).

    Levels combine by union: a level can add requirements and waivers, never remove another
    level's requirement; an explicit requirement (`require_tools`) beats every waiver.
    """

    require_risk_classes: list[RiskClass] = Field(default_factory=list,
                                                  description="Risk classes whose calls need a human.")
    require_tools: list[str] = Field(default_factory=list,
                                     description="Tools that always need a human (reason POLICY).")
    waive_tools: list[str] = Field(default_factory=list,
                                   description="Tools whose risk-class approval is waived (an operator decision).")


class TenantPolicy(ApprovalRules):
    """A tenant's approval rules, and its agents' own rules by agent id."""

    agents: dict[str, ApprovalRules] = Field(default_factory=dict)


class RateLimit(_Strict):
    """A token bucket: `limit` calls per `per_s` seconds on average, bursts of up to `burst`."""

    tenant: str = WILDCARD
    tool: str = WILDCARD
    limit: int = Field(ge=1)
    per_s: float = Field(gt=0)
    burst: int | None = Field(None, ge=1, description="Bucket size; defaults to `limit`.")

    @property
    def capacity(self) -> int:
        return self.burst if self.burst is not None else self.limit

    @property
    def rate_per_s(self) -> float:
        return self.limit / self.per_s

    def canonical(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "tool": self.tool, "limit": self.limit, "per_s": self.per_s,
                "capacity": self.capacity}


class TaintRules(_Strict):
    """What a tainted run (one that has read untrusted content) may still do without a human."""

    follow_links: bool = Field(
        False,
        description="A READ_ONLY egress tool (http_get) may run without a human on a tainted run when each "
                    "argument is a string the goal or an untrusted result holds as a whole token: it follows "
                    "a link it was given and carries nothing the model composed (docs/policy.md).",
    )
    strict_link_sources: bool = Field(
        False,
        description="With follow_links: a result counts as the source of a link only if it is an untrusted "
                    "completed result (not an error detail), kept whole in the state, and recorded before the "
                    "first request of the run whose arguments hold the link (so a tool echoing what the model "
                    "sent it cannot launder a composed URL); the goal counts as before (docs/policy.md).",
    )
    mcp_tool_descriptions: bool = Field(
        False,
        description="A run whose tool snapshot holds an untrusted_source tool of an MCP server (executor kind "
                    "mcp or mcp_stdio) is tainted from its start by that tool's description and schema, which "
                    "the model reads (taint source tools:<name>; docs/policy.md).",
    )


class ArgumentRules(_Strict):
    """How a call's arguments are checked against the tool's JSON Schema, beyond what it validates by default."""

    assert_formats: list[str] = Field(
        default_factory=list,
        description="JSON Schema `format` values whose violation is a schema violation (INVALID_ARGS), each "
                    "one the gateway checks itself (tether_security.argument_formats); any other format stays "
                    "an annotation, as in JSON Schema by default (docs/policy.md).",
    )

    @field_validator("assert_formats")
    @classmethod
    def _assertable(cls, v: list[str]) -> list[str]:
        return check_assertable(v)


class PolicyDocument(_Strict):
    """The whole policy (docs/policy.md)."""

    version: str = Field(min_length=1, max_length=100)
    approval: ApprovalRules = Field(
        default_factory=lambda: ApprovalRules(require_risk_classes=[RiskClass.IRREVERSIBLE]))
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    rate_limits: list[RateLimit] = Field(default_factory=list)
    approval_ttl_ms: int = Field(DEFAULT_APPROVAL_TTL_MS, ge=1)
    taint: TaintRules = Field(default_factory=TaintRules)
    arguments: ArgumentRules = Field(default_factory=ArgumentRules)

    @field_validator("version")
    @classmethod
    def _no_at(cls, v: str) -> str:
        if "@" in v:
            raise ValueError("the version must not contain '@' (policy_version appends '@<hash>')")
        return v

    @model_validator(mode="after")
    def _one_limit_per_pair(self) -> PolicyDocument:
        pairs = [(r.tenant, r.tool) for r in self.rate_limits]
        dupes = sorted({p for p in pairs if pairs.count(p) > 1})
        if dupes:
            raise ValueError(f"more than one rate limit for (tenant, tool) {dupes}")
        return self


@dataclass(frozen=True)
class ApprovalRequirement:
    """What the levels that apply to one (tenant, agent, tool) say, combined."""

    risk_classes: frozenset[RiskClass]
    required_by_policy: bool
    waived: bool


@dataclass(frozen=True)
class LoadedPolicy:
    """A parsed document and its policy version."""

    document: PolicyDocument
    policy_version: str

    def approval_for(self, tenant_id: str, agent_id: str, tool_name: str) -> ApprovalRequirement:
        levels: list[ApprovalRules] = [self.document.approval]
        tenant = self.document.tenants.get(tenant_id)
        if tenant is not None:
            levels.append(tenant)
            agent = tenant.agents.get(agent_id)
            if agent is not None:
                levels.append(agent)
        return ApprovalRequirement(
            risk_classes=frozenset(c for level in levels for c in level.require_risk_classes),
            required_by_policy=any(tool_name in level.require_tools for level in levels),
            waived=any(tool_name in level.waive_tools for level in levels),
        )

    def rate_limit_for(self, tenant_id: str, tool_name: str) -> RateLimit | None:
        """The most specific limit: (tenant, tool), (tenant, *), (*, tool), then (*, *)."""
        by_pair = {(r.tenant, r.tool): r for r in self.document.rate_limits}
        for pair in ((tenant_id, tool_name), (tenant_id, WILDCARD), (WILDCARD, tool_name), (WILDCARD, WILDCARD)):
            if pair in by_pair:
                return by_pair[pair]
        return None


def policy_version_of(raw: Mapping[str, Any]) -> str:
    """`<version>@<12 hex of sha256(canonical JSON of the document as written)>`."""
    return f"{raw.get('version')}@{sha256_hex(canonical_json(raw))[:12]}"


def parse_policy(text: str) -> LoadedPolicy:
    """Parse and validate a policy document; raises PolicyDocumentInvalid."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyDocumentInvalid(f"the policy document is not JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(raw, dict):
        raise PolicyDocumentInvalid("the policy document must be a JSON object")
    try:
        doc = PolicyDocument.model_validate(raw)
    except ValidationError as exc:
        raise PolicyDocumentInvalid(f"the policy document is invalid: {exc}") from exc
    return LoadedPolicy(doc, policy_version_of(raw))


#: Used when no document is configured: irreversible tools need a human, no rate limits, a
#: tainted run may follow the links it was given with a read-only egress tool (only links a result
#: held before the model first wrote them), an untrusted MCP server's tools taint the run, and every
#: `format` the gateway can check is asserted.
DEFAULT_POLICY_TEXT = ('{"version": "default/4", "taint": {"follow_links": true, "strict_link_sources": true, '
                       '"mcp_tool_descriptions": true}, "arguments": {"assert_formats": ["date", "date-time", '
                       '"email", "ipv4", "ipv6", "time", "uri", "uuid"]}}')
#: The defaults of earlier releases, still needed to re-derive the decisions they recorded
#: (default/3: before arguments.assert_formats; default/2: before taint.strict_link_sources and
#: taint.mcp_tool_descriptions; default/1: before http_get was an egress tool and before taint.follow_links).
DEFAULT_3_POLICY_TEXT = ('{"version": "default/3", "taint": {"follow_links": true, "strict_link_sources": true, '
                         '"mcp_tool_descriptions": true}}')
DEFAULT_2_POLICY_TEXT = '{"version": "default/2", "taint": {"follow_links": true}}'
DEFAULT_1_POLICY_TEXT = '{"version": "default/1"}'
EARLIER_DEFAULT_POLICY_TEXTS = (DEFAULT_3_POLICY_TEXT, DEFAULT_2_POLICY_TEXT, DEFAULT_1_POLICY_TEXT)


#: The default's policy version, which a gateway on the default records in each new run's state
#: (`RunState.default_policy_version`).
DEFAULT_POLICY_VERSION = policy_version_of(json.loads(DEFAULT_POLICY_TEXT))
#: What a run whose state has no `default_policy_version` was accepted under: the state was
#: checkpointed by the release before default/3, whose default was default/2.
PREVIOUS_DEFAULT_POLICY_VERSION = policy_version_of(json.loads(DEFAULT_2_POLICY_TEXT))


def default_policy() -> LoadedPolicy:
    return parse_policy(DEFAULT_POLICY_TEXT)


def default_policies() -> tuple[LoadedPolicy, ...]:
    """Every default a gateway of this or an earlier release may have decided under (for auditors)."""
    return (default_policy(), *(parse_policy(text) for text in EARLIER_DEFAULT_POLICY_TEXTS))


def index_by_version(policies: Iterable[LoadedPolicy]) -> dict[str, LoadedPolicy]:
    """Policies by policy_version (what an auditor looks a decision's policy up by)."""
    return {p.policy_version: p for p in policies}
