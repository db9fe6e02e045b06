"""Projection of one sequenced log event: the run's next fold and the rows it writes.

`project(fold, envelope, payload)` is a pure function of its inputs (recorded values only, no
clock), so projecting the log twice — incrementally, or in a rebuild from offset 0 — writes the
same rows. Handlers per payload type sit in the table at the bottom of the module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    Envelope,
    ModelCallCompleted,
    ModelCallFailed,
    RunAccepted,
    RunCompleted,
    RunQueued,
    RunRejected,
    RunTerminated,
    StepGranted,
    TerminationReport,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
    Usage,
)
from tether_messaging.chain import GENESIS_HASH, verify_chain
from tether_projector.domain.errors import UnsealedEvent
from tether_projector.domain.rows import Json, Upsert
from tether_projector.domain.state import (
    ApprovalStatus,
    CallFold,
    CallStatus,
    RunFold,
    RunStatus,
    StepStatus,
)

#: Chain problems kept per run (the first ones matter; a broken chain is flagged by chain_ok).
MAX_CHAIN_PROBLEMS = 20

_CALL_ID = re.compile(r"^(\d+)\.(\d+)$")


@dataclass(frozen=True)
class Projected:
    """The outcome of projecting one event."""

    fold: RunFold
    writes: list[Upsert]
    #: Chain defects found at this event (also recorded in the fold).
    chain_problems: list[str]


def is_duplicate(fold: RunFold | None, envelope: Envelope) -> bool:
    """True if the event is at or before the run's last projected seq (a redelivery or replay)."""
    if envelope.seq is None:
        raise UnsealedEvent(envelope.event_id, envelope.run_id)
    return fold is not None and envelope.seq <= fold.last_seq


def project(fold: RunFold | None, envelope: Envelope, payload: AvroRecord) -> Projected:
    """The run's fold after `envelope` and the rows to write; `fold` (None for a new run) is not changed.

    The caller skips duplicates first (`is_duplicate`). Events of a type the projector has no
    handler for are still recorded in the events table and advance last_seq. (An event this build
    cannot decode at all — a schema fingerprint it does not know — never gets here: the live
    projector stops on it and a rebuild fails, so it is projected after the upgrade, not skipped.)
    """
    advanced = advance(None if fold is None else fold.model_copy(deep=True), envelope, payload)
    return Projected(advanced.fold, [*advanced.writes, run_row(advanced.fold)], advanced.chain_problems)


def advance(fold: RunFold | None, envelope: Envelope, payload: AvroRecord) -> Projected:
    """`project` for a caller that folds many events of a run: `fold` is updated in place (the
    caller owns it and keeps no copy of the state before), and the runs row is left out — the
    caller writes `run_row(fold)` once, after the run's last event of the batch.

    A batch of a busy run holds dozens of its events; copying the fold and dumping it for a runs
    row per event, only for `merge` to keep the last row, was most of a batch's projection before
    its database writes (services/projector/bench/batch_cpu.py).
    """
    seq, prev_hash, hash_ = envelope.seq, envelope.prev_hash, envelope.hash
    if seq is None or prev_hash is None or hash_ is None:
        raise UnsealedEvent(envelope.event_id, envelope.run_id)
    problems = check_chain(fold, envelope)  # against the state before this event
    # An event naming another tenant than its run's is recorded (under its own tenant) and flagged
    # by the chain check, but it changes nothing of the run: applied, it would show that tenant's
    # content (an approval, a call) as this run's tenant's.
    foreign = fold is not None and envelope.tenant_id != fold.tenant_id
    if fold is None:
        fold = RunFold(run_id=envelope.run_id, tenant_id=envelope.tenant_id, created_at_ms=envelope.recorded_at_ms)
    if problems:
        fold.chain_ok = False
        room = MAX_CHAIN_PROBLEMS - len(fold.chain_problems)
        fold.chain_problems.extend(problems[: max(room, 0)])

    writes = [event_row(fold, envelope, payload)]
    handler = None if foreign else HANDLERS.get(type(payload))
    if handler is not None:
        writes.extend(handler(payload, envelope, fold))
    fold.status = derive_status(fold)
    fold.last_seq = seq
    fold.last_hash = hash_
    fold.updated_at_ms = envelope.recorded_at_ms
    return Projected(fold, writes, problems)


