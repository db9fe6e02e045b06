"""In-memory fakes of the run-api's ports, for unit tests here and in other packages (no sockets)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from tether_contracts.records import AgentSpec, Envelope, ToolSpec
from tether_run_api.domain.auth import Principal
from tether_run_api.domain.catalog import AgentVersion, ToolVersion
from tether_run_api.domain.errors import (
    AgentAlreadyExists,
    AgentVersionConflict,
    BackendUnavailable,
    CommandNotDelivered,
    RequestIdReused,
)
from tether_run_api.domain.tenancy import TenantPolicy
from tether_run_api.domain.views import ApprovalView, EventView, RunStatus, RunView, StepView, Submission
from tether_run_api.ports import Idempotency, LiveEntry


class FakeApiKeys:
    """ApiKeys over a dict of key hash → principal."""

    def __init__(self) -> None:
        self.keys: dict[str, Principal] = {}
        self.lookups = 0

    def principal_for(self, key_hash: str) -> Principal | None:
        self.lookups += 1
        return self.keys.get(key_hash)


@dataclass
class FakeCatalog:
    """Catalog in memory, with the same idempotency and versioning rules as the PostgreSQL store."""

    agents: dict[tuple[str, str], list[AgentVersion]] = field(default_factory=dict)
    tools: dict[tuple[str, str], list[ToolVersion]] = field(default_factory=dict)
    grants: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    spreads: dict[str, int] = field(default_factory=dict)
    policies: dict[str, TenantPolicy] = field(default_factory=dict)
    requests: dict[tuple[str, str, str], tuple[str, str, int]] = field(default_factory=dict)

    def _replay(self, tenant: str, op: str, idem: Idempotency | None) -> tuple[str, int] | None:
        if idem is None:
            return None
        found = self.requests.get((tenant, op, idem.request_id))
        if found is None:
            return None
        if found[0] != idem.request_hash:
            raise RequestIdReused(idem.request_id)
        return found[1], found[2]

    def _remember(self, tenant: str, op: str, idem: Idempotency | None, key: str, version: int) -> None:
        if idem is not None:
            self.requests[(tenant, op, idem.request_id)] = (idem.request_hash, key, version)

    def create_agent(self, tenant_id: str, spec: AgentSpec, created_by: str, now_ms: int,
                     idem: Idempotency | None) -> AgentVersion:
        if (done := self._replay(tenant_id, "CreateAgent", idem)) is not None:
            return self.get_agent(tenant_id, *done)  # type: ignore[return-value]
        if (tenant_id, spec.agent_id) in self.agents:
            raise AgentAlreadyExists(spec.agent_id)
        v = AgentVersion(spec.model_copy(update={"version": 1}), now_ms, created_by)
        self.agents[(tenant_id, spec.agent_id)] = [v]
        self._remember(tenant_id, "CreateAgent", idem, spec.agent_id, 1)
        return v

    def add_agent_version(self, tenant_id: str, spec: AgentSpec, created_by: str, now_ms: int,
                          idem: Idempotency | None) -> AgentVersion:
        if (done := self._replay(tenant_id, "UpdateAgent", idem)) is not None:
            return self.get_agent(tenant_id, *done)  # type: ignore[return-value]
        versions = self.agents[(tenant_id, spec.agent_id)]
        if spec.version != versions[-1].spec.version + 1:
            raise AgentVersionConflict(spec.agent_id, spec.version - 1, versions[-1].spec.version)
        v = AgentVersion(spec, now_ms, created_by)
        versions.append(v)
        self._remember(tenant_id, "UpdateAgent", idem, spec.agent_id, spec.version)
        return v

    def replayed_agent(self, tenant_id: str, op: str, idem: Idempotency) -> AgentVersion | None:
        done = self._replay(tenant_id, op, idem)
        return None if done is None else self.get_agent(tenant_id, *done)

    def get_agent(self, tenant_id: str, agent_id: str, version: int | None = None) -> AgentVersion | None:
        versions = self.agents.get((tenant_id, agent_id), [])
        if version is None:
            return versions[-1] if versions else None
        return next((v for v in versions if v.spec.version == version), None)

    def list_agents(self, tenant_id: str, after_agent_id: str | None, limit: int) -> list[AgentVersion]:
        rows = sorted(
            (vs[-1] for (t, a), vs in self.agents.items() if t == tenant_id and a > (after_agent_id or "")),
            key=lambda v: v.spec.agent_id,
        )
        return rows[:limit]

    def register_tool(self, tenant_id: str, spec: ToolSpec, created_by: str, now_ms: int,
                      idem: Idempotency | None) -> ToolVersion:
        if (done := self._replay(tenant_id, "RegisterTool", idem)) is not None:
            return self.get_tool(tenant_id, *done)  # type: ignore[return-value]
        versions = self.tools.setdefault((tenant_id, spec.name), [])
        v = ToolVersion(spec.model_copy(update={"version": len(versions) + 1}), False, now_ms, created_by)
        versions.append(v)
        self._remember(tenant_id, "RegisterTool", idem, spec.name, v.spec.version)
        return v

    def get_tool(self, tenant_id: str, name: str, version: int | None = None) -> ToolVersion | None:
        versions = self.tools.get((tenant_id, name), [])
        if version is None:
            return versions[-1] if versions else None
        return next((v for v in versions if v.spec.version == version), None)

    def list_tools(self, tenant_id: str, after_name: str | None, limit: int, show_disabled: bool) -> list[ToolVersion]:
        rows = sorted(
            (vs[-1] for (t, n), vs in self.tools.items() if t == tenant_id and n > (after_name or "")),
            key=lambda v: v.spec.name,
        )
        return [r for r in rows if show_disabled or not r.disabled][:limit]

    def disable_tool(self, tenant_id: str, name: str, version: int | None) -> list[int] | None:
        versions = self.tools.get((tenant_id, name), [])
        targets = [i for i, v in enumerate(versions) if version is None or v.spec.version == version]
        if not targets:
            return None
        newly = []
        for i in targets:
            if not versions[i].disabled:
                versions[i] = replace(versions[i], disabled=True)
                newly.append(versions[i].spec.version)
        return sorted(newly)

    def latest_enabled_tools(self, tenant_id: str, names: list[str]) -> list[ToolVersion]:
        out = []
        for name in names:
            enabled = [v for v in self.tools.get((tenant_id, name), []) if not v.disabled]
            if enabled:
                out.append(enabled[-1])
        return out

    def grant(self, tenant_id: str, principal_id: str, tool_names: list[str]) -> None:
        for name in tool_names:
            self.grants.setdefault(tenant_id, set()).add((principal_id, name))

    def grants_for(self, tenant_id: str, principal_id: str) -> list[str]:
        return sorted({n for p, n in self.grants.get(tenant_id, set()) if p in (principal_id, "*")})

    def tenant_spread(self, tenant_id: str) -> int:
        return self.spreads.get(tenant_id, 1)

    def tenant_policy(self, tenant_id: str) -> TenantPolicy:
        policy = self.policies.get(tenant_id, TenantPolicy())
        return replace(policy, spread=self.spreads.get(tenant_id, policy.spread))


class FakeLedger:
    """SubmitLedger in memory."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], Submission] = {}

    def get(self, tenant_id: str, request_id: str) -> Submission | None:
        return self.rows.get((tenant_id, request_id))

    def claim(self, submission: Submission) -> Submission:
        return self.rows.setdefault((submission.tenant_id, submission.request_id), submission)

    def mark_delivered(self, tenant_id: str, request_id: str) -> None:
        self.rows[(tenant_id, request_id)] = replace(self.rows[(tenant_id, request_id)], delivered=True)

    def find_run(self, tenant_id: str, run_id: str) -> Submission | None:
        return next((s for (t, _), s in self.rows.items() if t == tenant_id and s.run_id == run_id), None)

    def list_runs(self, tenant_id: str, before_run_id: str | None, limit: int) -> list[Submission]:
        rows = sorted((s for (t, _), s in self.rows.items() if t == tenant_id), key=lambda s: s.run_id, reverse=True)
        if before_run_id is not None:
            rows = [s for s in rows if s.run_id < before_run_id]
        return rows[:limit]

    def undelivered(self, created_before_ms: int, limit: int) -> list[Submission]:
        rows = sorted((s for s in self.rows.values() if not s.delivered and s.created_at_ms < created_before_ms),
                      key=lambda s: s.created_at_ms)
        return rows[:limit]


