"""OpenAI chat-completions wire format: response bodies, SSE chunks and error bodies."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

from tether_modelserver.engine import ErrorReply, Reply

#: Bodies are fully deterministic, so a replayed request gets byte-identical answers.
CREATED = 1_700_000_000
CHUNK_CHARS = 8

_ERROR_TYPES = {
    "rate_limit": "rate_limit_exceeded",
    "server": "server_error",
    "context_length": "invalid_request_error",
    "invalid": "invalid_request_error",
}


def _completion_id(reply: Reply) -> str:
    return "chatcmpl-" + hashlib.sha256(f"{reply.scenario}\x1f{reply.turn}\x1f{reply.text}".encode()).hexdigest()[:24]


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.input_tokens,
        "completion_tokens": reply.output_tokens,
        "total_tokens": reply.input_tokens + reply.output_tokens,
    }


def completion(reply: Reply, model: str) -> dict[str, Any]:
    """A non-streaming chat.completion body."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.tool_calls
        ]
    return {
        "id": _completion_id(reply),
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": _usage(reply),
    }


def _pieces(text: str) -> list[str]:
    return [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] or [""]


def stream_events(reply: Reply, model: str, include_usage: bool) -> Iterator[bytes]:
    """SSE `data:` lines of a streamed chat.completion, ending with `data: [DONE]`."""
    base = {"id": _completion_id(reply), "object": "chat.completion.chunk", "created": CREATED, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if reply.text:
        for piece in _pieces(reply.text):
            yield chunk({"content": piece})
    for index, call in enumerate(reply.tool_calls):
        yield chunk(
            {
                "tool_calls": [
                    {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
                ]
            }
        )
        for piece in _pieces(call.arguments):
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    yield chunk({}, reply.finish_reason)
    if include_usage:
        body = {**base, "choices": [], "usage": _usage(reply)}
        yield b"data: " + json.dumps(body).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def error_body(err: ErrorReply) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": _ERROR_TYPES.get(err.kind, "invalid_request_error"),
            "param": "messages" if err.kind == "context_length" else None,
            "code": err.code,
        }
    }
