"""What the server needs to know about a request, read from the request body alone (so it is stateless)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

#: A compaction summary replaces earlier assistant turns; its header says how many, so the turn
#: index stays right after compaction. tether_planner.domain.compaction writes this header.
COMPACTION_HEADER = re.compile(r"\[tether:compacted assistant_turns=(\d+)")


class BadRequest(Exception):
    """The request body is not a chat request this server understands (answered with HTTP 400)."""


@dataclass(frozen=True)
class Conversation:
    """A chat request reduced to what scenario selection and turn rendering use."""

    api: Literal["openai", "anthropic"]
    model: str
    goal: str
    #: Assistant messages already in the request, plus turns a compaction summary stands for.
    turn_index: int
    #: Tool result contents, oldest first.
    tool_results: tuple[str, ...]
    #: Tool names of the tool results, oldest first ("" when the wire format does not say).
    tool_result_names: tuple[str, ...]
    #: Characters of all message contents (for a simulated context window).
    message_chars: int
    stream: bool
    include_usage: bool


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return json.dumps(content)


def _compacted_turns(text: str) -> int:
    return sum(int(m.group(1)) for m in COMPACTION_HEADER.finditer(text))


def _require_messages(body: Any) -> list[dict[str, Any]]:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a list of objects")
    return messages


def from_openai(body: Any) -> Conversation:
    """Read an OpenAI chat-completions request."""
    messages = _require_messages(body)
    goal: str | None = None
    turns = 0
    chars = 0
    results: list[str] = []
    names: list[str] = []
    call_names: dict[str, str] = {}
    for m in messages:
        role = m.get("role")
        text = _text_of(m.get("content"))
        chars += len(text)
        turns += _compacted_turns(text) if role in ("system", "user") else 0
        if role == "user" and goal is None:
            goal = text
        elif role == "assistant":
            turns += 1
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                chars += len(str(fn.get("arguments", "")))
                call_names[str(call.get("id"))] = str(fn.get("name", ""))
        elif role == "tool":
            results.append(text)
            names.append(m.get("name") or call_names.get(str(m.get("tool_call_id")), ""))
    if goal is None:
        raise BadRequest("no user message (the goal)")
    stream_options = body.get("stream_options") or {}
    return Conversation(
        api="openai",
        model=str(body.get("model", "")),
        goal=goal,
        turn_index=turns,
        tool_results=tuple(results),
        tool_result_names=tuple(names),
        message_chars=chars,
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
    )


def from_anthropic(body: Any) -> Conversation:
    """Read an Anthropic Messages API request."""
    messages = _require_messages(body)
    goal: str | None = None
    turns = 0
    chars = len(_text_of(body.get("system")))
    turns += _compacted_turns(_text_of(body.get("system")))
    results: list[str] = []
    names: list[str] = []
    call_names: dict[str, str] = {}
    for m in messages:
        role = m.get("role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else (content or [])
        if role == "assistant":
            turns += 1
        texts = []
        for b in blocks:
            if not isinstance(b, dict):
                continue
            kind = b.get("type")
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use":
                call_names[str(b.get("id"))] = str(b.get("name", ""))
                chars += len(json.dumps(b.get("input")))
            elif kind == "tool_result":
                result = _text_of(b.get("content"))
                chars += len(result)
                results.append(result)
                names.append(call_names.get(str(b.get("tool_use_id")), ""))
        text = "".join(texts)
        chars += len(text)
        if role == "user":
            turns += _compacted_turns(text)
            if goal is None and texts:
                goal = text
    if goal is None:
        raise BadRequest("no user message with text (the goal)")
    return Conversation(
        api="anthropic",
        model=str(body.get("model", "")),
        goal=goal,
        turn_index=turns,
        tool_results=tuple(results),
        tool_result_names=tuple(names),
        message_chars=chars,
        stream=bool(body.get("stream", False)),
        include_usage=True,
    )
