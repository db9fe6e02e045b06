"""Submitting a run: request validation, caps tightening, and the SubmitRun snapshot the log carries."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from tether_contracts.records import AgentSpec, Caps, SubmitRun, TenantLimits, ToolSpec
from tether_run_api.domain.auth import Principal
from tether_run_api.domain.catalog import CapCeilings, CapsDraft, canonical_json, check_agent_id, check_tool_name
from tether_run_api.domain.errors import FieldViolation, InvalidArgument
from tether_run_api.domain.text import check_no_nul

REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}\Z")
RUN_ID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}\Z")
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


@dataclass(frozen=True)
class RunLimits:
    """Caps on what a submit may carry, and the caps ceilings a run must stay under (settings)."""

    max_goal_chars: int = 32_000
    ceilings: CapCeilings = CapCeilings()


@dataclass(frozen=True)
class SubmitRequest:
    """A SubmitRun call as the client sent it (request_id already defaulted if empty)."""

    request_id: str
    agent_id: str
    goal: str
    agent_version: int = 0
    caps: CapsDraft = field(default_factory=CapsDraft)
    #: Tools a delegating principal scoped the run to; None = not delegated.
    delegated_scope: tuple[str, ...] | None = None


def check_request_id(request_id: str, path: str = "request_id") -> list[FieldViolation]:
    """Violations of a client request id (a UUID fits; 1-128 of [A-Za-z0-9._:-])."""
    if not REQUEST_ID.match(request_id):
        return [FieldViolation(path, "must be 1-128 characters of [A-Za-z0-9._:-] (a UUID is recommended)")]
    return []


def check_run_id(run_id: str, path: str = "run_id") -> list[FieldViolation]:
    """Violations of a run id (26-character ULID)."""
    if not RUN_ID.match(run_id):
        return [FieldViolation(path, "must be a 26-character run id")]
    return []


def validate_submit(req: SubmitRequest, limits: RunLimits) -> None:
    """Raise InvalidArgument listing every invalid field of the submit."""
    v = check_request_id(req.request_id)
    v += check_agent_id(req.agent_id)
    if req.agent_version < 0:
        v.append(FieldViolation("agent_version", "must not be negative (0 = latest)"))
    if not req.goal.strip():
        v.append(FieldViolation("goal", "must not be empty"))
    elif len(req.goal) > limits.max_goal_chars:
        v.append(FieldViolation("goal", f"must be at most {limits.max_goal_chars} characters, got {len(req.goal)}"))
    v += check_no_nul(req.goal, "goal")
    for name in ("max_steps", "max_wall_clock_ms", "max_tokens", "max_cost_usd_micros", "max_tool_calls"):
        if getattr(req.caps, name) < 0:
            v.append(FieldViolation(f"caps.{name}", "must not be negative (0 = the agent's cap)"))
    for i, name in enumerate(req.delegated_scope or ()):
        v += check_tool_name(name, f"delegated_scope.tools[{i}]")
    if v:
        raise InvalidArgument(v)


def effective_caps(agent: Caps, requested: CapsDraft) -> Caps:
    """The run's caps: the agent's, each tightened by the request's non-zero value; loosening is refused."""
    v = []
    values = {}
    for name in ("max_steps", "max_wall_clock_ms", "max_tokens", "max_cost_usd_micros", "max_tool_calls"):
        ceiling = getattr(agent, name)
        asked = getattr(requested, name)
        if asked > ceiling:
            v.append(FieldViolation(f"caps.{name}", f"may only tighten the agent's cap ({ceiling}), got {asked}"))
        values[name] = asked or ceiling
    if v:
        raise InvalidArgument(v)
    return Caps(**values)


def request_fingerprint(req: SubmitRequest) -> str:
    """Hash of what the client asked for, so a reused request_id with another request is detected."""
    body = {
        "agent_id": req.agent_id,
        "agent_version": req.agent_version,
        "goal": req.goal,
        "caps": [
            req.caps.max_steps,
            req.caps.max_wall_clock_ms,
            req.caps.max_tokens,
            req.caps.max_cost_usd_micros,
            req.caps.max_tool_calls,
        ],
        "delegated_scope": None if req.delegated_scope is None else sorted(set(req.delegated_scope)),
    }
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def snapshot_tools(allowlist: list[str], latest_enabled: list[ToolSpec]) -> list[ToolSpec]:
    """The allowlisted tools the tenant has (latest enabled versions), in allowlist order.

    A name on the allowlist without an enabled version is left out; the gateway then denies
    any call to it, because it is not in the run's snapshot.
    """
    by_name = {t.name: t for t in latest_enabled}
    return [by_name[name] for name in allowlist if name in by_name]


def build_submit(
    principal: Principal,
    req: SubmitRequest,
    agent: AgentSpec,
    tools: list[ToolSpec],
    grants: list[str],
    tenant_limits: TenantLimits | None = None,
) -> SubmitRun:
    """The SubmitRun command: everything the run needs, snapshotted so the log alone explains it
    (with the tenant's limits for the run's partition lane, when the tenant has any)."""
    return SubmitRun(
        request_id=req.request_id,
        principal_id=principal.principal_id,
        goal=req.goal,
        agent=agent,
        tools=snapshot_tools(list(agent.tool_allowlist), tools),
        caps=effective_caps(agent.caps, req.caps),
        tenant_grants=sorted(set(grants)),
        delegated_scope=None if req.delegated_scope is None else sorted(set(req.delegated_scope)),
        tenant_limits=tenant_limits,
    )


def new_run_id(now_ms: int, randomness: bytes) -> str:
    """A ULID: 48-bit millisecond time + 80 random bits in Crockford base32, so ids sort by creation."""
    if len(randomness) != 10:
        raise ValueError("a run id needs exactly 10 random bytes")
    value = (now_ms & ((1 << 48) - 1)) << 80 | int.from_bytes(randomness, "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))
