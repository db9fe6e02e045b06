"""Checks on the model's tool calls before they become requests: JSON, a known tool, the tool's JSON Schema.

Model output is untrusted input: a call that fails a check is never emitted. The planner
answers it with a machine-readable error as the tool result and asks the model again.
The gateway validates again (it is the authority); this check spares a step and a denial.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from tether_planner.domain.canonical import NonStandardJson, canonical_json, loads_standard
from tether_planner.domain.messages import ToolView
from tether_security.argument_schema import ASSERTABLE_FORMATS, SchemaReferenceUnresolvable, argument_validator

#: Problem codes returned to the model (stable; tests and dashboards use them).
INVALID_JSON = "INVALID_JSON"
ARGS_NOT_OBJECT = "ARGS_NOT_OBJECT"
UNKNOWN_TOOL = "UNKNOWN_TOOL"
INVALID_ARGS = "INVALID_ARGS"
NOT_EXECUTED = "NOT_EXECUTED"
#: The response was cut off at max_tokens: none of its calls is executed (arguments may be incomplete).
TRUNCATED = "TRUNCATED"

_MAX_SCHEMA_ERRORS = 5
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class RawToolCall:
    """A tool call as the provider returned it; `arguments` is the raw text (maybe not JSON)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ValidCall:
    raw: RawToolCall
    args: dict[str, Any]
    args_json: str


@dataclass(frozen=True)
class CallProblem:
    raw: RawToolCall
    code: str
    detail: str

    def as_error(self, available_tools: Sequence[str]) -> dict[str, Any]:
        """The machine-readable error sent back to the model as the call's result."""
        error: dict[str, Any] = {"code": self.code, "detail": self.detail, "tool": self.raw.name}
        if self.code == UNKNOWN_TOOL:
            error["available_tools"] = list(available_tools)
        return {
            "executed": False,
            "error": error,
            "instruction": "This call was not executed. Correct it and call again, or answer without it.",
        }


@lru_cache(maxsize=256)
def _validator(schema_json: str, formats: frozenset[str]) -> Draft202012Validator | None:
    """The checked validator of a tool's argument schema (its snapshot's text), or None if unusable.

    Cached by the schema's text, as at the gateway: checking a schema against the 2020-12
    meta-schema costs ≈ 1 ms, more than the rest of a call's check, and a run offers the same few
    tools step after step. The validator holds no state between `iter_errors` calls."""
    try:
        schema = json.loads(schema_json)
    except json.JSONDecodeError:
        schema = None
    if not isinstance(schema, dict):
        schema = {"type": "object"}  # as ToolView.schema(): an unreadable snapshot offers an open object
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError:
        return None
    # Never fetches a $ref to another document (a URL an MCP server chose), as at the gateway; asserts
    # the formats the gateway's policy asserts (the planner's assert_formats setting; by default every
    # one, as the default policy), so a malformed address or date goes back to the model at once
    # instead of costing a step and a denial, and no call the gateway would allow is refused here.
    return argument_validator(schema, formats)


def _schema_errors(args: dict[str, Any], schema_json: str, formats: frozenset[str]) -> list[str]:
    validator = _validator(schema_json, formats)
    if validator is None:
        # A tool snapshot with an unusable schema cannot be checked here; the gateway refuses it.
        return []
    try:
        errors = sorted(validator.iter_errors(args), key=lambda e: (list(e.absolute_path), e.message))
    except SchemaReferenceUnresolvable:
        return []
    out = []
    for e in errors[:_MAX_SCHEMA_ERRORS]:
        path = "/" + "/".join(str(p) for p in e.absolute_path)
        out.append(f"{path}: {e.message}")
    return out


def check_call(raw: RawToolCall, tools: Mapping[str, ToolView],
               formats: frozenset[str] = ASSERTABLE_FORMATS) -> ValidCall | CallProblem:
    """One call: a known tool, arguments that parse to a JSON object valid under the tool's schema
    (with `formats` asserted: the gateway policy's arguments.assert_formats)."""
    tool = tools.get(raw.name)
    if tool is None:
        return CallProblem(raw, UNKNOWN_TOOL, f"there is no tool named {raw.name!r}")
    text = raw.arguments.strip()
    try:
        # Some servers send "" for a call without arguments.
        args = loads_standard(text) if text else {}
    except json.JSONDecodeError as exc:
        return CallProblem(raw, INVALID_JSON, f"arguments are not valid JSON: {exc.msg} at position {exc.pos}")
    except NonStandardJson as exc:
        return CallProblem(raw, INVALID_JSON, f"arguments are not valid JSON: {exc}")
    except RecursionError:
        return CallProblem(raw, INVALID_JSON, "arguments are nested too deeply to read")
    if not isinstance(args, dict):
        return CallProblem(raw, ARGS_NOT_OBJECT, f"arguments must be a JSON object, got {type(args).__name__}")
    args_json = canonical_json(args)
    if _LONE_SURROGATE.search(args_json):
        # An escaped lone surrogate ("\\ud800") parses to one, which UTF-8 cannot encode: U+FFFD
        # instead, as at the tool gateway (in canonical JSON it can only stand inside a string).
        args_json = _LONE_SURROGATE.sub("\ufffd", args_json)
        args = json.loads(args_json)
    errors = _schema_errors(args, tool.args_schema_json, formats)
    if errors:
        return CallProblem(raw, INVALID_ARGS, "arguments do not match the tool's schema: " + "; ".join(errors))
    return ValidCall(raw, args, args_json)


def check_calls(calls: Sequence[RawToolCall], tools: Mapping[str, ToolView],
                formats: frozenset[str] = ASSERTABLE_FORMATS) -> list[ValidCall | CallProblem]:
    """Every call of a response. When any call fails, the valid ones are not executed either
    (reported as NOT_EXECUTED), so a response is executed whole or not at all."""
    checked = [check_call(c, tools, formats) for c in calls]
    if all(isinstance(c, ValidCall) for c in checked):
        return checked
    return [
        c
        if isinstance(c, CallProblem)
        else CallProblem(c.raw, NOT_EXECUTED, "another call in the same response was invalid; send this call again")
        for c in checked
    ]
