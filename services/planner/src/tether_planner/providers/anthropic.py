"""Adapter for the Anthropic Messages API: tool_use / tool_result blocks, headers x-api-key and anthropic-version."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tether_planner.domain.canonical import loads_standard
from tether_planner.domain.messages import ChatMessage, ToolView
from tether_planner.domain.validation import RawToolCall
from tether_planner.providers.http import (
    HttpProvider,
    HttpSettings,
    StreamCut,
    error_message,
    is_context_overflow,
    token_count,
    usage_object,
)
from tether_planner.providers.port import (
    FINISH_ERROR,
    FINISH_INCOMPLETE,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TOOL_CALLS,
    ContextOverflow,
    ModelRequest,
    ModelResponse,
    ProviderError,
)

DEFAULT_VERSION = "2023-06-01"

_STOP = {
    "end_turn": FINISH_STOP,
    "stop_sequence": FINISH_STOP,
    # A long turn the server paused (server tools): to be continued, not an answer.
    "pause_turn": FINISH_INCOMPLETE,
    "tool_use": FINISH_TOOL_CALLS,
    "max_tokens": FINISH_LENGTH,
    "refusal": FINISH_ERROR,
}
_RETRYABLE_ERROR_TYPES = {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}


def _tool_input(arguments: str) -> dict[str, Any]:
    # tool_use.input must be an object; arguments the model broke are carried under a key so
    # the model still sees what it sent next to the error it gets back.
    try:
        value = loads_standard(arguments) if arguments.strip() else {}
    except ValueError:  # JSONDecodeError, NonStandardJson (NaN would make the request body invalid JSON)
        return {"_unparsed_arguments": arguments}
    return value if isinstance(value, dict) else {"_unparsed_arguments": arguments}


def to_wire_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages API `messages`: alternating roles, tool results as user tool_result blocks placed first."""
    wire: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if wire and wire[-1]["role"] == role:
            wire[-1]["content"].extend(blocks)
        else:
            wire.append({"role": role, "content": list(blocks)})

    for m in messages:
        if m.role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": m.content}] if m.content else []
            blocks += [
                {"type": "tool_use", "id": c.id, "name": c.name, "input": _tool_input(c.arguments)} for c in m.tool_calls
            ]
            add("assistant", blocks or [{"type": "text", "text": "(no content)"}])
        elif m.role == "tool":
            block: dict[str, Any] = {"type": "tool_result", "tool_use_id": m.tool_call_id, "content": m.content}
            if m.repair:
                block["is_error"] = True
            add("user", [block])
        else:
            # Platform notes and summaries travel as user text: the system parameter holds only
            # the agent's instructions.
            add("user", [{"type": "text", "text": m.content}])
    for msg in wire:
        if msg["role"] == "user":
            results = [b for b in msg["content"] if b["type"] == "tool_result"]
            others = [b for b in msg["content"] if b["type"] != "tool_result"]
            msg["content"] = results + others
    return wire


def to_wire_tools(tools: Sequence[ToolView]) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "input_schema": t.schema()} for t in tools]


def _finish(raw: Any, has_calls: bool) -> tuple[str, str | None]:
    """(normalised, as sent): none sent means a finished answer; an unknown one means incomplete."""
    if not raw:
        return (FINISH_TOOL_CALLS if has_calls else FINISH_STOP), None
    return (_STOP.get(raw, FINISH_INCOMPLETE) if isinstance(raw, str) else FINISH_INCOMPLETE), str(raw)


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _input_tokens(usage: Any) -> int | None:
    usage = usage_object(usage)
    tokens = token_count(usage.get("input_tokens"))
    if tokens is None:
        return None
    return tokens + (token_count(usage.get("cache_creation_input_tokens")) or 0) + (
        token_count(usage.get("cache_read_input_tokens")) or 0
    )


