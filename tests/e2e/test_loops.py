"""Loops through the real services: the same call and result every step → one warning the model sees, then LOOP_DETECTED."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import RunTerminated, StepGranted
from tether_messaging.serde import open_payload
from tether_run_api.cli import main as cli

pytestmark = pytest.mark.e2e

NOTE = "Platform note (loop detection): "


def test_a_repeating_model_is_warned_once_then_stopped_with_the_rule_named(tether_system, runs, event_log):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-loop] Look up the loop key until it shows up.")
    run = runs.wait_for_end(run_id, timeout_s=180)
    assert run.status == runs_pb.RUN_STATUS_TERMINATED, runs.logs()

    log = event_log.run(run_id)
    payloads = [open_payload(e) for e in log]
    warned = [p for p in payloads if isinstance(p, StepGranted) and p.loop_warning]
    assert len(warned) == 1, "the model is warned exactly once"
    assert "REPEAT" in warned[0].loop_warning and "kv_get" in warned[0].loop_warning
    end = payloads[-1]
    assert isinstance(end, RunTerminated) and end.reason_code == "LOOP_DETECTED"
    assert end.report.detail.startswith("Loop detected after a warning: R1_REPEAT at step ")
    assert "First warning: R1_REPEAT" in end.report.detail
    last_step = max(p.step for p in payloads if isinstance(p, StepGranted))
    # The warning came with the grant after the first detection; that step repeated again and ended the run.
    assert warned[0].step == last_step

    # The model received the note with the warned step's request (and not before it).
    requests = [r for r in system.model_requests() if r["headers"].get("x-tether-run") == run_id]
    with_note = sorted(int(r["headers"]["x-tether-step"]) for r in requests if NOTE in json.dumps(r["body"]))
    assert with_note and with_note[0] == warned[0].step
    assert all(NOTE not in json.dumps(r["body"]) for r in requests if int(r["headers"]["x-tether-step"]) < warned[0].step)

    # The auditor re-derives the warning and the stop from the recorded inputs.
    result = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", system.config.kafka_bootstrap,
                                          "--topic-prefix", system.names.topic_prefix, "--run", run_id])
    assert result.exit_code == 0, result.output
