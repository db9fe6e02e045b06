"""The projector's per-run fold: what it must remember between events to derive the next rows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class RunStatus:
    """Values of runs.status."""

    QUEUED = "QUEUED"  # waiting in its tenant's queue for a concurrency slot (RunQueued)
    ACCEPTED = "ACCEPTED"  # admitted, no step granted yet
    RUNNING = "RUNNING"
    WAITING_APPROVAL = "WAITING_APPROVAL"  # a tool call waits for a human decision
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # a non-idempotent call's outcome is unknown; a human decides
    COMPLETED = "COMPLETED"
    TERMINATED = "TERMINATED"
    REJECTED = "REJECTED"

    ENDED = frozenset({COMPLETED, TERMINATED, REJECTED})


class CallStatus:
    """Values of tool_calls.status."""

    REQUESTED = "REQUESTED"  # proposed by the model
    BUDGETED = "BUDGETED"  # budget reserved; the gateway decides
    AUTHORIZED = "AUTHORIZED"  # the gateway's policy allowed it without a human; it runs
    WAITING_APPROVAL = "WAITING_APPROVAL"
    APPROVED = "APPROVED"  # a human approved; the gateway executes
    DENIED = "DENIED"  # the gateway refused, or the approval was rejected/expired
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"
    RESOLVED = "RESOLVED"  # outcome unknown, then a human let the run go on

    #: Outcomes that finish a call for its step (the budget grants the next step after them).
    TERMINAL = frozenset({DENIED, COMPLETED, FAILED, RESOLVED})


class StepStatus:
    """Values of steps.status."""

    GRANTED = "GRANTED"  # budget allowed the model call; the planner is calling the model
    TOOL_CALLS = "TOOL_CALLS"  # the model proposed tool calls that are not all finished
    COMPLETED = "COMPLETED"  # the model answered and every proposed call finished
    FAILED = "FAILED"  # the model call failed


class ApprovalStatus:
    """Values of approvals.status."""

    PENDING = "PENDING"
    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    EXPIRED = "EXPIRED"
    WITHDRAWN = "WITHDRAWN"  # the call finished or the run ended before anyone decided


class CallFold(BaseModel):
    """What the projector remembers of one tool call."""

    step: int
    tool_name: str = ""
    status: str = CallStatus.REQUESTED
    approval_id: str | None = None


class RunFold(BaseModel):
    """The fold of one run's log events; persisted with the run (runs.state) and re-read per event."""

    run_id: str
    tenant_id: str
    status: str = RunStatus.ACCEPTED
    principal_id: str | None = None
    request_id: str | None = None
    goal: str | None = None
    agent_id: str | None = None
    agent_version: int | None = None
    agent_name: str | None = None
    model_provider: str | None = None
    model_name: str | None = None
    caps: dict[str, Any] | None = None
    #: RunQueued seen and no RunAccepted yet: the run waits for a slot of its tenant.
    queued: bool = False
    deadline_ms: int | None = None
    answer: str | None = None
    reason_code: str | None = None
    termination: dict[str, Any] | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd_micros: int = 0
    #: Model calls completed.
    steps: int = 0
    #: Highest step granted.
    current_step: int = 0
    tool_calls: int = 0
    created_at_ms: int = 0
    updated_at_ms: int = 0
    ended_at_ms: int | None = None
    last_seq: int = 0
    last_hash: str = ""
    chain_ok: bool = True
    chain_problems: list[str] = Field(default_factory=list)
    calls: dict[str, CallFold] = Field(default_factory=dict)
    #: Tool calls the model proposed per step (from ModelCallCompleted.tool_call_count).
    step_call_counts: dict[int, int] = Field(default_factory=dict)
    #: Steps whose row is final (COMPLETED or FAILED), so a late outcome does not re-close them.
    steps_closed: list[int] = Field(default_factory=list)
    #: Approvals asked for and not yet decided: approval id → call id.
    pending_approvals: dict[str, str] = Field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.status in RunStatus.ENDED
