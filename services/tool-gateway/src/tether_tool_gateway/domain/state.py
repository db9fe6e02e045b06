"""The gateway's per-run state: a fold over the run event log, checkpointed with the gateway's outputs."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from tether_contracts.records import ToolSpec
from tether_tool_gateway.domain.provenance import RUN_SOURCES_MAX_CHARS, Source, cap_source, request_text

#: Executor kinds whose tools' descriptions and argument schemas come from an MCP server.
MCP_EXECUTOR_KINDS = frozenset({"mcp", "mcp_stdio"})


class CallStatus(StrEnum):
    """Where a tool call is, as far as the gateway is concerned."""

    REQUESTED = "REQUESTED"  # seen in the log; no budget yet
    AWAITING_APPROVAL = "AWAITING_APPROVAL"  # ApprovalRequested emitted; parked until ApprovalDecided
    RATE_LIMITED = "RATE_LIMITED"  # allowed, but the rate limiter said wait; on_tick retries at not_before_ms
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
    #: When a RATE_LIMITED call is tried again (ToolCallDeferred.not_before_ms).
    not_before_ms: int = 0
    #: How many times the rate limiter made the call wait (the next check is attempt + 1).
    rate_attempts: int = 0


class RunState(BaseModel):
    """What the gateway keeps per run: the snapshots from RunAccepted, the calls, and what the
    run has read so far (taint and the texts provenance is searched in)."""

    tenant_id: str
    principal_id: str = ""
    agent_id: str = ""
    agent_allowlist: list[str] = Field(default_factory=list)
    tenant_grants: list[str] = Field(default_factory=list)
    delegated_scope: list[str] | None = None
    tools: dict[str, ToolSpec] = Field(default_factory=dict)
    calls: dict[str, CallState] = Field(default_factory=dict)
    #: Call ids whose untrusted output the log holds, in log order: the run is tainted once non-empty.
    tainted_by: list[str] = Field(default_factory=list)
    #: The goal, then tool results in log order, as provenance searches them (capped; see
    #: domain.provenance).
    sources: list[Source] = Field(default_factory=list)
    #: The built-in default's policy version when the gateway first saw the run (RunAccepted): a
    #: gateway on the default keeps deciding the run under it (`policy.policy_for_run`). None in a
    #: state checkpointed by a release before the field (that release's default, default/2).
    default_policy_version: str | None = None

    def clone(self) -> RunState:
        """A working copy for handling one record (the loop keeps the committed state to undo an
        aborted batch): the containers and the calls (plain fields: a shallow copy is a full one)
        are copied, the frozen tool snapshots and sources shared. A deep copy of everything
        (including every ToolSpec and the sources' text) was most of the cost of a record."""
        return self.model_copy(
            update={
                "agent_allowlist": list(self.agent_allowlist),
                "tenant_grants": list(self.tenant_grants),
                "delegated_scope": None if self.delegated_scope is None else list(self.delegated_scope),
                "tools": dict(self.tools),
                "calls": {call_id: call.model_copy() for call_id, call in self.calls.items()},
                "tainted_by": list(self.tainted_by),
                "sources": list(self.sources),
            }
        )

    def tool_taint(self) -> list[str]:
        """`tools:<name>` for each tool of the snapshot whose description and argument schema an
        untrusted MCP server wrote: the model reads them from its first step (taint.mcp_tool_descriptions)."""
        return sorted(f"tools:{t.name}" for t in self.tools.values()
                      if t.untrusted_source and t.executor_kind in MCP_EXECUTOR_KINDS)

    def request_texts(self, until_call_id: str) -> list[str]:
        """`provenance.request_text` of each request of the run in log order, up to and including
        `until_call_id` (what `provenance.linked_args` looks for the first request of a value in)."""
        out = []
        for call_id, call in self.calls.items():
            out.append(request_text(call.args_json))
            if call_id == until_call_id:
                break
        return out

    def sources_chars(self) -> int:
        return sum(len(s.text or "") for s in self.sources)

    def read_goal(self, goal: str) -> None:
        """The goal is the first text provenance searches (the principal's own words)."""
        self.sources = [cap_source(Source(origin="goal", text=goal, requests_before=0), RUN_SOURCES_MAX_CHARS),
                        *(s for s in self.sources if s.origin != "goal")]

    def read_result(self, call_id: str, tool_name: str, text: str | None, *, untrusted: bool,
                    failure: bool = False) -> None:
        """The log holds an outcome the model will read: untrusted content taints the run.

        `text` is None when the result is not available to search (a claim check); `failure`: it
        is a ToolCallFailed's detail. The source records how many requests the log held before
        it (`Source.requests_before`). Idempotent.
        """
        if untrusted and call_id not in self.tainted_by:
            self.tainted_by.append(call_id)
        origin = f"tool:{call_id}"
        if any(s.origin == origin for s in self.sources):
            return
        source = Source(origin=origin, tool_name=tool_name, untrusted=untrusted, text=text,
                        requests_before=len(self.calls), failure=failure)
        self.sources.append(cap_source(source, RUN_SOURCES_MAX_CHARS - self.sources_chars()))
