"""Upper bounds of the protobuf size of what queries return, so a response is cut by bytes before it
passes the transport's send limit (gRPC would fail it with a bare RESOURCE_EXHAUSTED, on every retry)."""

from __future__ import annotations

import json

from tether_run_api.domain.views import EventView, RunView, StepView

# A field's tag and length prefix take at most 2 + 5 bytes, a varint at most 10; rounded up.
_FIELD = 12
_MESSAGE = 12  # a sub-message's (or repeated entry's) tag and length
_USAGE = _MESSAGE + 3 * _FIELD
_TIMESTAMP = _MESSAGE + 2 * _FIELD
#: Room for the response's own fields besides its list (a page token, counters).
RESPONSE_OVERHEAD = 8 * 1024


def _text(*texts: str) -> int:
    return sum(len(t.encode("utf-8", "surrogatepass")) + _FIELD for t in texts)


def run_bytes(run: RunView) -> int:
    """At most the size of the run's tether.v1.Run message."""
    size = _MESSAGE + _text(run.run_id, run.agent_id, run.goal, run.principal_id, run.answer)
    size += 4 * _FIELD + _USAGE + 3 * _TIMESTAMP
    report = run.termination
    if report is not None:
        size += _MESSAGE + _text(report.reason_code, report.detail, report.last_error or "",
                                 report.suggested_next_action, *report.tool_calls_done, *report.pending)
        size += _FIELD + _USAGE
    return size


def step_bytes(step: StepView) -> int:
    """At most the size of the step's tether.v1.RunStep entry in a list."""
    size = _MESSAGE + _FIELD + _text(step.status, step.assistant_text, step.finish_reason) + _USAGE + 2 * _TIMESTAMP
    for c in step.tool_calls:
        size += _MESSAGE + _text(c.call_id, c.tool_name, c.args_json, c.args_hash, c.status, c.result_json,
                                 c.error_code, c.detail, c.approval_id)
    return size


def trace_event_bytes(event: EventView) -> int:
    """At most what one event adds to a trace: its TraceEvent entry and a span it may open (whose name
    holds the call id and tool name from its payload)."""
    try:
        payload = json.loads(event.payload_json or "{}")
    except json.JSONDecodeError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    labels = [str(payload.get(k, "")) for k in ("call_id", "tool_name")]
    call = payload.get("call")
    if isinstance(call, dict):
        labels.append(str(call.get("call_id", "")))
    label = _text(*labels)
    traced = _MESSAGE + _text(event.event_type, event.event_id, event.payload_json) + _TIMESTAMP + 4 * _FIELD + label
    span = _MESSAGE + _text(event.event_type, "approval") + 5 * _FIELD + 2 * label + 32
    return traced + span
