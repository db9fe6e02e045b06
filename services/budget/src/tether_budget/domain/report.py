"""Termination reports: what a stopped run did, what is still open, why it stopped, what to do next."""

from __future__ import annotations

from tether_budget.domain.ledger import TERMINAL, CallStatus, Ledger, Reason
from tether_contracts.records import TerminationReport

_NEXT_ACTION: dict[str, str] = {
    Reason.STEP_CAP: "Review the work so far; resubmit with a higher max_steps or a narrower goal.",
    Reason.TOKEN_CAP: "Review the work so far; resubmit with a higher max_tokens or a narrower goal.",
    Reason.COST_CAP: "Review the work so far; resubmit with a higher max_cost_usd_micros or a cheaper model.",
    Reason.WALL_CLOCK_CAP: "Check what was slow (model latency, tool timeouts); resubmit with a longer "
    "max_wall_clock_ms.",
    Reason.TOOL_CALL_CAP: "Review the tool calls made; resubmit with a higher max_tool_calls or a narrower goal.",
    Reason.LOOP_DETECTED: "Inspect the repeated action and its results; fix the tool, its inputs or the agent's "
    "instructions, then resubmit.",
    Reason.CANCELLED: "Nothing required; resubmit if the work is still needed.",
    Reason.MODEL_FAILED: "Check the model provider's status and the error; resubmit when it is healthy.",
    Reason.CONTEXT_OVERFLOW: "Use a model with a larger context window, or split the goal into smaller runs.",
    Reason.APPROVAL_TIMEOUT: "Decide pending approvals within their expiry; resubmit the run.",
    Reason.OUTCOME_UNKNOWN: "Check in the target system whether the interrupted call took effect before resubmitting.",
    Reason.TENANT_SPEND_CAP: "The tenant's spend cap is reached; resubmit in the next spend window or ask an operator "
    "to raise the tenant's cap.",
}


def _pending(ledger: Ledger) -> list[str]:
    pending: list[str] = []
    if ledger.queued:
        pending.append("the whole run (it was waiting in the tenant's queue; nothing ran)")
    if ledger.deferred_step is not None:
        pending.append(f"model call for step {ledger.deferred_step} (its grant waited for the tenant's token rate or spend cap)")
    cur = ledger.current
    if cur is not None and not cur.model_done:
        pending.append(f"model call for step {cur.step}")
    if cur is not None and cur.model_done and cur.tool_call_count:
        missing = cur.tool_call_count - len(cur.call_ids)
        if missing > 0:
            pending.append(f"{missing} tool call(s) of step {cur.step} not yet requested")
    for call in ledger.calls.values():
        label = f"{call.call_id} {call.tool_name}"
        match call.status:
            case CallStatus.BUDGETED | CallStatus.APPROVED:
                pending.append(f"{label} {call.status} (may still execute; its outcome will be recorded)")
            case CallStatus.DECLINED:
                pending.append(f"{label} {call.status} (approval refused; awaiting the gateway's denial)")
            case CallStatus.APPROVAL_PENDING:
                pending.append(f"{label} {call.status} approval {call.approval_id}")
            case CallStatus.OUTCOME_UNKNOWN:
                pending.append(f"{label} {call.status} (may or may not have taken effect; check the target system)")
    return pending


def termination_report(ledger: Ledger, reason: str, detail: str) -> TerminationReport:
    """The report carried by RunTerminated, built from the ledger at the moment of the stop."""
    # Calls of folded steps (long runs) are one line of counts, then each later call.
    done = [ledger.folded.summary()] if ledger.folded.count else []
    done += [
        f"{c.call_id} {c.tool_name} {c.status}"
        for c in ledger.calls.values()
        if c.status in TERMINAL or c.status is CallStatus.NOT_BUDGETED
    ]
    pending = _pending(ledger)
    suggestion = _NEXT_ACTION.get(reason, "Review the run's event log.")
    if any(c.status is CallStatus.OUTCOME_UNKNOWN for c in ledger.calls.values()) and reason != Reason.OUTCOME_UNKNOWN:
        suggestion += " Some calls have an unknown outcome: check the target system before resubmitting."
    return TerminationReport(
        reason_code=str(reason),
        detail=detail,
        steps_done=ledger.steps_done,
        tool_calls_done=done,
        pending=pending,
        usage=ledger.usage,
        last_error=ledger.last_error,
        suggested_next_action=suggestion,
    )