def check_chain(fold: RunFold | None, envelope: Envelope) -> list[str]:
    """Defects of the event's place in its run's hash chain, as 'seq N KIND: detail' strings."""
    seq = envelope.seq
    expected_seq = (fold.last_seq if fold else 0) + 1
    expected_prev = fold.last_hash if fold else GENESIS_HASH
    # The event's own seal, by the log's rule (tether_messaging.chain.verify_chain, the event
    # trusted as its anchor so only the event itself is judged): a seq below 1 or a prev_hash/hash
    # that is not 64 lowercase hex characters is a HASH_MISMATCH ('malformed: ...') even when
    # the hash was computed over it, as is content that does not hash to the event's hash.
    problems = [f"seq {seq} {p.kind.value}: {p.detail}" for p in verify_chain([envelope], from_genesis=False)]
    if seq is not None and seq > expected_seq:
        problems.append(f"seq {seq} GAP: seq {expected_seq}..{seq - 1} missing")
    elif envelope.prev_hash != expected_prev:
        problems.append(f"seq {seq} PREV_HASH_MISMATCH: prev_hash {envelope.prev_hash} != {expected_prev}")
    if fold is not None and envelope.tenant_id != fold.tenant_id:
        problems.append(f"seq {seq} TENANT_MISMATCH: event tenant {envelope.tenant_id} != run tenant {fold.tenant_id}")
    return problems


def problem_kind(problem: str) -> str:
    """The kind (GAP, HASH_MISMATCH, ...) of a chain problem string from `check_chain`."""
    return problem.split(" ", 3)[2].rstrip(":")


def derive_status(fold: RunFold) -> str:
    """The run's status from its fold: an ended run stays ended; a human wait shows over running."""
    if fold.ended:
        return fold.status
    if fold.queued:
        return RunStatus.QUEUED
    if any(c.status == CallStatus.OUTCOME_UNKNOWN for c in fold.calls.values()):
        return RunStatus.OUTCOME_UNKNOWN
    if fold.pending_approvals:
        return RunStatus.WAITING_APPROVAL
    if fold.current_step >= 1:
        return RunStatus.RUNNING
    return RunStatus.ACCEPTED


# -- rows ----------------------------------------------------------------------------------
RUN_COLUMNS = (
    "tenant_id", "status", "principal_id", "request_id", "goal", "agent_id", "agent_version",
    "agent_name", "model_provider", "model_name", "deadline_ms", "answer", "reason_code",
    "input_tokens", "output_tokens", "cost_usd_micros", "steps", "current_step", "tool_calls",
    "created_at_ms", "updated_at_ms", "ended_at_ms", "last_seq", "last_hash", "chain_ok",
)


def run_row(fold: RunFold) -> Upsert:
    """The runs row: every column derived from the fold (which is stored with it in `state`)."""
    values: dict[str, Any] = {c: getattr(fold, c) for c in RUN_COLUMNS}
    values["caps"] = Json(fold.caps)
    values["termination"] = Json(fold.termination)
    values["chain_problems"] = Json(fold.chain_problems)
    values["state"] = Json(fold.model_dump(mode="json"))
    return Upsert("runs", (fold.run_id,), values)


def event_row(fold: RunFold, envelope: Envelope, payload: AvroRecord) -> Upsert:
    """The events row: the log entry as recorded (under the tenant it names, which is the run's
    unless the chain check found a TENANT_MISMATCH), with the payload decoded to JSON."""
    return Upsert(
        "events",
        (envelope.run_id, envelope.seq),
        {
            "tenant_id": envelope.tenant_id,
            "event_id": envelope.event_id,
            "event_type": envelope.event_type,
            "recorded_at_ms": envelope.recorded_at_ms,
            "producer": envelope.producer,
            # pydantic's compiled dump: the datum `to_avro()` builds (str enums stay members, which
            # JSON writes as their values), several times faster.
            "payload": Json(payload.avro_datum()),
            "hash": envelope.hash,
            "prev_hash": envelope.prev_hash,
            "causation_id": envelope.causation_id,
        },
        only_insert=True,
    )


def _step_row(fold: RunFold, step: int, values: dict[str, Any]) -> Upsert:
    return Upsert("steps", (fold.run_id, step), {"tenant_id": fold.tenant_id, **values})


def _usage_columns(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cost_usd_micros": usage.cost_usd_micros,
    }


def call_index_of(call_id: str) -> int | None:
    """The call index encoded in a '<step>.<call_index>' call id, or None for another form."""
    m = _CALL_ID.match(call_id)
    return int(m.group(2)) if m else None


