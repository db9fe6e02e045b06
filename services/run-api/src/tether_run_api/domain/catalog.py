"""Agents and tools as versioned catalog entries: validation of drafts and the update merge."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

from jsonschema import Draft202012Validator, SchemaError

from tether_contracts.records import AgentSpec, Caps, ModelRef, RiskClass, ToolSpec
from tether_run_api.domain.errors import FieldViolation, InvalidArgument
from tether_run_api.domain.text import NUL_PROBLEM, check_no_nul, json_has_nul

# The gateway enforces the constraints; parsing them with its own (pure) parser here means a
# tool is refused at registration rather than failing closed on every call later.
from tether_tool_gateway.domain.constraints import ConstraintsInvalid, parse_constraints
from tether_tool_gateway.domain.executor_config import executor_config_problems

AGENT_ID = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")
# Tool names are function names the model emits, so they follow the providers' common subset.
TOOL_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}\Z")
PROVIDER = re.compile(r"^[a-z][a-z0-9_-]{0,31}\Z")
EXECUTOR_KINDS = frozenset({"builtin", "http", "mcp", "mcp_stdio", "sandbox"})

DEFAULT_CONTEXT_WINDOW = 128_000
DEFAULT_COMPACTION_THRESHOLD = 0.8
DEFAULT_MAX_TOOL_CALLS = 200
DEFAULT_TOOL_TIMEOUT_MS = 30_000
MAX_TOOL_TIMEOUT_MS = 15 * 60 * 1000


@dataclass(frozen=True)
class CapCeilings:
    """The budget service's ceilings on a run's caps (settings TETHER_BUDGET_CEILING_*, same defaults):
    a run above any of them is rejected CAPS_ABOVE_CEILING, so run-api refuses such caps up front."""

    max_steps: int = 1_000
    max_wall_clock_ms: int = 7 * 24 * 3_600_000
    max_tokens: int = 50_000_000
    max_cost_usd_micros: int = 1_000_000_000
    max_tool_calls: int = 10_000

    def violations(self, caps: Caps, path: str) -> list[FieldViolation]:
        """One violation per cap above its ceiling."""
        out = []
        for name in ("max_steps", "max_wall_clock_ms", "max_tokens", "max_cost_usd_micros", "max_tool_calls"):
            value, ceiling = getattr(caps, name), getattr(self, name)
            if value > ceiling:
                out.append(FieldViolation(f"{path}.{name}", f"{value} is above the service ceiling {ceiling} "
                                                           "(the budget service would reject every run)",
                                          reason="CAPS_ABOVE_CEILING"))
        return out


@dataclass(frozen=True)
class CatalogLimits:
    """Size caps of catalog entries, and the caps ceilings an agent must stay under (settings)."""

    max_instructions_chars: int = 64_000
    max_description_chars: int = 4_096
    max_schema_bytes: int = 64 * 1024
    max_executor_config_bytes: int = 16 * 1024
    max_constraints_bytes: int = 16 * 1024
    max_allowlist: int = 128
    ceilings: CapCeilings = CapCeilings()


@dataclass(frozen=True)
class CapsDraft:
    """Caps as a client sent them (0 = not set)."""

    max_steps: int = 0
    max_wall_clock_ms: int = 0
    max_tokens: int = 0
    max_cost_usd_micros: int = 0
    max_tool_calls: int = 0


@dataclass(frozen=True)
class AgentDraft:
    """An agent version as a client sent it, before validation."""

    agent_id: str
    display_name: str = ""
    instructions: str = ""
    model_provider: str = ""
    model_name: str = ""
    context_window_tokens: int = 0
    tool_allowlist: tuple[str, ...] = ()
    caps: CapsDraft = field(default_factory=CapsDraft)
    compaction_threshold: float = 0.0


@dataclass(frozen=True)
class ToolDraft:
    """A tool version as a client sent it, before validation. risk_class is "" when unspecified."""

    name: str
    description: str = ""
    args_schema_json: str = ""
    risk_class: str = ""
    idempotent: bool = False
    untrusted_source: bool = False
    executor_kind: str = ""
    executor_config_json: str = ""
    timeout_ms: int = 0
    pollable: bool = False
    egress: bool = False
    constraints_json: str = ""


@dataclass(frozen=True)
class AgentVersion:
    """One stored agent version."""

    spec: AgentSpec
    created_at_ms: int
    created_by: str


@dataclass(frozen=True)
class ToolVersion:
    """One stored tool version."""

    spec: ToolSpec
    disabled: bool
    created_at_ms: int
    created_by: str


def check_agent_id(agent_id: str, path: str = "agent_id") -> list[FieldViolation]:
    if not AGENT_ID.match(agent_id):
        return [FieldViolation(path, "must match [a-z][a-z0-9-]{0,62}")]
    return []


def check_tool_name(name: str, path: str = "name") -> list[FieldViolation]:
    if not TOOL_NAME.match(name):
        return [FieldViolation(path, "must match [a-z][a-z0-9_]{0,63}")]
    return []


def _caps_violations(caps: CapsDraft, path: str) -> list[FieldViolation]:
    out = []
    for name in ("max_steps", "max_wall_clock_ms", "max_tokens", "max_cost_usd_micros"):
        if getattr(caps, name) <= 0:
            out.append(FieldViolation(f"{path}.{name}", "must be positive"))
    if caps.max_tool_calls < 0:
        out.append(FieldViolation(f"{path}.max_tool_calls", "must not be negative (0 = default)"))
    return out


def validate_agent(draft: AgentDraft, limits: CatalogLimits, *, path: str = "agent") -> AgentSpec:
    """The agent spec (version 0, to be numbered by the store); raises InvalidArgument listing every bad field."""
    v = check_agent_id(draft.agent_id, f"{path}.agent_id")
    if not draft.display_name.strip() or len(draft.display_name) > 200:
        v.append(FieldViolation(f"{path}.display_name", "must be 1-200 characters"))
    if not draft.instructions.strip():
        v.append(FieldViolation(f"{path}.instructions", "must not be empty"))
    elif len(draft.instructions) > limits.max_instructions_chars:
        v.append(FieldViolation(f"{path}.instructions", f"must be at most {limits.max_instructions_chars} characters"))
    if not PROVIDER.match(draft.model_provider):
        v.append(FieldViolation(f"{path}.model.provider", "must name a provider adapter, e.g. 'openai' or 'anthropic'"))
    if not draft.model_name.strip() or len(draft.model_name) > 200:
        v.append(FieldViolation(f"{path}.model.name", "must be 1-200 characters"))
    v += check_no_nul(draft.display_name, f"{path}.display_name")
    v += check_no_nul(draft.instructions, f"{path}.instructions")
    v += check_no_nul(draft.model_name, f"{path}.model.name")
    if draft.context_window_tokens < 0:
        v.append(FieldViolation(f"{path}.model.context_window_tokens", "must not be negative (0 = default)"))
    if len(draft.tool_allowlist) > limits.max_allowlist:
        v.append(FieldViolation(f"{path}.tool_allowlist", f"must have at most {limits.max_allowlist} tools"))
    seen: set[str] = set()
    for i, name in enumerate(draft.tool_allowlist):
        v += check_tool_name(name, f"{path}.tool_allowlist[{i}]")
        if name in seen:
            v.append(FieldViolation(f"{path}.tool_allowlist[{i}]", f"duplicate tool {name!r}"))
        seen.add(name)
    v += _caps_violations(draft.caps, f"{path}.caps")
    if not 0.0 <= draft.compaction_threshold <= 1.0:
        v.append(FieldViolation(f"{path}.compaction_threshold", "must be in (0, 1] (0 = default 0.8)"))
    caps = Caps(
        max_steps=draft.caps.max_steps,
        max_wall_clock_ms=draft.caps.max_wall_clock_ms,
        max_tokens=draft.caps.max_tokens,
        max_cost_usd_micros=draft.caps.max_cost_usd_micros,
        max_tool_calls=draft.caps.max_tool_calls or DEFAULT_MAX_TOOL_CALLS,
    )
    v += limits.ceilings.violations(caps, f"{path}.caps")
    if v:
        raise InvalidArgument(v)
    return AgentSpec(
        agent_id=draft.agent_id,
        version=0,
        name=draft.display_name.strip(),
        instructions=draft.instructions,
        model=ModelRef(
            provider=draft.model_provider,
            name=draft.model_name.strip(),
            context_window_tokens=draft.context_window_tokens or DEFAULT_CONTEXT_WINDOW,
        ),
        tool_allowlist=list(draft.tool_allowlist),
        caps=caps,
        compaction_threshold=draft.compaction_threshold or DEFAULT_COMPACTION_THRESHOLD,
    )


def _json_object(text: str, path: str, limit: int, *, empty_ok: bool) -> tuple[dict | None, list[FieldViolation]]:
    if not text.strip():
        if empty_ok:
            return {}, []
        return None, [FieldViolation(path, "must not be empty")]
    if len(text.encode()) > limit:
        return None, [FieldViolation(path, f"must be at most {limit} bytes")]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [FieldViolation(path, f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")]
    if not isinstance(value, dict):
        return None, [FieldViolation(path, "must be a JSON object")]
    if json_has_nul(value):
        # Valid JSON (as the escape \u0000), but no jsonb column can hold it.
        return None, [FieldViolation(path, f"{NUL_PROBLEM} in any string or key")]
    return value, []


#: The only dialect a tool's argument schema may declare: the gateway validates every call's
#: arguments as draft 2020-12 whatever `$schema` says (its decisions of old logs must re-derive),
#: so a schema written for another draft would be enforced by rules its author did not mean
#: (draft-07 `dependencies` silently ignored, tuple `items` refused as invalid).
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"


def check_args_schema(text: str, limit: int, path: str = "args_schema_json") -> list[FieldViolation]:
    """Violations of a tool's argument schema: JSON, a valid draft 2020-12 JSON Schema (no other
    `$schema`: the gateway validates arguments as 2020-12), an object."""
    schema, v = _json_object(text, path, limit, empty_ok=False)
    if schema is None:
        return v
    if "$schema" in schema and schema["$schema"] not in (DRAFT_2020_12, DRAFT_2020_12 + "#"):
        return [FieldViolation(path, f"declares $schema {str(schema['$schema'])[:200]!r}; the gateway validates "
                                     f"arguments as JSON Schema draft 2020-12 only: declare {DRAFT_2020_12!r} or "
                                     "no $schema, and write the schema in that draft")]
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return [FieldViolation(path, f"is not a valid JSON Schema at {where}: {exc.message}")]
    if schema.get("type") != "object":
        return [FieldViolation(path, 'must describe the arguments object: top-level "type": "object"')]
    return []


def canonical_json(value: object) -> str:
    """Canonical JSON text (sorted keys, no spaces), as the run protocol hashes it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def validate_tool(draft: ToolDraft, limits: CatalogLimits, *, path: str = "tool") -> ToolSpec:
    """The tool spec (version 0, to be numbered by the store); raises InvalidArgument listing every bad field."""
    v = check_tool_name(draft.name, f"{path}.name")
    if not draft.description.strip() or len(draft.description) > limits.max_description_chars:
        v.append(FieldViolation(f"{path}.description", f"must be 1-{limits.max_description_chars} characters"))
    v += check_no_nul(draft.description, f"{path}.description")
    v += check_args_schema(draft.args_schema_json, limits.max_schema_bytes, f"{path}.args_schema_json")
    try:
        risk = RiskClass(draft.risk_class)
    except ValueError:
        risk = None
        v.append(FieldViolation(f"{path}.risk_class", f"must be one of {', '.join(r.value for r in RiskClass)}"))
    if draft.executor_kind not in EXECUTOR_KINDS:
        v.append(FieldViolation(f"{path}.executor_kind", f"must be one of {', '.join(sorted(EXECUTOR_KINDS))}"))
    config, cv = _json_object(
        draft.executor_config_json, f"{path}.executor_config_json", limits.max_executor_config_bytes, empty_ok=True
    )
    v += cv
    if config is not None:
        v += [FieldViolation(f"{path}.executor_config_json", problem)
              for problem in executor_config_problems(draft.executor_kind, config)]
    constraints, cons_v = _json_object(
        draft.constraints_json, f"{path}.constraints_json", limits.max_constraints_bytes, empty_ok=True
    )
    v += cons_v
    if constraints is not None:
        try:
            parse_constraints(canonical_json(constraints))
        except ConstraintsInvalid as exc:
            v.append(FieldViolation(f"{path}.constraints_json", str(exc)))
            constraints = None
    if not 0 <= draft.timeout_ms <= MAX_TOOL_TIMEOUT_MS:
        v.append(FieldViolation(f"{path}.timeout_ms", f"must be between 0 (default) and {MAX_TOOL_TIMEOUT_MS}"))
    if v or risk is None or config is None or constraints is None:
        raise InvalidArgument(v)
    return ToolSpec(
        name=draft.name,
        version=0,
        description=draft.description.strip(),
        # Canonical text, so identical schemas registered twice compare equal.
        args_schema_json=canonical_json(json.loads(draft.args_schema_json)),
        risk_class=risk,
        idempotent=draft.idempotent,
        untrusted_source=draft.untrusted_source,
        executor_kind=draft.executor_kind,
        executor_config_json=canonical_json(config),
        timeout_ms=draft.timeout_ms or DEFAULT_TOOL_TIMEOUT_MS,
        pollable=draft.pollable,
        egress=draft.egress,
        constraints_json=canonical_json(constraints),
    )


