"""The gateway's per-run state: a fold over the run event log, checkpointed with the gateway's outputs."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from tether_contracts.records import ToolSpec


class CallStatus(StrEnum):
    """Where a tool call is, as far as the gateway is concerned."""

    REQUESTED = "REQUESTED"  # seen in the log; no budget yet
    AWAITING_APPROVAL = "AWAITING_APPROVAL"  # ApprovalRequested emitted; parked until ApprovalDecided
    EXECUTING = "EXECUTING"  # work started (or waiting for another instance's lease)
    RESOLVED = "RESOLVED"  # an outcome was emitted or seen in the log; nothing more to do


class CallState(BaseModel):
    """One tool call of the run, from its ToolCallRequested."""

    call_id: str
    step: int
    call_index: int
    idem_key: str
    tool_name: str
    args_json: str
    args_hash: str
    provenance_json: str = "{}"
    status: CallStatus = CallStatus.REQUESTED
    approval_id: str | None = None
    approval_expires_at_ms: int | None = None
    #: When on_tick should start the call's work again if it is still EXECUTING (a wait for
    #: another instance's lease, a failed attempt to reach the ledger, or lost work).
    recheck_at_ms: int = 0


class RunState(BaseModel):
    """What the gateway keeps per run: the snapshots from RunAccepted and the calls."""

    tenant_id: str
    agent_allowlist: list[str] = Field(default_factory=list)
    tenant_grants: list[str] = Field(default_factory=list)
    tools: dict[str, ToolSpec] = Field(default_factory=dict)
    calls: dict[str, CallState] = Field(default_factory=dict)
