"""Where a tool call's argument values came from: the goal, an earlier tool result, or the model itself.

Recorded as ToolCallRequested.provenance_json (JSON pointer → origin) so the gateway and
auditors can see data flowing from untrusted tool output into a call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tether_planner.domain.canonical import canonical_json
from tether_planner.domain.messages import ChatMessage
from tether_planner.domain.tool_results import envelope_content

#: Shorter values ("en", "1") occur everywhere by chance; they are not attributed.
MIN_ATTRIBUTED_CHARS = 4


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k in sorted(value):
            yield from _leaves(value[k], f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}/{i}")
    elif isinstance(value, str):
        yield path, value


def provenance_of(args: dict[str, Any], context: Sequence[ChatMessage]) -> str:
    """Canonical JSON map from argument path to 'goal', 'tool:<call_id>' or 'model'."""
    goal = context[0].content if context else ""
    results = [
        (m.call_id, envelope_content(m.content)[1]) for m in context if m.role == "tool" and not m.repair and m.call_id
    ]
    origins: dict[str, str] = {}
    for path, text in _leaves(args):
        if len(text) < MIN_ATTRIBUTED_CHARS:
            continue
        if text in goal:
            origins[path] = "goal"
            continue
        origin = "model"
        for call_id, content in reversed(results):
            if text in content:
                origin = f"tool:{call_id}"
                break
        origins[path] = origin
    return canonical_json(origins)