AGENT_MUTABLE_FIELDS = (
    "display_name",
    "instructions",
    "model",
    "tool_allowlist",
    "caps",
    "compaction_threshold",
)
_SUBFIELDS = {
    "model": {"provider": "model_provider", "name": "model_name", "context_window_tokens": "context_window_tokens"},
    "caps": {f: f for f in ("max_steps", "max_wall_clock_ms", "max_tokens", "max_cost_usd_micros", "max_tool_calls")},
}


def draft_of(spec: AgentSpec) -> AgentDraft:
    """The draft that reproduces a stored spec (the base of an update)."""
    return AgentDraft(
        agent_id=spec.agent_id,
        display_name=spec.name,
        instructions=spec.instructions,
        model_provider=spec.model.provider,
        model_name=spec.model.name,
        context_window_tokens=spec.model.context_window_tokens,
        tool_allowlist=tuple(spec.tool_allowlist),
        caps=CapsDraft(
            max_steps=spec.caps.max_steps,
            max_wall_clock_ms=spec.caps.max_wall_clock_ms,
            max_tokens=spec.caps.max_tokens,
            max_cost_usd_micros=spec.caps.max_cost_usd_micros,
            max_tool_calls=spec.caps.max_tool_calls,
        ),
        compaction_threshold=spec.compaction_threshold,
    )


