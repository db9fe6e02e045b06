"""Runs that wait in their tenant's queue (RunQueued) show as QUEUED until accepted, rejected or cancelled."""

from __future__ import annotations

from tether_contracts.records import AgentSpec, RunQueued, StepDeferred, Usage
from tether_messaging.serde import open_payload
from tether_projector.domain.project import project
from tether_projector.domain.state import RunFold, RunStatus
from tether_projector.testing import CAPS, MODEL, RunLog


def queued(log: RunLog) -> None:
    agent = AgentSpec(agent_id="agent-1", version=3, name="Researcher", instructions="be brief", model=MODEL,
                      tool_allowlist=["search"], caps=CAPS)
    log.append(RunQueued(principal_id="alice", request_id=f"req-{log.run_id}", goal="find things", agent=agent,
                         position=4, running=2, max_concurrent_runs=2), "RunQueued")


def project_all(log: RunLog) -> tuple[RunFold, list[str], dict]:
    fold, statuses, row = None, [], {}
    for env in log.events:
        projected = project(fold, env, open_payload(env))
        assert projected.chain_problems == []
        fold = projected.fold
        statuses.append(fold.status)
        row = next(w for w in projected.writes if w.table == "runs").row()
    assert fold is not None
    return fold, statuses, row


def test_a_queued_run_shows_queued_with_its_goal_then_runs_when_accepted() -> None:
    log = RunLog("run-q")
    queued(log)
    fold, statuses, row = project_all(log)
    assert statuses == [RunStatus.QUEUED]
    assert (row["goal"], row["principal_id"], row["agent_id"], row["request_id"]) == (
        "find things", "alice", "agent-1", "req-run-q")
    log.accepted()
    log.step(1)
    log.append(StepDeferred(step=2, reason_code="TENANT_TOKEN_RATE", tokens_available=-5, not_before_ms=1),
               "StepDeferred", 2)
    log.model(1, 0)
    log.completed(1, "done", Usage())
    fold, statuses, _ = project_all(log)
    assert statuses == [RunStatus.QUEUED, RunStatus.ACCEPTED, RunStatus.RUNNING, RunStatus.RUNNING,
                        RunStatus.RUNNING, RunStatus.COMPLETED]
    assert not fold.queued


def test_a_queued_run_that_is_rejected_or_cancelled_ends_so() -> None:
    rejected = RunLog("run-r")
    queued(rejected)
    rejected.rejected("TENANT_SPEND_CAP")
    assert project_all(rejected)[1][-1] == RunStatus.REJECTED
    cancelled = RunLog("run-c")
    queued(cancelled)
    cancelled.terminated("CANCELLED")
    fold, statuses, row = project_all(cancelled)
    assert statuses[-1] == RunStatus.TERMINATED and row["reason_code"] == "CANCELLED"
