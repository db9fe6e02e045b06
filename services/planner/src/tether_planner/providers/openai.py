"""Adapter for OpenAI-compatible chat completions with tools: OpenAI, vLLM, Ollama, llama.cpp, the scripted server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, Literal

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

_FINISH = {
    "stop": FINISH_STOP,
    "eos": FINISH_STOP,
    "tool_calls": FINISH_TOOL_CALLS,
    "function_call": FINISH_TOOL_CALLS,
    "length": FINISH_LENGTH,
    "content_filter": FINISH_ERROR,
}


#: Error types (OpenAI `error.type` / `error.code`) worth another attempt when a 200 body carries an error.
_RETRYABLE_ERROR_TYPES = {"server_error", "rate_limit_exceeded", "rate_limit_error", "overloaded_error", "api_error",
                          "timeout", "timeout_error", "service_unavailable"}


def _billed(usage: Any) -> tuple[int | None, int | None]:
    """The (input, output) tokens a cut stream reported before it stopped (the usage chunk comes
    last, with both); None for a count not sent or unreadable (the adapter estimates it)."""
    try:
        usage = usage_object(usage)
        return token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens"))
    except ValueError:
        return None, None


def _finish(raw: Any, has_calls: bool) -> str:
    """The normalised finish reason: none sent means a finished answer; an unknown one means incomplete."""
    if not raw:
        return FINISH_TOOL_CALLS if has_calls else FINISH_STOP
    return _FINISH.get(raw, FINISH_INCOMPLETE) if isinstance(raw, str) else FINISH_INCOMPLETE


MaxTokensParam = Literal["auto", "max_tokens", "max_completion_tokens"]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _arguments(value: Any) -> str:
    # Some servers (Ollama) may hand arguments over as an object instead of JSON text.
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def to_wire_messages(system: str, messages: list[ChatMessage] | tuple[ChatMessage, ...]) -> list[dict[str, Any]]:
    """The chat-completions `messages` for a working context."""
    wire: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for m in messages:
        if m.role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": m.content or None}
            if m.tool_calls:
                out["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in m.tool_calls
                ]
            wire.append(out)
        elif m.role == "tool":
            wire.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        else:
            wire.append({"role": m.role, "content": m.content})
    return wire


def to_wire_tools(tools: list[ToolView] | tuple[ToolView, ...]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.schema()}}
        for t in tools
    ]


class OpenAIChatProvider(HttpProvider):
    """POST {base_url}/chat/completions with `Authorization: Bearer <key>` when a key is configured."""

    def __init__(self, settings: HttpSettings, *, max_tokens_param: MaxTokensParam = "auto", **kw: Any) -> None:
        super().__init__(settings, **kw)
        if max_tokens_param == "auto":
            # OpenAI's own API wants max_completion_tokens (required by reasoning models);
            # other OpenAI-compatible servers know max_tokens.
            max_tokens_param = "max_completion_tokens" if "api.openai.com" in settings.base_url else "max_tokens"
        self.max_tokens_param = max_tokens_param

    def body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.model,
            "messages": to_wire_messages(request.system, list(request.messages)),
            self.max_tokens_param: request.max_tokens,
        }
        if request.tools:
            body["tools"] = to_wire_tools(list(request.tools))
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def complete(self, request: ModelRequest) -> ModelResponse:
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        url = self.settings.base_url.rstrip("/") + "/chat/completions"
        started = time.monotonic()
        (text, calls, (finish, raw_finish), usage_in, usage_out, model), attempts, retried = self.post(
            request, url, headers, self.body(request), lambda d: self._parse(d, request), lambda s: self._parse_stream(s, request)
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

    @staticmethod
    def _call_id(request: ModelRequest, index: int) -> str:
        return f"call_{request.step}_{request.call}_{index}"

    def _parse(self, data: Any, request: ModelRequest) -> tuple:
        if not isinstance(data, dict) or not data.get("choices"):
            message = error_message(data, "response has no choices")
            if is_context_overflow(None, message):
                raise ContextOverflow(self.scrub(message))
            err = data.get("error") if isinstance(data, dict) else None
            kind = (err.get("type") or err.get("code")) if isinstance(err, dict) else None
            # An error in a 200 body is retried only when it says it is transient (or does not say).
            retryable = kind is None or str(kind) in _RETRYABLE_ERROR_TYPES
            raise ProviderError(f"malformed provider response: {self.scrub(message)}", retryable=retryable)
        choice = data["choices"][0]
        message = choice.get("message") or {}
        calls = []
        for i, c in enumerate(message.get("tool_calls") or []):
            fn = c.get("function") or {}
            calls.append(RawToolCall(c.get("id") or self._call_id(request, i), str(fn.get("name", "")), _arguments(fn.get("arguments"))))
        legacy = message.get("function_call")
        if not calls and legacy:
            # The deprecated single-call form (finish_reason function_call) some servers still send.
            calls.append(RawToolCall(self._call_id(request, 0), str(legacy.get("name", "")), _arguments(legacy.get("arguments"))))
        raw_finish = choice.get("finish_reason")
        finish = (_finish(raw_finish, bool(calls)), str(raw_finish) if raw_finish is not None else None)
        usage = usage_object(data.get("usage"))
        return (
            _text(message.get("content")),
            calls,
            finish,
            token_count(usage.get("prompt_tokens")),
            token_count(usage.get("completion_tokens")),
            data.get("model"),
        )

    def _parse_stream(self, events: Iterator[tuple[str | None, str]], request: ModelRequest) -> tuple:
        text: list[str] = []
        slots: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        usage: dict[str, Any] = {}
        model = None
        done = False
        for _event, data in events:
            if data.strip() == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ProviderError(f"malformed stream chunk: {exc}", retryable=True) from exc
            if isinstance(chunk, dict) and chunk.get("error"):
                message = self.scrub(error_message(chunk, "error in stream"))
                if is_context_overflow(None, message):
                    raise ContextOverflow(message)
                raise ProviderError(f"stream error: {message}", retryable=True)
            model = chunk.get("model") or model
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text.append(_text(delta["content"]))
                legacy = delta.get("function_call")
                if legacy:
                    # The deprecated single-call form, streamed: one call, accumulated like index 0.
                    delta = {**delta, "tool_calls": [{"index": 0, "function": legacy}, *(delta.get("tool_calls") or [])]}
                for tc in delta.get("tool_calls") or []:
                    slot = slots.setdefault(int(tc.get("index", len(slots))), {"id": None, "name": "", "arguments": ""})
                    if tc.get("id"):
                        slot["id"] = tc["id"]
                    fn = tc.get("function") or {}
                    if fn.get("name"):
                        slot["name"] += fn["name"]
                    if fn.get("arguments") is not None:
                        slot["arguments"] += _arguments(fn["arguments"])
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        if not done and finish is None:
            raise StreamCut("stream ended before the response was complete", reported=_billed(usage))
        calls = [
            RawToolCall(slots[i]["id"] or self._call_id(request, n), slots[i]["name"], slots[i]["arguments"])
            for n, i in enumerate(sorted(slots))
        ]
        normalised = (_finish(finish, bool(calls)), str(finish) if finish is not None else None)
        usage = usage_object(usage)
        prompt, completion = token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens"))
        return "".join(text), calls, normalised, prompt, completion, model