class FakeTenantBacklog:
    """TenantBacklog with the same meaning as the PostgreSQL one, over a FakeReadModel and a FakeLedger:
    open runs the read model shows, plus recent submissions it does not show yet."""

    OPEN = frozenset({RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING})

    def __init__(self, read_model: FakeReadModel, ledger: FakeLedger) -> None:
        self.read_model = read_model
        self.ledger = ledger
        self.unavailable = False
        self.reads = 0

    def backlog(self, tenant_id: str, submitted_since_ms: int) -> int:
        self.reads += 1
        if self.unavailable:
            raise BackendUnavailable("read model", "fake outage")
        runs = {run_id: r for (t, run_id), r in self.read_model.runs.items() if t == tenant_id}
        projected = sum(1 for r in runs.values() if r.status in self.OPEN)
        unprojected = sum(1 for (t, _), s in self.ledger.rows.items()
                          if t == tenant_id and s.created_at_ms >= submitted_since_ms and s.run_id not in runs)
        return projected + unprojected


class FakePublisher:
    """CommandPublisher that records (envelope, partition); `fail_next` makes the next publishes fail."""

    def __init__(self) -> None:
        self.published: list[tuple[Envelope, int]] = []
        self.fail_next = 0

    def publish(self, envelope: Envelope, partition: int) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise CommandNotDelivered("fake broker down")
        self.published.append((envelope, partition))