class AnthropicProvider(HttpProvider):
    """POST {base_url}/v1/messages."""

    def __init__(self, settings: HttpSettings, *, version: str = DEFAULT_VERSION, **kw: Any) -> None:
        super().__init__(settings, **kw)
        self.version = version

    def url(self) -> str:
        base = self.settings.base_url.rstrip("/")
        return base + "/messages" if base.endswith("/v1") else base + "/v1/messages"

    def body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "messages": to_wire_messages(request.messages),
        }
        if request.system:
            body["system"] = request.system
        if request.tools:
            body["tools"] = to_wire_tools(request.tools)
        if request.stream:
            body["stream"] = True
        return body

    def complete(self, request: ModelRequest) -> ModelResponse:
        headers = {"Content-Type": "application/json", "anthropic-version": self.version}
        if self.settings.api_key:
            headers["x-api-key"] = self.settings.api_key
        started = time.monotonic()
        (text, calls, (finish, raw_finish), usage_in, usage_out, model), attempts, retried = self.post(
            request, self.url(), headers, self.body(request), self._parse, self._parse_stream
        )
        return ModelResponse(
            text=text,
            tool_calls=tuple(calls),
            finish_reason=finish,
            input_tokens=usage_in,
            output_tokens=usage_out,
            attempts=attempts,
            latency_ms=int((time.monotonic() - started) * 1000),
            model=model or request.model,
            raw_finish_reason=raw_finish,
            retried_input_tokens=retried[0],
            retried_output_tokens=retried[1],
            retried_usage_estimated=retried[2],
        )

    def _error(self, body: Any) -> ProviderError:
        message = self.scrub(error_message(body, "error"))
        if is_context_overflow(None, message):
            return ContextOverflow(message)
        kind = body.get("error", {}).get("type") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
        return ProviderError(f"provider error: {message}", retryable=kind in _RETRYABLE_ERROR_TYPES)

    def _parse(self, data: Any) -> tuple:
        if not isinstance(data, dict) or data.get("type") == "error" or not isinstance(data.get("content"), list):
            raise self._error(data)
        text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
        calls = [
            RawToolCall(str(b.get("id", "")), str(b.get("name", "")), _arguments(b.get("input")))
            for b in data["content"]
            if b.get("type") == "tool_use"
        ]
        finish = _finish(data.get("stop_reason"), bool(calls))
        usage = usage_object(data.get("usage"))
        return text, calls, finish, _input_tokens(usage), token_count(usage.get("output_tokens")), data.get("model")

    def _parse_stream(self, events: Iterator[tuple[str | None, str]]) -> tuple:
        blocks: dict[int, dict[str, Any]] = {}
        stop_reason = None
        usage_in: int | None = None
        usage_out: int | None = None
        # message_start's output count is a start value; the final one comes with message_delta.
        final_out = False
        model = None
        stopped = False
        for _event, data in events:
            try:
                ev = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ProviderError(f"malformed stream event: {exc}", retryable=True) from exc
            kind = ev.get("type")
            if kind == "error":
                raise self._error(ev)
            if kind == "message_start":
                message = ev.get("message") or {}
                model = message.get("model")
                usage_in = _input_tokens(message.get("usage"))
                usage_out = token_count(usage_object(message.get("usage")).get("output_tokens"))
            elif kind == "content_block_start":
                block = dict(ev.get("content_block") or {})
                block["partial_json"] = ""
                blocks[int(ev.get("index", len(blocks)))] = block
            elif kind == "content_block_delta":
                block = blocks.setdefault(int(ev.get("index", 0)), {"type": "text", "text": "", "partial_json": ""})
                delta = ev.get("delta") or {}
                if delta.get("type") == "text_delta":
                    block["text"] = block.get("text", "") + delta.get("text", "")
                elif delta.get("type") == "input_json_delta":
                    block["partial_json"] += delta.get("partial_json", "")
            elif kind == "message_delta":
                stop_reason = (ev.get("delta") or {}).get("stop_reason") or stop_reason
                if usage_object(ev.get("usage")).get("output_tokens") is not None:
                    usage_out = token_count(ev["usage"]["output_tokens"])
                    final_out = True
            elif kind == "message_stop":
                stopped = True
                break
        if not stopped:
            raise StreamCut("stream ended before message_stop", reported=(usage_in, usage_out if final_out else None))
        text = "".join(b.get("text", "") for _, b in sorted(blocks.items()) if b.get("type") == "text")
        calls = []
        for _, b in sorted(blocks.items()):
            if b.get("type") != "tool_use":
                continue
            # The streamed input arrives as JSON text; an empty stream means the start block's input.
            arguments = b["partial_json"] if b["partial_json"] else _arguments(b.get("input") or {})
            calls.append(RawToolCall(str(b.get("id", "")), str(b.get("name", "")), arguments))
        finish = _finish(stop_reason, bool(calls))
        return text, calls, finish, usage_in, usage_out, model

