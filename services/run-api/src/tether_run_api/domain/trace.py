"""A run's trace: every event with its timing, and the spans of model calls, tool calls and approvals."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tether_run_api.domain.views import EventView

_V1 = "tether.v1."
_TOOL_OUTCOMES = {"ToolCallCompleted", "ToolCallFailed", "ToolCallDenied", "ToolCallOutcomeUnknown"}


@dataclass(frozen=True)
class TracedEvent:
    """An event with its offset from the run's first event and from the previous one."""

    event: EventView
    offset_ms: int
    since_previous_ms: int
    step: int
    call_id: str


@dataclass(frozen=True)
class Span:
    """A timed stretch: a step's model call, a tool call from budget to outcome, or an approval wait."""

    name: str
    kind: str  # model, tool, approval
    step: int
    call_id: str
    start_seq: int
    end_seq: int
    start_offset_ms: int
    duration_ms: int
    outcome: str  # short event type that closed the span; "" while open


@dataclass(frozen=True)
class Trace:
    """The whole trace of a run (or its first `limit` events)."""

    events: tuple[TracedEvent, ...]
    spans: tuple[Span, ...]
    duration_ms: int
    truncated: bool


def _where(payload: dict) -> tuple[int, str]:
    step = payload.get("step")
    call_id = payload.get("call_id")
    call = payload.get("call")
    if not call_id and isinstance(call, dict):
        call_id = call.get("call_id")
    if not isinstance(step, int) and isinstance(call_id, str) and "." in call_id:
        head = call_id.split(".", 1)[0]
        step = int(head) if head.isdigit() else 0
    return (step if isinstance(step, int) else 0), (call_id if isinstance(call_id, str) else "")


def _payload(event: EventView) -> dict:
    try:
        value = json.loads(event.payload_json or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def build_trace(events: list[EventView], *, truncated: bool = False) -> Trace:
    """Offsets and spans from events in seq order. Timing uses each event's recorded time."""
    if not events:
        return Trace(events=(), spans=(), duration_ms=0, truncated=truncated)
    start = events[0].recorded_at_ms
    traced: list[TracedEvent] = []
    open_spans: dict[tuple[str, str], tuple[str, int, str, int, int]] = {}
    spans: list[Span] = []
    previous = start

    def close(key: tuple[str, str], ev: EventView, short: str) -> None:
        opened = open_spans.pop(key, None)
        if opened is None:
            return
        name, step, call_id, seq, at = opened
        spans.append(
            Span(name, key[0], step, call_id, seq, ev.seq, at - start, max(0, ev.recorded_at_ms - at), short)
        )

    for ev in events:
        payload = _payload(ev)
        step, call_id = _where(payload)
        traced.append(
            TracedEvent(ev, ev.recorded_at_ms - start, max(0, ev.recorded_at_ms - previous), step, call_id)
        )
        previous = ev.recorded_at_ms
        short = ev.event_type.removeprefix(_V1)
        if short == "StepGranted":
            open_spans[("model", str(step))] = (f"step {step} model", step, "", ev.seq, ev.recorded_at_ms)
        elif short in ("ModelCallCompleted", "ModelCallFailed"):
            close(("model", str(step)), ev, short)
        elif short == "ToolCallBudgeted":
            tool = payload.get("tool_name", "")
            label = f"call {call_id}" + (f" {tool}" if tool else "")
            open_spans[("tool", call_id)] = (label, step, call_id, ev.seq, ev.recorded_at_ms)
        elif short in _TOOL_OUTCOMES:
            key = ("tool", call_id)
            if key in open_spans and payload.get("tool_name"):
                name, *rest = open_spans[key]
                open_spans[key] = (f"call {call_id} {payload['tool_name']}", *rest)
            close(key, ev, short)
        elif short == "ApprovalRequested":
            open_spans[("approval", call_id)] = (f"approval {call_id}", step, call_id, ev.seq, ev.recorded_at_ms)
        elif short == "ApprovalDecided":
            close(("approval", call_id), ev, short)

    end = events[-1].recorded_at_ms
    for (kind, _), (name, step, call_id, seq, at) in open_spans.items():
        spans.append(Span(name, kind, step, call_id, seq, events[-1].seq, at - start, max(0, end - at), ""))
    spans.sort(key=lambda s: (s.start_seq, s.kind))
    return Trace(events=tuple(traced), spans=tuple(spans), duration_ms=max(0, end - start), truncated=truncated)
