"""A run's working context as the planner keeps it: a fold over the run event log (plus the step's repairs).

Every function here is pure and returns a new state; the committed state object is never
mutated (the loop keeps it to undo an aborted batch).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from tether_contracts.records import (
    RunAccepted,
    StepGranted,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
)
from tether_planner.domain.messages import ChatMessage, PinnedModel, ToolCallRef, ToolView, UsageTotals
from tether_planner.domain.tool_results import wrap_tool_result
from tether_security import InjectionDetector

LOOP_WARNING_PREFIX = "Platform note (loop detection): "


class PendingStep(BaseModel):
    """A granted step whose model call has not finished."""

    step: int
    granted_event_id: str
    remaining_tokens: int
    remaining_cost_usd_micros: int
    remaining_wall_clock_ms: int


class RunState(BaseModel):
    """The planner's per-run state, checkpointed to its changelog with the events it emitted."""

    tenant_id: str
    goal: str
    instructions: str
    model: PinnedModel
    compaction_threshold: float = 0.8
    #: Every tool of the run's snapshot; calls to other names are UNKNOWN_TOOL.
    tools: list[ToolView] = Field(default_factory=list)
    #: Names the model is offered (the agent's allowlist; the gateway still decides).
    offered: list[str] = Field(default_factory=list)
    #: The conversation; messages[0] is the goal.
    messages: list[ChatMessage] = Field(default_factory=list)
    #: Highest run-log sequence number folded in, so a re-delivered event is not folded twice.
    last_seq: int = 0
    #: Highest step whose model call finished (its outcome emitted or seen in the log).
    done_step: int = 0
    pending: PendingStep | None = None
    usage: UsageTotals = Field(default_factory=UsageTotals)
    #: A final answer was emitted: no step starts any more.
    finished: bool = False
    #: The run ended (RunTerminated) while `pending`'s model call was in flight: only that call's
    #: outcome (its usage: it cost money) is still recorded, then the state goes.
    ended: bool = False
    #: An upper bound on this state's checkpoint size in bytes, kept by the handlers so a record
    #: need not encode the whole conversation to know its checkpoint fits (0: not known yet).
    checkpoint_bound: int = 0

    def tool_map(self) -> dict[str, ToolView]:
        return {t.name: t for t in self.tools}

    def offered_tools(self) -> list[ToolView]:
        names = set(self.offered)
        return [t for t in self.tools if t.name in names]

    def seen(self, seq: int | None) -> bool:
        """True when the log event with this sequence number is already folded in."""
        return seq is not None and seq <= self.last_seq

    def after(self, seq: int | None) -> int:
        return self.last_seq if seq is None else max(self.last_seq, seq)


# -- building the state from the log ---------------------------------------------------------


def new_run(accepted: RunAccepted, tenant_id: str, seq: int | None) -> RunState:
    """The state of a freshly accepted run: instructions, goal, pinned model, tool snapshots."""
    agent = accepted.agent
    tools = [ToolView(name=t.name, description=t.description, args_schema_json=t.args_schema_json) for t in accepted.tools]
    names = [t.name for t in tools]
    allow = set(agent.tool_allowlist)
    offered = [n for n in names if n in allow] if allow else names
    return RunState(
        tenant_id=tenant_id,
        goal=accepted.goal,
        instructions=agent.instructions,
        model=PinnedModel(
            provider=agent.model.provider,
            name=agent.model.name,
            context_window_tokens=agent.model.context_window_tokens,
        ),
        compaction_threshold=agent.compaction_threshold,
        tools=tools,
        offered=offered,
        messages=[ChatMessage(role="user", content=accepted.goal)],
        last_seq=seq or 0,
    )


def grant_step(state: RunState, granted: StepGranted, event_id: str, seq: int | None) -> RunState:
    """Record the grant (the loop warning becomes a system note) and make the step pending."""
    messages = list(state.messages)
    if granted.loop_warning:
        messages.append(ChatMessage(role="system", content=LOOP_WARNING_PREFIX + granted.loop_warning, step=granted.step))
    r = granted.remaining
    pending = PendingStep(
        step=granted.step,
        granted_event_id=event_id,
        remaining_tokens=r.tokens,
        remaining_cost_usd_micros=r.cost_usd_micros,
        remaining_wall_clock_ms=r.wall_clock_ms,
    )
    return state.model_copy(update={"messages": messages, "pending": pending, "last_seq": state.after(seq)})


def _provider_call_id(state: RunState, call_id: str) -> str:
    for m in reversed(state.messages):
        for c in m.tool_calls:
            if c.call_id == call_id:
                return c.id
    return call_id


ToolOutcome = ToolCallCompleted | ToolCallFailed | ToolCallDenied | ToolCallOutcomeUnknown