def _call(fold: RunFold, call_id: str, step: int, tool_name: str = "") -> CallFold:
    call = fold.calls.get(call_id)
    if call is None:
        # An outcome for a call whose request the projector never saw: keep what is known.
        call = fold.calls[call_id] = CallFold(step=step, tool_name=tool_name)
    elif tool_name and not call.tool_name:
        call.tool_name = tool_name
    return call


def _call_row(fold: RunFold, env: Envelope, call_id: str, step: int, values: dict[str, Any]) -> Upsert:
    return Upsert(
        "tool_calls",
        (fold.run_id, call_id),
        {
            "tenant_id": fold.tenant_id,
            "step": step,
            "call_index": call_index_of(call_id),
            "updated_at_ms": env.recorded_at_ms,
            **values,
        },
    )


def _call_outcome(fold: RunFold, env: Envelope, call_id: str, step: int, tool_name: str, status: str,
                  values: dict[str, Any]) -> list[Upsert]:
    """A call reached `status`: its row, approvals made moot, and the step if it is now complete."""
    call = _call(fold, call_id, step, tool_name)
    call.status = status
    row_values = {"tool_name": call.tool_name, "status": status, **values}
    if status in CallStatus.TERMINAL:
        row_values["ended_at_ms"] = env.recorded_at_ms
    writes = [_call_row(fold, env, call_id, call.step, row_values)]
    if status in (CallStatus.COMPLETED, CallStatus.FAILED, CallStatus.DENIED):
        writes.extend(_withdraw_approvals(fold, env, call_id))
    writes.extend(_close_step_if_done(fold, env, call.step))
    return writes


def _withdraw_approvals(fold: RunFold, env: Envelope, call_id: str | None = None) -> list[Upsert]:
    """Pending approvals nobody can act on any more (of one call, or all of an ended run)."""
    writes = []
    for approval_id, approval_call in list(fold.pending_approvals.items()):
        if call_id is not None and approval_call != call_id:
            continue
        del fold.pending_approvals[approval_id]
        writes.append(
            Upsert(
                "approvals",
                (approval_id,),
                {"tenant_id": fold.tenant_id, "run_id": fold.run_id, "status": ApprovalStatus.WITHDRAWN,
                 "withdrawn_at_ms": env.recorded_at_ms},
            )
        )
    return writes


def _close_step_if_done(fold: RunFold, env: Envelope, step: int) -> list[Upsert]:
    if step in fold.steps_closed:
        return []
    expected = fold.step_call_counts.get(step)
    if expected is None:
        return []  # the model call has not answered yet
    done = sum(1 for c in fold.calls.values() if c.step == step and c.status in CallStatus.TERMINAL)
    if done < expected:
        return []
    fold.steps_closed.append(step)
    return [_step_row(fold, step, {"status": StepStatus.COMPLETED, "ended_at_ms": env.recorded_at_ms})]


def _report_lines(fold: RunFold) -> tuple[list[str], list[str]]:
    done, pending = [], []
    # Sorted, not dict order: the fold's calls come back from jsonb in jsonb's key order.
    for call_id, call in sorted(fold.calls.items(), key=lambda kv: (kv[1].step, call_index_of(kv[0]) or 0, kv[0])):
        line = f"{call_id} {call.tool_name} {call.status}"
        (done if call.status in CallStatus.TERMINAL else pending).append(line)
    return done, pending


def _end(fold: RunFold, env: Envelope, status: str, reason_code: str, termination: dict[str, Any]) -> list[Upsert]:
    """The run ended: status, reason and report are set once (the first end wins)."""
    if fold.ended:
        return []
    fold.status = status
    fold.reason_code = reason_code
    fold.termination = termination
    fold.ended_at_ms = env.recorded_at_ms
    return _withdraw_approvals(fold, env)


# -- handlers (payload, envelope, fold to update) → rows --------------------------------------
def on_run_queued(p: RunQueued, env: Envelope, fold: RunFold) -> list[Upsert]:
    fold.queued = True
    fold.principal_id = p.principal_id
    fold.request_id = p.request_id
    fold.goal = p.goal
    fold.agent_id = p.agent.agent_id
    fold.agent_version = p.agent.version
    fold.agent_name = p.agent.name
    fold.model_provider = p.agent.model.provider
    fold.model_name = p.agent.model.name
    return []


