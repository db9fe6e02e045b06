"""Approval expiry through the real services: a policy with a short approval TTL → APPROVAL_EXPIRED, the run goes on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import ApprovalDecided, ApprovalOutcome, ApprovalRequested, ToolCallDenied
from tether_messaging.serde import open_payload
from tether_run_api.audit import read_run_log
from tether_run_api.cli import main as cli
from tether_testing.system import SystemConfig, TetherSystem

pytestmark = pytest.mark.e2e

SCENARIOS = Path(__file__).parent / "scenarios"
TTL_MS = 4_000
POLICY = {"version": "e2e-short-ttl/1", "approval_ttl_ms": TTL_MS}
TERMINAL = {runs_pb.RUN_STATUS_COMPLETED, runs_pb.RUN_STATUS_TERMINATED, runs_pb.RUN_STATUS_REJECTED}


@pytest.fixture(scope="module")
def short_ttl_system(kafka_bootstrap, pg_dsn, redis_url, tmp_path_factory) -> Iterator[TetherSystem]:
    system = TetherSystem(SystemConfig(
        kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, redis_url=redis_url, partitions=2,
        workdir=tmp_path_factory.mktemp("tether-expiry"), scenarios=[SCENARIOS],
        extra_env={"tool-gateway": {"TETHER_GATEWAY_POLICY_JSON": json.dumps(POLICY)},
                   # The expiry waits a grace for decisions made in time but not yet read (30 s by
                   # default); 1 s keeps this test short and still exercises it.
                   "approval": {"TETHER_APPROVAL_EXPIRY_GRACE_MS": "1000"}},
    ))
    try:
        system.start()
        yield system
    finally:
        system.stop()
        system.drop_data()


def _wait_for_end(system: TetherSystem, run_id: str, timeout_s: float = 120.0) -> runs_pb.Run:
    deadline = time.monotonic() + timeout_s
    while (run := system.client.get_run(run_id)).status not in TERMINAL:
        if time.monotonic() > deadline:
            pytest.fail(f"run {run_id} did not end\n" + "\n".join(system.log_tail(n, 20) for n in
                                                                 ("approval", "tool-gateway", "budget")))
        time.sleep(0.3)
    return run


def test_an_approval_nobody_decides_expires_and_the_model_is_told(short_ttl_system):
    system = short_ttl_system
    run_id = system.client.submit("[scenario:e2e-approvals] Tell the on-call (nobody will answer).")
    run = _wait_for_end(system, run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED
    log = [e for e in read_run_log(system.config.kafka_bootstrap, system.names.topics.run_events) if e.run_id == run_id]
    payloads = [open_payload(e) for e in log]
    requested = next(p for p in payloads if isinstance(p, ApprovalRequested))
    budgeted_at = next(e.recorded_at_ms for e in log if e.event_type == "tether.v1.ToolCallBudgeted")
    assert requested.expires_at_ms == budgeted_at + TTL_MS
    assert requested.policy_version.startswith("e2e-short-ttl/1@")
    decided = [p for p in payloads if isinstance(p, ApprovalDecided)]
    assert [(d.outcome, d.approver_id) for d in decided] == [(ApprovalOutcome.EXPIRED, "system")]
    assert decided[0].decided_at_ms > requested.expires_at_ms
    assert [p.reason_code for p in payloads if isinstance(p, ToolCallDenied)] == ["APPROVAL_EXPIRED"]
    assert "APPROVAL_EXPIRED" in run.answer, run.answer  # the model got the expiry as the tool's result
    assert [m for m in system.sink_records("smtp") if m.get("subject") == f"apr {run_id}"] == []

    # The audit re-derives the expiry (and the approval request) under the same policy document.
    policy = system.workdir / "policy.json"
    policy.write_text(json.dumps(POLICY))
    result = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", system.config.kafka_bootstrap,
                                          "--topic-prefix", system.names.topic_prefix, "--run", run_id,
                                          "--policy-file", str(policy)])
    assert result.exit_code == 0, result.output