def tool_result_message(
    state: RunState, outcome: ToolOutcome, *, max_chars: int, detector: InjectionDetector | None = None
) -> ChatMessage:
    """The tool message for a call's outcome, wrapped in a data envelope with provenance."""
    untrusted = False
    if isinstance(outcome, ToolCallCompleted):
        status = "ok"
        untrusted = outcome.untrusted
        if outcome.result_json is not None:
            content: object = outcome.result_json
        elif outcome.result_ref is not None:
            content = {"stored_out_of_band": {"sha256": outcome.result_ref.sha256, "size": outcome.result_ref.size}}
        else:
            content = ""
    elif isinstance(outcome, ToolCallFailed):
        status = "failed"
        content = {"error_code": outcome.error_code, "detail": outcome.detail, "retryable": outcome.retryable}
    elif isinstance(outcome, ToolCallDenied):
        status = "denied"
        content = {"reason_code": outcome.reason_code, "detail": outcome.detail}
    else:
        status = "outcome_unknown"
        content = {"detail": outcome.detail, "note": "the call may or may not have taken effect; a human decides"}
    return ChatMessage(
        role="tool",
        content=wrap_tool_result(
            tool_name=outcome.tool_name,
            call_id=outcome.call_id,
            status=status,
            content=content,
            untrusted=untrusted,
            max_chars=max_chars,
            detector=detector,
        ),
        tool_call_id=_provider_call_id(state, outcome.call_id),
        tool_name=outcome.tool_name,
        call_id=outcome.call_id,
        step=outcome.step,
    )


def record_tool_outcome(state: RunState, message: ChatMessage, seq: int | None) -> RunState:
    """Add a call's result; a later outcome of the same call (after OutcomeUnknown) replaces it."""
    messages = list(state.messages)
    for i, m in enumerate(messages):
        if m.role == "tool" and m.call_id is not None and m.call_id == message.call_id:
            messages[i] = message
            break
    else:
        messages.append(message)
    return state.model_copy(update={"messages": messages, "last_seq": state.after(seq)})


def awaiting_results(state: RunState, call_id: str | None = None) -> int:
    """Calls of the latest turn with tool calls (or of the turn that made `call_id`) still without a result."""
    answered = {m.tool_call_id for m in state.messages if m.role == "tool"}
    for m in reversed(state.messages):
        if m.role == "assistant" and m.tool_calls and (call_id is None or any(c.call_id == call_id for c in m.tool_calls)):
            return sum(1 for c in m.tool_calls if c.id not in answered)
    return 0


def record_model_call_seen(
    state: RunState, step: int, assistant_text: str | None, usage: UsageTotals, seq: int | None
) -> RunState:
    """Fold a ModelCallCompleted from the log for a step this state has not recorded (a rebuild)."""
    if step <= state.done_step:
        return state.model_copy(update={"last_seq": state.after(seq)})
    messages = [*state.messages, ChatMessage(role="assistant", content=assistant_text or "", step=step)]
    return state.model_copy(
        update={
            "messages": messages,
            "done_step": step,
            "pending": None,
            "usage": state.usage + usage,
            "last_seq": state.after(seq),
        }
    )


def has_tool_call(state: RunState, step: int, call_id: str) -> bool:
    """Whether the step's assistant message already carries the call (recorded with the step's outcome)."""
    for m in reversed(state.messages):
        if m.role == "assistant" and m.step == step and not m.repair:
            return any(c.call_id == call_id for c in m.tool_calls)
    return False


def record_tool_call_seen(state: RunState, step: int, ref: ToolCallRef, seq: int | None) -> RunState:
    """Fold a ToolCallRequested from the log into its step's assistant message, unless already there."""
    messages = list(state.messages)
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "assistant" and m.step == step and not m.repair:
            if all(c.call_id != ref.call_id for c in m.tool_calls):
                messages[i] = m.model_copy(update={"tool_calls": (*m.tool_calls, ref)})
            break
    return state.model_copy(update={"messages": messages, "last_seq": state.after(seq)})


def record_step_failed_seen(state: RunState, step: int, seq: int | None) -> RunState:
    done = max(state.done_step, step)
    pending = None if state.pending is not None and state.pending.step <= done else state.pending
    return state.model_copy(update={"done_step": done, "pending": pending, "last_seq": state.after(seq)})


# -- the outcome of a step's model call ----------------------------------------------------------


def finish_step(
    state: RunState,
    step: int,
    *,
    messages: Sequence[ChatMessage],
    base_len: int,
    usage: UsageTotals,
    final: bool,
) -> RunState:
    """The step's model call is done. `messages` is the step's new working context, built from
    the first `base_len` messages of the state; anything folded in since is kept after it."""
    new_messages = [*messages, *state.messages[base_len:]] if messages else list(state.messages)
    return state.model_copy(
        update={
            "messages": new_messages,
            "done_step": max(state.done_step, step),
            "pending": None,
            "usage": state.usage + usage,
            "finished": state.finished or final,
        }
    )