def on_run_accepted(p: RunAccepted, env: Envelope, fold: RunFold) -> list[Upsert]:
    fold.queued = False
    fold.principal_id = p.principal_id
    fold.request_id = p.request_id
    fold.goal = p.goal
    fold.agent_id = p.agent.agent_id
    fold.agent_version = p.agent.version
    fold.agent_name = p.agent.name
    fold.model_provider = p.agent.model.provider
    fold.model_name = p.agent.model.name
    fold.caps = p.caps.to_avro()
    fold.deadline_ms = p.deadline_ms
    return []


def on_run_rejected(p: RunRejected, env: Envelope, fold: RunFold) -> list[Upsert]:
    fold.request_id = p.request_id
    report = TerminationReport(
        reason_code=p.reason_code, detail=p.detail, steps_done=0, tool_calls_done=[], pending=[], usage=Usage()
    )
    return _end(fold, env, RunStatus.REJECTED, p.reason_code, report.to_avro())


def on_step_granted(p: StepGranted, env: Envelope, fold: RunFold) -> list[Upsert]:
    fold.current_step = max(fold.current_step, p.step)
    return [
        _step_row(
            fold,
            p.step,
            {
                "status": StepStatus.GRANTED,
                "started_at_ms": env.recorded_at_ms,
                "remaining_steps": p.remaining.steps,
                "remaining_tokens": p.remaining.tokens,
                "remaining_cost_usd_micros": p.remaining.cost_usd_micros,
                "remaining_wall_clock_ms": p.remaining.wall_clock_ms,
                "loop_warning": p.loop_warning,
            },
        )
    ]


def _add_usage(fold: RunFold, usage: Usage) -> None:
    fold.input_tokens += usage.input_tokens
    fold.output_tokens += usage.output_tokens
    fold.cost_usd_micros += usage.cost_usd_micros


def on_model_call_completed(p: ModelCallCompleted, env: Envelope, fold: RunFold) -> list[Upsert]:
    _add_usage(fold, p.usage)
    fold.steps += 1
    fold.step_call_counts[p.step] = p.tool_call_count
    values: dict[str, Any] = {
        "status": StepStatus.TOOL_CALLS if p.tool_call_count > 0 else StepStatus.COMPLETED,
        "model_provider": p.model.provider,
        "model_name": p.model.name,
        **_usage_columns(p.usage),
        "assistant_text": p.assistant_text,
        "message_ref": Json(p.message_ref.to_avro() if p.message_ref else None),
        "finish_reason": p.finish_reason,
        "latency_ms": p.latency_ms,
        "attempts": p.attempts,
        "compacted": p.compacted,
        "tool_call_count": p.tool_call_count,
        "model_completed_at_ms": env.recorded_at_ms,
    }
    writes = [_step_row(fold, p.step, values)]
    if p.tool_call_count == 0:
        fold.steps_closed.append(p.step)
        writes.append(_step_row(fold, p.step, {"ended_at_ms": env.recorded_at_ms}))
    else:
        # Outcomes of the step's calls may precede this in a damaged log; close if all are in.
        writes.extend(_close_step_if_done(fold, env, p.step))
    return writes


def on_model_call_failed(p: ModelCallFailed, env: Envelope, fold: RunFold) -> list[Upsert]:
    _add_usage(fold, p.usage)
    if p.step not in fold.steps_closed:
        fold.steps_closed.append(p.step)
    return [
        _step_row(
            fold,
            p.step,
            {
                "status": StepStatus.FAILED,
                **_usage_columns(p.usage),
                "error_code": p.error_code,
                "detail": p.detail,
                "attempts": p.attempts,
                "ended_at_ms": env.recorded_at_ms,
            },
        )
    ]


def on_run_completed(p: RunCompleted, env: Envelope, fold: RunFold) -> list[Upsert]:
    if fold.ended:
        return []
    fold.answer = p.answer
    # The recorded cumulative usage is authoritative over the projector's own sum.
    fold.input_tokens, fold.output_tokens, fold.cost_usd_micros = (
        p.usage.input_tokens, p.usage.output_tokens, p.usage.cost_usd_micros,
    )
    done, pending = _report_lines(fold)
    report = TerminationReport(
        reason_code="COMPLETED",
        detail="the model gave a final answer",
        steps_done=fold.steps,
        tool_calls_done=done,
        pending=pending,
        usage=p.usage,
    )
    return _end(fold, env, RunStatus.COMPLETED, "COMPLETED", report.to_avro())