@dataclass
class FakeReadModel:
    """ReadModel over dicts keyed by tenant."""

    runs: dict[tuple[str, str], RunView] = field(default_factory=dict)
    steps: dict[tuple[str, str], list[StepView]] = field(default_factory=dict)
    event_log: dict[tuple[str, str], dict[int, EventView]] = field(default_factory=dict)
    approvals: dict[tuple[str, str], ApprovalView] = field(default_factory=dict)
    event_queries: int = 0

    def add_events(self, tenant_id: str, events: list[EventView]) -> None:
        for e in events:
            self.event_log.setdefault((tenant_id, e.run_id), {})[e.seq] = e

    def get_run(self, tenant_id: str, run_id: str) -> RunView | None:
        return self.runs.get((tenant_id, run_id))

    def get_runs(self, tenant_id: str, run_ids: list[str]) -> dict[str, RunView]:
        return {r: self.runs[(tenant_id, r)] for r in run_ids if (tenant_id, r) in self.runs}

    def list_steps(self, tenant_id: str, run_id: str, after_step: int, limit: int) -> list[StepView]:
        return [s for s in self.steps.get((tenant_id, run_id), []) if s.step > after_step][:limit]

    def events(self, tenant_id: str, run_id: str, from_seq: int, limit: int) -> list[EventView]:
        self.event_queries += 1
        log = self.event_log.get((tenant_id, run_id), {})
        return [log[s] for s in sorted(log) if s >= from_seq][:limit]

    def get_approval(self, tenant_id: str, approval_id: str) -> ApprovalView | None:
        return self.approvals.get((tenant_id, approval_id))

    def list_approvals(self, tenant_id: str, status: str, run_id: str | None,
                       after: tuple[int, str] | None, limit: int, now_ms: int) -> list[ApprovalView]:
        rows = sorted(
            (a for (t, _), a in self.approvals.items()
             if t == tenant_id and a.effective_status(now_ms) == status and (run_id is None or a.run_id == run_id)),
            key=lambda a: (a.requested_at_ms, a.approval_id),
        )
        if after is not None:
            rows = [a for a in rows if (a.requested_at_ms, a.approval_id) > after]
        return rows[:limit]


class FakeLiveEvents:
    """LiveEvents over per-run lists; cursors are list indexes. `script` feeds reads in order.

    Each read returns the next scripted batch if there is one (appending it to the feed),
    otherwise the entries after the cursor; an empty read models a quiet feed.
    """

    def __init__(self) -> None:
        self.feeds: dict[str, list[LiveEntry]] = {}
        self.script: dict[str, list[list[LiveEntry]]] = {}
        self.reads = 0
        self._lock = threading.Lock()

    def publish(self, run_id: str, entry: LiveEntry) -> None:
        with self._lock:
            self.feeds.setdefault(run_id, []).append(entry)

    def position(self, run_id: str) -> str:
        with self._lock:
            return str(len(self.feeds.get(run_id, [])))

    def read(self, run_id: str, cursor: str, block_ms: int) -> tuple[list[LiveEntry], str]:
        with self._lock:
            self.reads += 1
            batches = self.script.get(run_id)
            if batches:
                self.feeds.setdefault(run_id, []).extend(batches.pop(0))
            feed = self.feeds.get(run_id, [])
            start = int(cursor)
            return feed[start:], str(len(feed))
