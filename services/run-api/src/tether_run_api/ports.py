"""The run-api's ports: what the handlers need from PostgreSQL, Kafka and Redis, as small Protocols.

Adapters (tether_run_api.adapters) implement them against the real systems; tests use the
fakes in tests/fakes.py. Every method is scoped by tenant: an adapter never returns another
tenant's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tether_contracts.records import AgentSpec, Envelope, ToolSpec
from tether_run_api.domain.auth import Principal
from tether_run_api.domain.catalog import AgentVersion, ToolVersion
from tether_run_api.domain.tenancy import TenantBacklog, TenantPolicy
from tether_run_api.domain.views import ApprovalView, EventView, RunView, StepView, Submission


@dataclass(frozen=True)
class Idempotency:
    """A client request id and the hash of the request it came with (AIP-155)."""

    request_id: str
    request_hash: str


class ApiKeys(Protocol):
    """Who an API key belongs to."""

    def principal_for(self, key_hash: str) -> Principal | None:
        """The principal of an active key with this sha256 hex hash, or None (unknown or revoked)."""
        ...


class Catalog(Protocol):
    """Versioned agents and tools, tenant grants and partition spread (schema run_api)."""

    def create_agent(self, tenant_id: str, spec: AgentSpec, created_by: str, now_ms: int,
                     idem: Idempotency | None) -> AgentVersion:
        """Store version 1. A repeat of the same idem returns the first result; raises
        AgentAlreadyExists if the id exists, RequestIdReused if idem came with another request."""
        ...

    def add_agent_version(self, tenant_id: str, spec: AgentSpec, created_by: str, now_ms: int,
                          idem: Idempotency | None) -> AgentVersion:
        """Store spec.version, which must be latest + 1 (else AgentVersionConflict); idem as above."""
        ...

    def replayed_agent(self, tenant_id: str, op: str, idem: Idempotency) -> AgentVersion | None:
        """The agent version a request (op "CreateAgent" or "UpdateAgent") with this request_id already
        stored, None if there was none; raises RequestIdReused if it came with another request. Looked up
        before any precondition, so a retry whose first answer was lost gets that answer."""
        ...

    def get_agent(self, tenant_id: str, agent_id: str, version: int | None = None) -> AgentVersion | None:
        """One version (the latest when version is None)."""
        ...

    def list_agents(self, tenant_id: str, after_agent_id: str | None, limit: int) -> list[AgentVersion]:
        """Latest version of each agent with agent_id > after_agent_id, ordered by agent_id."""
        ...

    def register_tool(self, tenant_id: str, spec: ToolSpec, created_by: str, now_ms: int,
                      idem: Idempotency | None) -> ToolVersion:
        """Store the next version of spec.name (spec.version is ignored); idem as above."""
        ...

    def get_tool(self, tenant_id: str, name: str, version: int | None = None) -> ToolVersion | None:
        """One version (the latest when version is None), disabled or not."""
        ...

    def list_tools(self, tenant_id: str, after_name: str | None, limit: int, show_disabled: bool) -> list[ToolVersion]:
        """Latest version of each tool with name > after_name, ordered by name."""
        ...

    def disable_tool(self, tenant_id: str, name: str, version: int | None) -> list[int] | None:
        """Disable one version or all (None); returns the versions newly disabled, None if no such tool/version."""
        ...

    def latest_enabled_tools(self, tenant_id: str, names: list[str]) -> list[ToolVersion]:
        """For each name, its highest enabled version (names without one are left out)."""
        ...

    def grants_for(self, tenant_id: str, principal_id: str) -> list[str]:
        """Tool names granted to the principal, directly or to every principal of the tenant."""
        ...

    def tenant_spread(self, tenant_id: str) -> int:
        """How many partitions the tenant's runs spread over (1 = its home partition only)."""
        ...

    def tenant_policy(self, tenant_id: str) -> TenantPolicy:
        """The tenant's spread and limits (totals; no limits for an unknown tenant)."""
        ...


class SubmitLedger(Protocol):
    """The unique (tenant, request_id) row that makes SubmitRun idempotent, and the run's partition."""

    def get(self, tenant_id: str, request_id: str) -> Submission | None:
        """The submission stored for (tenant, request_id), or None."""
        ...

    def claim(self, submission: Submission) -> Submission:
        """Insert the submission, or return the row already stored for (tenant, request_id)."""
        ...

    def mark_delivered(self, tenant_id: str, request_id: str) -> None:
        """Record that Kafka acknowledged the submission's command."""
        ...

    def find_run(self, tenant_id: str, run_id: str) -> Submission | None:
        """The submission of a run of this tenant, or None."""
        ...

    def list_runs(self, tenant_id: str, before_run_id: str | None, limit: int) -> list[Submission]:
        """The tenant's submissions with run_id < before_run_id, newest first (run ids sort by time)."""
        ...

    def undelivered(self, created_before_ms: int, limit: int) -> list[Submission]:
        """Submissions (any tenant) created before the given time whose command Kafka never acknowledged."""
        ...


class CommandPublisher(Protocol):
    """Produces commands to tether.commands.v1."""

    def publish(self, envelope: Envelope, partition: int) -> None:
        """Produce with key = run id to `partition` and wait for the broker's acknowledgement
        (acks=all, idempotent producer); raises CommandNotDelivered."""
        ...


class ReadModel(Protocol):
    """The projector's read model (schema read_model), read only."""

    def get_run(self, tenant_id: str, run_id: str) -> RunView | None:
        """The run, if the projector has it and it belongs to the tenant."""
        ...

    def get_runs(self, tenant_id: str, run_ids: list[str]) -> dict[str, RunView]:
        """The tenant's runs among run_ids that the projector has."""
        ...

    def list_steps(self, tenant_id: str, run_id: str, after_step: int, limit: int) -> list[StepView]:
        """Steps with step > after_step, ascending, each with its tool calls."""
        ...

    def events(self, tenant_id: str, run_id: str, from_seq: int, limit: int) -> list[EventView]:
        """Events with seq >= from_seq, ascending, at most limit."""
        ...

    def get_approval(self, tenant_id: str, approval_id: str) -> ApprovalView | None:
        """The approval, if it belongs to the tenant."""
        ...

    def list_approvals(self, tenant_id: str, status: str, run_id: str | None,
                       after: tuple[int, str] | None, limit: int, now_ms: int) -> list[ApprovalView]:
        """Approvals whose effective status at now_ms (ApprovalView.effective_status: a stored PENDING
        past its expires_at_ms is EXPIRED) is `status`, ordered by (requested_at_ms, approval_id) after
        `after`: filtered by the status the response shows, not the stored one."""
        ...


@dataclass(frozen=True)
class LiveEntry:
    """One entry of a run's live feed: its seq, and the event when the feed carries it whole."""

    seq: int
    event: EventView | None


class LiveEvents(Protocol):
    """A run's live event feed (the projector's Redis Stream)."""

    def position(self, run_id: str) -> str:
        """A cursor at the feed's current end: reading from it returns only entries added later."""
        ...

    def read(self, run_id: str, cursor: str, block_ms: int) -> tuple[list[LiveEntry], str]:
        """Entries after cursor (waiting up to block_ms for the first), and the cursor after them."""
        ...


__all__ = [
    "ApiKeys", "Catalog", "CommandPublisher", "Idempotency", "LiveEntry", "LiveEvents", "ReadModel", "SubmitLedger",
    "TenantBacklog",
]