def on_run_terminated(p: RunTerminated, env: Envelope, fold: RunFold) -> list[Upsert]:
    if fold.ended:
        return []
    usage = p.report.usage
    fold.input_tokens, fold.output_tokens, fold.cost_usd_micros = (
        usage.input_tokens, usage.output_tokens, usage.cost_usd_micros,
    )
    return _end(fold, env, RunStatus.TERMINATED, p.reason_code, p.report.to_avro())


def on_tool_call_requested(p: ToolCallRequested, env: Envelope, fold: RunFold) -> list[Upsert]:
    c = p.call
    if c.call_id not in fold.calls:
        fold.tool_calls += 1
    call = _call(fold, c.call_id, p.step, c.tool_name)
    call.status = CallStatus.REQUESTED
    return [
        _call_row(
            fold,
            env,
            c.call_id,
            p.step,
            {
                "call_index": c.call_index,
                "tool_name": c.tool_name,
                "args_json": c.args_json,
                "args_hash": c.args_hash,
                "idem_key": c.idem_key,
                "provenance_json": p.provenance_json,
                "status": CallStatus.REQUESTED,
                "requested_at_ms": env.recorded_at_ms,
            },
        )
    ]


def on_tool_call_budgeted(p: ToolCallBudgeted, env: Envelope, fold: RunFold) -> list[Upsert]:
    call = _call(fold, p.call_id, p.step)
    call.status = CallStatus.BUDGETED
    return [
        _call_row(
            fold, env, p.call_id, call.step,
            {"status": CallStatus.BUDGETED, "idem_key": p.idem_key, "budgeted_at_ms": env.recorded_at_ms},
        )
    ]


def on_tool_call_authorized(p: ToolCallAuthorized, env: Envelope, fold: RunFold) -> list[Upsert]:
    call = _call(fold, p.call_id, p.step, p.tool_name)
    call.status = CallStatus.AUTHORIZED
    # The decision's evidence goes where a denial's does: the policy version and inputs hash.
    return [
        _call_row(
            fold, env, p.call_id, call.step,
            {"tool_name": p.tool_name, "status": CallStatus.AUTHORIZED, "policy_version": p.policy_version,
             "inputs_hash": p.inputs_hash},
        )
    ]


def on_tool_call_denied(p: ToolCallDenied, env: Envelope, fold: RunFold) -> list[Upsert]:
    return _call_outcome(
        fold, env, p.call_id, p.step, p.tool_name, CallStatus.DENIED,
        {"error_code": p.reason_code, "detail": p.detail, "policy_version": p.policy_version,
         "inputs_hash": p.inputs_hash},
    )


def on_tool_call_completed(p: ToolCallCompleted, env: Envelope, fold: RunFold) -> list[Upsert]:
    return _call_outcome(
        fold, env, p.call_id, p.step, p.tool_name, CallStatus.COMPLETED,
        {
            "result_json": p.result_json,
            "result_ref": Json(p.result_ref.to_avro() if p.result_ref else None),
            "untrusted": p.untrusted,
            "duration_ms": p.duration_ms,
            "replayed": p.replayed,
        },
    )


def on_tool_call_failed(p: ToolCallFailed, env: Envelope, fold: RunFold) -> list[Upsert]:
    return _call_outcome(
        fold, env, p.call_id, p.step, p.tool_name, CallStatus.FAILED,
        {"error_code": p.error_code, "detail": p.detail, "retryable": p.retryable},
    )


def on_tool_call_outcome_unknown(p: ToolCallOutcomeUnknown, env: Envelope, fold: RunFold) -> list[Upsert]:
    return _call_outcome(fold, env, p.call_id, p.step, p.tool_name, CallStatus.OUTCOME_UNKNOWN, {"detail": p.detail})


