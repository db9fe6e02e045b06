"""Protobuf ↔ domain values for the tether.v1 API."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from tether_api.v1 import (
    agent_service_pb2 as agents_pb,
    approval_service_pb2 as approvals_pb,
    run_service_pb2 as runs_pb,
    tool_service_pb2 as tools_pb,
    types_pb2 as types_pb,
)
from tether_contracts.records import Caps, ModelRef, RiskClass, TerminationReport, Usage
from tether_run_api.domain.catalog import AgentDraft, AgentVersion, CapsDraft, ToolDraft, ToolVersion
from tether_run_api.domain.trace import Span, Trace, TracedEvent
from tether_run_api.domain.views import ApprovalView, EventView, RunStatus, RunView, StepView, ToolCallView

_RISK_TO_PB = {
    RiskClass.READ_ONLY: types_pb.RISK_CLASS_READ_ONLY,
    RiskClass.WRITE: types_pb.RISK_CLASS_WRITE,
    RiskClass.IRREVERSIBLE: types_pb.RISK_CLASS_IRREVERSIBLE,
}
_RISK_FROM_PB = {v: k.value for k, v in _RISK_TO_PB.items()}
_STATUS_TO_PB = {s: getattr(runs_pb, f"RUN_STATUS_{s.value}") for s in RunStatus}
_APPROVAL_TO_PB = {
    "PENDING": approvals_pb.APPROVAL_STATUS_PENDING,
    "APPROVED": approvals_pb.APPROVAL_STATUS_APPROVED,
    "REJECTED": approvals_pb.APPROVAL_STATUS_REJECTED,
    "EXPIRED": approvals_pb.APPROVAL_STATUS_EXPIRED,
    "WITHDRAWN": approvals_pb.APPROVAL_STATUS_WITHDRAWN,
}
APPROVAL_FROM_PB = {v: k for k, v in _APPROVAL_TO_PB.items()}


def approval_status_filter(value: int) -> str:
    """ListApprovals' status: "" for UNSPECIFIED (the handler's default), the name of a known value, and
    for a number this server does not know (proto3 enums are open) the number itself, which the handler
    refuses as a field violation rather than reading it as the default."""
    if value == approvals_pb.APPROVAL_STATUS_UNSPECIFIED:
        return ""
    return APPROVAL_FROM_PB.get(value, str(value))


_MAX_TS_MS = 253402300799_000  # 9999-12-31T23:59:59Z, the largest protobuf Timestamp


def ts(ms: int | None) -> Timestamp | None:
    if ms is None:
        return None
    t = Timestamp()
    # A read-model value outside Timestamp's range must not fail the whole response.
    t.FromMilliseconds(min(max(ms, 0), _MAX_TS_MS))
    return t


def caps_pb(c: Caps) -> types_pb.Caps:
    return types_pb.Caps(
        max_steps=c.max_steps,
        max_wall_clock_ms=c.max_wall_clock_ms,
        max_tokens=c.max_tokens,
        max_cost_usd_micros=c.max_cost_usd_micros,
        max_tool_calls=c.max_tool_calls,
    )


def caps_draft(c: types_pb.Caps) -> CapsDraft:
    return CapsDraft(
        max_steps=c.max_steps,
        max_wall_clock_ms=c.max_wall_clock_ms,
        max_tokens=c.max_tokens,
        max_cost_usd_micros=c.max_cost_usd_micros,
        max_tool_calls=c.max_tool_calls,
    )


def usage_pb(u: Usage) -> types_pb.Usage:
    return types_pb.Usage(input_tokens=u.input_tokens, output_tokens=u.output_tokens, cost_usd_micros=u.cost_usd_micros)


def model_pb(m: ModelRef) -> types_pb.ModelRef:
    return types_pb.ModelRef(provider=m.provider, name=m.name, context_window_tokens=m.context_window_tokens)


def report_pb(r: TerminationReport) -> types_pb.TerminationReport:
    return types_pb.TerminationReport(
        reason_code=r.reason_code,
        detail=r.detail,
        steps_done=r.steps_done,
        tool_calls_done=list(r.tool_calls_done),
        pending=list(r.pending),
        usage=usage_pb(r.usage),
        last_error=r.last_error or "",
        suggested_next_action=r.suggested_next_action,
    )


# -- agents -----------------------------------------------------------------------------------


def agent_draft(a: agents_pb.Agent) -> AgentDraft:
    return AgentDraft(
        agent_id=a.agent_id,
        display_name=a.display_name,
        instructions=a.instructions,
        model_provider=a.model.provider,
        model_name=a.model.name,
        context_window_tokens=a.model.context_window_tokens,
        tool_allowlist=tuple(a.tool_allowlist),
        caps=caps_draft(a.caps),
        compaction_threshold=a.compaction_threshold,
    )


def agent_pb(v: AgentVersion) -> agents_pb.Agent:
    s = v.spec
    return agents_pb.Agent(
        agent_id=s.agent_id,
        version=s.version,
        display_name=s.name,
        instructions=s.instructions,
        model=model_pb(s.model),
        tool_allowlist=list(s.tool_allowlist),
        caps=caps_pb(s.caps),
        compaction_threshold=s.compaction_threshold,
        create_time=ts(v.created_at_ms),
        created_by=v.created_by,
    )


# -- tools ------------------------------------------------------------------------------------


def tool_draft(t: tools_pb.Tool) -> ToolDraft:
    return ToolDraft(
        name=t.name,
        description=t.description,
        args_schema_json=t.args_schema_json,
        risk_class=_RISK_FROM_PB.get(t.risk_class, ""),
        idempotent=t.idempotent,
        untrusted_source=t.untrusted_source,
        executor_kind=t.executor_kind,
        executor_config_json=t.executor_config_json,
        timeout_ms=t.timeout_ms,
        pollable=t.pollable,
        egress=t.egress,
        constraints_json=t.constraints_json,
    )


def tool_pb(v: ToolVersion) -> tools_pb.Tool:
    s = v.spec
    return tools_pb.Tool(
        name=s.name,
        version=s.version,
        description=s.description,
        args_schema_json=s.args_schema_json,
        risk_class=_RISK_TO_PB[s.risk_class],
        idempotent=s.idempotent,
        untrusted_source=s.untrusted_source,
        executor_kind=s.executor_kind,
        executor_config_json=s.executor_config_json,
        timeout_ms=s.timeout_ms,
        pollable=s.pollable,
        egress=s.egress,
        constraints_json=s.constraints_json,
        disabled=v.disabled,
        create_time=ts(v.created_at_ms),
        created_by=v.created_by,
    )


# -- runs ---------------------------------------------------------------------------------------


def run_pb(r: RunView) -> runs_pb.Run:
    return runs_pb.Run(
        run_id=r.run_id,
        agent_id=r.agent_id,
        agent_version=r.agent_version,
        status=_STATUS_TO_PB[r.status],
        goal=r.goal,
        principal_id=r.principal_id,
        answer=r.answer,
        usage=usage_pb(r.usage),
        steps=r.steps,
        termination=report_pb(r.termination) if r.termination else None,
        create_time=ts(r.created_at_ms or None),
        update_time=ts(r.updated_at_ms or None),
        end_time=ts(r.ended_at_ms),
        last_seq=r.last_seq,
        chain_ok=r.chain_ok,
    )


def tool_call_pb(c: ToolCallView) -> runs_pb.RunToolCall:
    return runs_pb.RunToolCall(
        call_id=c.call_id,
        tool_name=c.tool_name,
        args_json=c.args_json,
        args_hash=c.args_hash,
        status=c.status,
        result_json=c.result_json,
        error_code=c.error_code,
        detail=c.detail,
        approval_id=c.approval_id,
    )


def step_pb(s: StepView) -> runs_pb.RunStep:
    return runs_pb.RunStep(
        step=s.step,
        status=s.status,
        usage=usage_pb(s.usage),
        assistant_text=s.assistant_text,
        finish_reason=s.finish_reason,
        tool_calls=[tool_call_pb(c) for c in s.tool_calls],
        start_time=ts(s.started_at_ms),
        end_time=ts(s.ended_at_ms),
    )


def event_pb(e: EventView) -> runs_pb.RunEvent:
    return runs_pb.RunEvent(
        run_id=e.run_id,
        seq=e.seq,
        event_id=e.event_id,
        event_type=e.event_type,
        record_time=ts(e.recorded_at_ms),
        payload_json=e.payload_json,
        hash=e.hash,
        prev_hash=e.prev_hash,
        terminal=e.terminal,
    )


def traced_pb(t: TracedEvent) -> runs_pb.TraceEvent:
    return runs_pb.TraceEvent(
        seq=t.event.seq,
        event_type=t.event.event_type,
        event_id=t.event.event_id,
        record_time=ts(t.event.recorded_at_ms),
        offset_ms=t.offset_ms,
        since_previous_ms=t.since_previous_ms,
        step=t.step,
        call_id=t.call_id,
        payload_json=t.event.payload_json,
    )


def span_pb(s: Span) -> runs_pb.TraceSpan:
    return runs_pb.TraceSpan(
        name=s.name,
        kind=s.kind,
        step=s.step,
        call_id=s.call_id,
        start_seq=s.start_seq,
        end_seq=s.end_seq,
        start_offset_ms=s.start_offset_ms,
        duration_ms=s.duration_ms,
        outcome=s.outcome,
    )


def trace_pb(run: RunView, trace: Trace) -> runs_pb.GetRunTraceResponse:
    return runs_pb.GetRunTraceResponse(
        run=run_pb(run),
        events=[traced_pb(t) for t in trace.events],
        spans=[span_pb(s) for s in trace.spans],
        duration_ms=trace.duration_ms,
        truncated=trace.truncated,
    )


# -- approvals ----------------------------------------------------------------------------------


def approval_pb(a: ApprovalView, now_ms: int) -> approvals_pb.Approval:
    risk = {r.value: v for r, v in _RISK_TO_PB.items()}.get(a.risk_class, types_pb.RISK_CLASS_UNSPECIFIED)
    return approvals_pb.Approval(
        approval_id=a.approval_id,
        run_id=a.run_id,
        call_id=a.call_id,
        step=a.step,
        tool_name=a.tool_name,
        args_json=a.args_json,
        args_hash=a.args_hash,
        risk_class=risk,
        reasons=list(a.reasons),
        provenance_json=a.provenance_json,
        status=_APPROVAL_TO_PB.get(a.effective_status(now_ms), approvals_pb.APPROVAL_STATUS_UNSPECIFIED),
        request_time=ts(a.requested_at_ms or None),
        expire_time=ts(a.expires_at_ms),
        decided_by=a.decided_by,
        decide_time=ts(a.decided_at_ms),
        comment=a.comment,
        refused_decision=None if a.refused_decision is None else approvals_pb.RefusedDecision(
            approver_id=a.refused_decision.approver_id,
            approve=a.refused_decision.approve,
            comment=a.refused_decision.comment,
            decide_time=ts(a.refused_decision.decided_at_ms),
            reason=a.refused_decision.reason,
        ),
    )