def merge_update(latest: AgentSpec, update: AgentDraft, mask: list[str]) -> AgentDraft:
    """The next version's draft: fields named in `mask` from `update`, the rest from `latest`.

    An empty mask or "*" takes every mutable field (AIP-134 full replacement). Paths may name
    a sub-field of model or caps ("caps.max_steps"). Unknown paths raise InvalidArgument.
    """
    if not mask or mask == ["*"]:
        return replace(update, agent_id=latest.agent_id)
    merged = draft_of(latest)
    bad = []
    for i, path in enumerate(mask):
        head, _, sub = path.partition(".")
        if head not in AGENT_MUTABLE_FIELDS:
            bad.append(FieldViolation(f"update_mask.paths[{i}]", f"{path!r} is not an updatable field"))
            continue
        if not sub:
            if head in _SUBFIELDS:
                for attr in _SUBFIELDS[head].values():
                    merged = _take(merged, update, head, attr)
            else:
                merged = replace(merged, **{head: getattr(update, head)})
        elif head in _SUBFIELDS and sub in _SUBFIELDS[head]:
            merged = _take(merged, update, head, _SUBFIELDS[head][sub])
        else:
            bad.append(FieldViolation(f"update_mask.paths[{i}]", f"{path!r} is not an updatable field"))
    if bad:
        raise InvalidArgument(bad)
    return merged


def _take(merged: AgentDraft, update: AgentDraft, head: str, attr: str) -> AgentDraft:
    if head == "caps":
        return replace(merged, caps=replace(merged.caps, **{attr: getattr(update.caps, attr)}))
    return replace(merged, **{attr: getattr(update, attr)})