def on_approval_requested(p: ApprovalRequested, env: Envelope, fold: RunFold) -> list[Upsert]:
    fold.pending_approvals[p.approval_id] = p.call_id
    call = _call(fold, p.call_id, p.step, p.tool_name)
    call.approval_id = p.approval_id
    if call.status != CallStatus.OUTCOME_UNKNOWN:
        # An unknown outcome stays visible as such while a human decides whether to go on.
        call.status = CallStatus.WAITING_APPROVAL
    return [
        _call_row(fold, env, p.call_id, call.step,
                  {"tool_name": call.tool_name, "status": call.status, "approval_id": p.approval_id}),
        Upsert(
            "approvals",
            (p.approval_id,),
            {
                "tenant_id": fold.tenant_id,
                "run_id": fold.run_id,
                "call_id": p.call_id,
                "step": p.step,
                "idem_key": p.idem_key,
                "tool_name": p.tool_name,
                "args_json": p.args_json,
                "args_hash": p.args_hash,
                "risk_class": p.risk_class.value,
                "reasons": list(p.reasons),
                "provenance_json": p.provenance_json,
                "policy_version": p.policy_version,
                "inputs_hash": p.inputs_hash,
                "requested_at_ms": env.recorded_at_ms,
                "expires_at_ms": p.expires_at_ms,
                "status": ApprovalStatus.PENDING,
            },
        ),
    ]


_DENIAL_REASON = {ApprovalOutcome.REJECTED: "APPROVAL_REJECTED", ApprovalOutcome.EXPIRED: "APPROVAL_EXPIRED"}


def on_approval_decided(p: ApprovalDecided, env: Envelope, fold: RunFold) -> list[Upsert]:
    fold.pending_approvals.pop(p.approval_id, None)
    writes = [
        Upsert(
            "approvals",
            (p.approval_id,),
            {
                "tenant_id": fold.tenant_id,
                "run_id": fold.run_id,
                "call_id": p.call_id,
                "args_hash": p.args_hash,
                "status": p.outcome.value,
                "decided_by": p.approver_id,
                "decided_at_ms": p.decided_at_ms,
                "comment": p.comment,
            },
        )
    ]
    call = fold.calls.get(p.call_id)
    if call is None:
        return writes
    if call.status == CallStatus.OUTCOME_UNKNOWN:
        if p.outcome == ApprovalOutcome.APPROVED:
            # A human checked the effect and lets the run go on; the call counts as done.
            writes.extend(_call_outcome(fold, env, p.call_id, call.step, call.tool_name, CallStatus.RESOLVED, {}))
        return writes  # rejected/expired: the budget ends the run
    if call.status == CallStatus.WAITING_APPROVAL:
        if p.outcome == ApprovalOutcome.APPROVED:
            call.status = CallStatus.APPROVED
            writes.append(_call_row(fold, env, p.call_id, call.step, {"status": CallStatus.APPROVED}))
        else:
            # The gateway's ToolCallDenied(APPROVAL_*) follows; the call is denied from now.
            writes.extend(
                _call_outcome(fold, env, p.call_id, call.step, call.tool_name, CallStatus.DENIED,
                              {"error_code": _DENIAL_REASON[p.outcome], "detail": p.comment or None})
            )
    return writes


def on_approval_decision_refused(p: ApprovalDecisionRefused, env: Envelope, fold: RunFold) -> list[Upsert]:
    """A human's decision read after the approval had expired: the approval stays EXPIRED, and its
    row shows the latest such decision (the run's events keep every one)."""
    return [
        Upsert(
            "approvals",
            (p.approval_id,),
            {
                "tenant_id": fold.tenant_id,
                "run_id": fold.run_id,
                "call_id": p.call_id,
                "refused_decision": Json({
                    "approver_id": p.approver_id,
                    "approve": p.approve,
                    "comment": p.comment,
                    "decided_at_ms": p.decided_at_ms,
                    "reason": p.reason,
                    "seq": env.seq,
                }),
            },
        )
    ]


Handler = Callable[[Any, Envelope, RunFold], list[Upsert]]

HANDLERS: dict[type[AvroRecord], Handler] = {
    RunQueued: on_run_queued,
    RunAccepted: on_run_accepted,
    RunRejected: on_run_rejected,
    StepGranted: on_step_granted,
    ModelCallCompleted: on_model_call_completed,
    ModelCallFailed: on_model_call_failed,
    RunCompleted: on_run_completed,
    RunTerminated: on_run_terminated,
    ToolCallRequested: on_tool_call_requested,
    ToolCallBudgeted: on_tool_call_budgeted,
    ToolCallAuthorized: on_tool_call_authorized,
    ToolCallDenied: on_tool_call_denied,
    ToolCallCompleted: on_tool_call_completed,
    ToolCallFailed: on_tool_call_failed,
    ToolCallOutcomeUnknown: on_tool_call_outcome_unknown,
    ApprovalRequested: on_approval_requested,
    ApprovalDecided: on_approval_decided,
    ApprovalDecisionRefused: on_approval_decision_refused,
}
