"""Per-run state of the approval service: a fold over the run event log and the approvers' decisions."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field

from tether_contracts.records import ApprovalOutcome, DecideApproval, RiskClass


class Notification(str, Enum):
    """Where the approver webhook of an approval stands (best-effort; never blocks the run)."""

    NOT_NEEDED = "NOT_NEEDED"  # no webhook configured
    SENDING = "SENDING"  # work started; re-started if its input is re-delivered after a crash
    DELIVERED = "DELIVERED"
    FAILED = "FAILED"  # gave up after the retries


class Approval(BaseModel):
    """One approval the run event log has requested, and what became of it."""

    approval_id: str
    step: int
    call_id: str
    idem_key: str
    tool_name: str
    args_hash: str
    expires_at_ms: int
    reasons: list[str] = Field(default_factory=list)
    requested_event_id: str = ""
    #: Set once decided: by an approver, by expiry, or as seen on the log (whichever came first here).
    outcome: ApprovalOutcome | None = None
    decided_by: str | None = None
    #: Set when the call reached a terminal outcome first, so no decision matters any more.
    withdrawn_by: str | None = None
    notification: Notification = Notification.NOT_NEEDED

    @property
    def pending(self) -> bool:
        return self.outcome is None and self.withdrawn_by is None

    @property
    def status(self) -> str:
        if self.outcome is not None:
            return self.outcome.value
        return "WITHDRAWN" if self.withdrawn_by is not None else "PENDING"


class OpenCall(BaseModel):
    """A requested tool call without a terminal outcome yet: what an unknown-outcome approval binds to."""

    step: int
    call_id: str
    idem_key: str
    tool_name: str
    args_json: str
    args_hash: str
    provenance_json: str = "{}"
    #: Approval this service asked for after a ToolCallOutcomeUnknown (so it asks once).
    outcome_unknown_approval_id: str | None = None


class EarlyDecision(BaseModel):
    """A decision that arrived before its ApprovalRequested was read here (commands and run events
    are separate topics, so a lagging consumer can see them out of order); applied on arrival."""

    command: DecideApproval
    tenant_id: str
    decided_at_ms: int
    event_id: str


class RunApprovals(BaseModel):
    """Everything the approval service keeps for one run (checkpointed to its changelog)."""

    run_id: str
    tenant_id: str | None = None
    #: Principal who submitted the run (RunAccepted), for the self-approval rule.
    submitter_id: str | None = None
    tool_risk: dict[str, RiskClass] = Field(default_factory=dict)
    #: The run's tools whose calls can end OUTCOME_UNKNOWN: the non-idempotent ones (the gateway
    #: re-runs an interrupted call of an idempotent tool instead). From RunAccepted; None while
    #: unknown (state begun by an early decision, or checkpointed by an older version): then every
    #: requested call is remembered.
    unknown_outcome_tools: list[str] | None = None
    #: Requested calls whose outcome may still turn out unknown, with the arguments a human then sees.
    open_calls: dict[str, OpenCall] = Field(default_factory=dict)
    approvals: dict[str, Approval] = Field(default_factory=dict)
    early: dict[str, EarlyDecision] = Field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        """RunAccepted was folded here (it names the submitter); a state begun by a decision read
        before the run's start or after its end was not."""
        return self.submitter_id is not None

    def pending(self) -> list[Approval]:
        return [a for a in self.approvals.values() if a.pending]
