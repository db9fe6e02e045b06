"""Anthropic Messages API wire format: message bodies, SSE events and error bodies."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

from tether_modelserver.engine import ErrorReply, Reply

CHUNK_CHARS = 8

_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
_ERROR_TYPES = {
    "rate_limit": "rate_limit_error",
    "server": "api_error",
    "context_length": "invalid_request_error",
    "invalid": "invalid_request_error",
}


def _message_id(reply: Reply) -> str:
    return "msg_" + hashlib.sha256(f"{reply.scenario}\x1f{reply.turn}\x1f{reply.text}".encode()).hexdigest()[:24]


def _input_of(arguments: str) -> Any:
    # The Messages API carries tool input as a JSON value; deliberately broken arguments are
    # sent as the raw string so a client sees malformed input, as it would from a bad model.
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def message(reply: Reply, model: str) -> dict[str, Any]:
    """A non-streaming message body."""
    content: list[dict[str, Any]] = []
    if reply.text:
        content.append({"type": "text", "text": reply.text})
    for call in reply.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input_of(call.arguments)})
    return {
        "id": _message_id(reply),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _STOP_REASONS.get(reply.finish_reason, reply.finish_reason),
        "stop_sequence": None,
        "usage": {"input_tokens": reply.input_tokens, "output_tokens": reply.output_tokens},
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def _pieces(text: str) -> list[str]:
    return [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]


def stream_events(reply: Reply, model: str) -> Iterator[bytes]:
    """SSE events of a streamed message (message_start … message_stop)."""
    start = message(reply, model)
    start.update(content=[], stop_reason=None, usage={"input_tokens": reply.input_tokens, "output_tokens": 1})
    yield _event("message_start", {"type": "message_start", "message": start})
    yield _event("ping", {"type": "ping"})
    index = 0
    if reply.text:
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
        )
        for piece in _pieces(reply.text):
            yield _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}},
            )
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    for call in reply.tool_calls:
        yield _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": index,
                "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}},
            },
        )
        for piece in _pieces(call.arguments):
            yield _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": piece},
                },
            )
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        index += 1
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": _STOP_REASONS.get(reply.finish_reason, reply.finish_reason), "stop_sequence": None},
            "usage": {"output_tokens": reply.output_tokens},
        },
    )
    yield _event("message_stop", {"type": "message_stop"})


def error_body(err: ErrorReply) -> dict[str, Any]:
    message_text = err.message
    if err.kind == "context_length":
        message_text = f"prompt is too long: {err.message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.kind, "invalid_request_error"), "message": message_text}}
