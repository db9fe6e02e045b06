"""The pure decision: which scenario and turn answer a request, rendered with its templates."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from tether_modelserver.conversation import Conversation
from tether_modelserver.scenarios import Scenario, ScenarioSet, ScriptedTurn
from tether_security import open_envelope

_TEMPLATE = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)((?:\.[a-zA-Z0-9_]+)*)\s*\}\}")
_URL = re.compile(r"https?://[^\s<>\"'`]+")
#: `{{goal_url}}` when the goal names no URL.
DEFAULT_GOAL_URL = "https://example.com/"


class TemplateError(Exception):
    """A scenario string names a template variable that does not exist."""


@dataclass(frozen=True)
class ToolCallOut:
    id: str
    name: str
    #: The arguments exactly as sent on the wire (possibly not JSON at all).
    arguments: str


@dataclass(frozen=True)
class Reply:
    """An assistant message to send."""

    scenario: str
    turn: int
    text: str | None
    tool_calls: tuple[ToolCallOut, ...]
    #: OpenAI vocabulary: stop, tool_calls, length.
    finish_reason: str
    input_tokens: int
    output_tokens: int
    latency_ms: int


@dataclass(frozen=True)
class ErrorReply:
    """An HTTP error to send. `kind` picks the wire error shape (rate_limit, server, context_length, invalid)."""

    scenario: str | None
    turn: int
    status: int
    kind: str
    message: str
    code: str | None = None
    retry_after: float | None = None
    latency_ms: int = 0


def _lookup(value: Any, path: str) -> Any:
    for key in [p for p in path.split(".") if p]:
        if isinstance(value, str):
            # A tool result in the platform's data envelope reads as its attributes plus `content`.
            opened = open_envelope(value)
            if opened is not None:
                value = {**opened.attributes, "content": opened.content}
            else:
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    return ""
        if isinstance(value, dict):
            value = value.get(key, "")
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return ""
    return value


def goal_url(goal: str) -> str:
    """The first http(s) URL in the goal (trailing sentence punctuation dropped), else DEFAULT_GOAL_URL."""
    found = _URL.search(goal)
    return found.group(0).rstrip(".,;:!?)]}") if found else DEFAULT_GOAL_URL


def _variables(conv: Conversation, run_id: str) -> dict[str, Any]:
    return {
        "goal": conv.goal,
        "goal_url": goal_url(conv.goal),
        "turn": conv.turn_index,
        "run_id": run_id,
        "tool_result_count": len(conv.tool_results),
        "last_tool_result": conv.tool_results[-1] if conv.tool_results else "",
        "last_tool_name": conv.tool_result_names[-1] if conv.tool_result_names else "",
        "tool_results": "\n".join(conv.tool_results),
    }


def render(template: str, variables: dict[str, Any]) -> str:
    """Replace {{name}} / {{name.json.path}}; a path reads into a variable holding JSON text."""

    def sub(m: re.Match[str]) -> str:
        name, path = m.group(1), m.group(2)
        if name not in variables:
            raise TemplateError(f"unknown template variable {{{{{name}}}}}")
        value = _lookup(variables[name], path) if path else variables[name]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return _TEMPLATE.sub(sub, template)


def _render_value(value: Any, variables: dict[str, Any]) -> Any:
    if isinstance(value, str):
        return render(value, variables)
    if isinstance(value, list):
        return [_render_value(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: _render_value(v, variables) for k, v in value.items()}
    return value


def _estimate_tokens(chars: int) -> int:
    return max(1, math.ceil(chars / 4))


def _call_id(prefix: str, conv: Conversation, scenario: Scenario, index: int) -> str:
    digest = hashlib.sha256(f"{scenario.name}\x1f{conv.goal}\x1f{conv.turn_index}\x1f{index}".encode()).hexdigest()
    return f"{prefix}{digest[:24]}"


def _play(turn: ScriptedTurn, scenario: Scenario, conv: Conversation, run_id: str) -> Reply:
    variables = _variables(conv, run_id)
    text = render(turn.text, variables) if turn.text is not None else None
    prefix = "toolu_" if conv.api == "anthropic" else "call_"
    calls = []
    for i, call in enumerate(turn.tool_calls):
        if call.arguments_raw is not None:
            arguments = render(call.arguments_raw, variables)
        else:
            args = {} if call.arguments is None else _render_value(call.arguments, variables)
            arguments = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCallOut(call.id or _call_id(prefix, conv, scenario, i), call.name, arguments))
    finish = turn.finish_reason or ("tool_calls" if calls else "stop")
    out_chars = len(text or "") + sum(len(c.name) + len(c.arguments) for c in calls)
    usage = turn.usage
    return Reply(
        scenario=scenario.name,
        turn=conv.turn_index,
        text=text,
        tool_calls=tuple(calls),
        finish_reason=finish,
        input_tokens=usage.input_tokens if usage else _estimate_tokens(conv.message_chars),
        output_tokens=usage.output_tokens if usage else _estimate_tokens(out_chars),
        latency_ms=turn.latency_ms,
    )


def decide(scenarios: ScenarioSet, conv: Conversation, *, attempt: int = 1, run_id: str = "") -> Reply | ErrorReply:
    """The answer to a request: a function of the request (and its attempt number) only."""
    scenario = scenarios.select(conv.goal)
    turn_index = conv.turn_index
    if scenario is None:
        return ErrorReply(None, turn_index, 400, "invalid", "no scenario matches this goal", code="no_matching_scenario")
    if scenario.context_window_chars is not None and conv.message_chars > scenario.context_window_chars:
        return ErrorReply(
            scenario.name,
            turn_index,
            400,
            "context_length",
            f"This model's maximum context length is {scenario.context_window_chars} characters; "
            f"the messages have {conv.message_chars}.",
            code="context_length_exceeded",
        )
    if turn_index >= len(scenario.turns):
        if scenario.on_exhausted == "error":
            return ErrorReply(
                scenario.name,
                turn_index,
                400,
                "invalid",
                f"scenario {scenario.name!r} has {len(scenario.turns)} turns; turn {turn_index} was asked for",
                code="scenario_exhausted",
            )
        turn = scenario.turns[-1]
    else:
        turn = scenario.turns[turn_index]
    if 1 <= attempt <= len(turn.errors):
        err = turn.errors[attempt - 1]
        if err.code == "context_length_exceeded":
            kind = "context_length"
        else:
            kind = "rate_limit" if err.status == 429 else "server" if err.status >= 500 else "invalid"
        return ErrorReply(
            scenario.name,
            turn_index,
            err.status,
            kind,
            err.message,
            code=err.code,
            retry_after=err.retry_after,
            latency_ms=err.latency_ms,
        )
    return _play(turn, scenario, conv, run_id)
