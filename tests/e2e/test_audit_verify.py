"""`tether audit verify` over the log of a real run: it verifies, and a tampered copy of it does not."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import ToolCallBudgeted
from tether_messaging.chain import seal
from tether_messaging.serde import encode, open_payload
from tether_run_api.audit import render_text, verify_log
from tether_run_api.cli import main as cli

pytestmark = pytest.mark.e2e


def _approve_and_finish(system, runs, run_id):
    for event in system.client.follow(run_id, timeout_s=180):
        if event.event_type == "tether.v1.ApprovalRequested":
            request = json.loads(event.payload_json)
            system.approver.decide(request["approval_id"], request["args_hash"], approve=True)
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()


def test_audit_verify_passes_on_a_real_log_and_finds_tampering(tether_system, runs, event_log):
    system = tether_system
    run_id, _ = runs.submit()
    _approve_and_finish(system, runs, run_id)

    result = CliRunner().invoke(cli.app, [
        "audit", "verify", "--bootstrap", system.config.kafka_bootstrap,
        "--topic-prefix", system.names.topic_prefix, "--run", run_id, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["runs"] == 1 and report["mismatches"] == []
    # The whole log of the system (every run other tests left) verifies as well.
    whole = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", system.config.kafka_bootstrap,
                                         "--topic-prefix", system.names.topic_prefix])
    assert whole.exit_code == 0, whole.output

    log = event_log.run(run_id)
    assert verify_log(log).ok
    kinds = [type(open_payload(e)).__name__ for e in log]
    # Every gateway decision is on the record: the allowed calls' ToolCallAuthorized too (re-derived above).
    assert {"ApprovalRequested", "ApprovalDecided", "ToolCallBudgeted", "ToolCallAuthorized",
            "StepGranted"} <= set(kinds)

    # A budget decision changed and the chain recomputed after it: the chain holds, the decision does not follow.
    i = next(i for i, e in enumerate(log) if e.event_type == ToolCallBudgeted.AVRO_NAME)
    budgeted = open_payload(log[i])
    forged = budgeted.model_copy(update={"remaining": budgeted.remaining.model_copy(update={"steps": 999})})
    rechained = list(log)
    rechained[i] = rechained[i].model_copy(update={"payload": encode(forged)})
    for j in range(i, len(rechained)):
        rechained[j] = seal(rechained[j], rechained[j].seq, rechained[j - 1].hash)
    report = verify_log(rechained)
    assert [(f.check, f.seq) for f in report.mismatches] == [("budget", log[i].seq)], render_text(report)

    # The same change without recomputing the chain: a chain problem at that event.
    altered = list(log)
    altered[i] = rechained[i].model_copy(update={"hash": log[i].hash, "prev_hash": log[i].prev_hash})
    report = verify_log(altered)
    assert ("chain", log[i].seq) in [(f.check, f.seq) for f in report.mismatches], render_text(report)

    # An approval taken out of the log: the email ran without one (gateway), the decision's request is gone.
    no_approval = [e for e in log if e.event_type not in ("tether.v1.ApprovalRequested",)]
    report = verify_log(no_approval)
    checks = {f.check for f in report.mismatches}
    assert {"chain", "gateway", "approval"} <= checks, render_text(report)
