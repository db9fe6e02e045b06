"""What the queries return: runs, steps, events and approvals as the read model records them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tether_contracts.records import TerminationReport, Usage

TERMINAL_EVENT_TYPES = frozenset({"tether.v1.RunCompleted", "tether.v1.RunTerminated", "tether.v1.RunRejected"})


class RunStatus(str, Enum):
    """Where a run is in its life (the read model's status column, plus PENDING before it has a row)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    WAITING = "WAITING"
    COMPLETED = "COMPLETED"
    TERMINATED = "TERMINATED"
    REJECTED = "REJECTED"
    QUEUED = "QUEUED"  # waiting in its tenant's queue for a concurrency slot

    @property
    def finished(self) -> bool:
        return self in (RunStatus.COMPLETED, RunStatus.TERMINATED, RunStatus.REJECTED)


@dataclass(frozen=True)
class RunView:
    """A run as the read model (or, before projection, the submit ledger) knows it."""

    run_id: str
    status: RunStatus
    agent_id: str = ""
    agent_version: int = 0
    goal: str = ""
    principal_id: str = ""
    answer: str = ""
    usage: Usage = field(default_factory=Usage)
    steps: int = 0
    termination: TerminationReport | None = None
    created_at_ms: int = 0
    updated_at_ms: int = 0
    ended_at_ms: int | None = None
    last_seq: int = 0
    chain_ok: bool | None = None  # the projector's hash-chain check of the run's events; None: not projected yet


@dataclass(frozen=True)
class ToolCallView:
    """One tool call of a step."""

    call_id: str
    tool_name: str
    args_json: str = ""
    args_hash: str = ""
    status: str = ""
    result_json: str = ""
    error_code: str = ""
    detail: str = ""
    approval_id: str = ""


@dataclass(frozen=True)
class StepView:
    """One step: its model call and the tool calls it proposed."""

    step: int
    status: str = ""
    usage: Usage = field(default_factory=Usage)
    assistant_text: str = ""
    finish_reason: str = ""
    tool_calls: tuple[ToolCallView, ...] = ()
    started_at_ms: int | None = None
    ended_at_ms: int | None = None


@dataclass(frozen=True)
class EventView:
    """One event of the run event log."""

    run_id: str
    seq: int
    event_id: str
    event_type: str
    recorded_at_ms: int
    payload_json: str = "{}"
    hash: str = ""
    prev_hash: str = ""

    @property
    def terminal(self) -> bool:
        """True for the event that ends the run (RunCompleted, RunTerminated, RunRejected). It need not
        be the run's last event: the budget records late facts after it (the outcome of a tool call
        that was running when the run ended)."""
        return self.event_type in TERMINAL_EVENT_TYPES


@dataclass(frozen=True)
class RefusedDecisionView:
    """A human decision recorded in time that reached the approval service after the expiry had decided."""

    approver_id: str
    approve: bool
    comment: str
    decided_at_ms: int
    reason: str


@dataclass(frozen=True)
class ApprovalView:
    """A tool call waiting for (or having had) a human decision."""

    approval_id: str
    run_id: str
    call_id: str
    args_hash: str
    status: str  # PENDING, APPROVED, REJECTED, EXPIRED, WITHDRAWN
    step: int = 0
    tool_name: str = ""
    args_json: str = ""
    risk_class: str = ""
    reasons: tuple[str, ...] = ()
    provenance_json: str = ""
    requested_at_ms: int = 0
    expires_at_ms: int | None = None
    decided_by: str = ""
    decided_at_ms: int | None = None
    comment: str = ""
    refused_decision: RefusedDecisionView | None = None

    def effective_status(self, now_ms: int) -> str:
        """PENDING past its expiry is EXPIRED, even before the approval service has recorded it.

        Decided exactly at expires_at_ms is still in time (as the approval service and gateway read it).
        """
        if self.status == "PENDING" and self.expires_at_ms is not None and now_ms > self.expires_at_ms:
            return "EXPIRED"
        return self.status


@dataclass(frozen=True)
class Submission:
    """The submit ledger's row for a run: what run-api sent and where."""

    tenant_id: str
    request_id: str
    request_hash: str
    run_id: str
    principal_id: str
    agent_id: str
    agent_version: int
    goal: str
    partition: int
    envelope: bytes
    created_at_ms: int
    delivered: bool = False

    def as_pending_run(self) -> RunView:
        """What GetRun shows before the read model has the run."""
        return RunView(
            run_id=self.run_id,
            status=RunStatus.PENDING,
            agent_id=self.agent_id,
            agent_version=self.agent_version,
            goal=self.goal,
            principal_id=self.principal_id,
            created_at_ms=self.created_at_ms,
            updated_at_ms=self.created_at_ms,
        )
