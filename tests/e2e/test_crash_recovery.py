"""Services SIGKILLed mid-run and restarted: the run completes with one intact log and each effect once."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import (
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
)
from tether_messaging.chain import verify_chain
from tether_messaging.serde import open_payload

pytestmark = pytest.mark.e2e

OUTCOMES = (ToolCallCompleted, ToolCallFailed, ToolCallDenied, ToolCallOutcomeUnknown)


def crash_and_restart(system, *names: str) -> None:
    """SIGKILL the services (a crash, no goodbye), then start them again and wait until they are ready."""
    for name in names:
        system.kill(name)
    with ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(system.restart, names))


def test_a_run_survives_its_services_being_killed_mid_run(tether_system, runs, event_log):
    system = tether_system
    run_id, url = runs.submit()
    streamed = []
    crashed = []
    for event in system.client.follow(run_id, timeout_s=300):
        streamed.append(event)
        if event.event_type == "tether.v1.ToolCallCompleted" and not crashed:
            # Step 1's other call may still be running; the planner may be about to be granted step 2.
            crash_and_restart(system, "budget", "planner")
            crashed.append("budget+planner")
        elif event.event_type == "tether.v1.ApprovalRequested":
            # The email waits for a human: the gateway that will send it and the approval service that
            # holds the pending approval both lose their memory.
            crash_and_restart(system, "tool-gateway", "approval")
            crashed.append("tool-gateway+approval")
            request = json.loads(event.payload_json)
            system.approver.decide(request["approval_id"], request["args_hash"], approve=True)
    assert crashed == ["budget+planner", "tool-gateway+approval"]
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()

    log = event_log.run(run_id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    assert verify_chain(log) == []
    assert [(e.seq, e.event_id) for e in streamed] == [(e.seq, e.event_id) for e in log]
    payloads = [open_payload(e) for e in log]
    requested = {p.call.call_id: p.call for p in payloads if isinstance(p, ToolCallRequested)}
    outcomes = Counter((type(p).__name__, p.call_id) for p in payloads if isinstance(p, OUTCOMES))
    assert outcomes == Counter({("ToolCallCompleted", cid): 1 for cid in requested})
    assert len(requested) == 3

    fetched = [r for r in system.sink_records("http") if r["path"] == urlsplit(url).path]
    assert len(fetched) == 1
    writes = [r for r in system.sink_records("kv") if r["idempotency_key"] == requested["1.1"].idem_key]
    assert sum(r["applied"] for r in writes) == 1
    mails = [r for r in system.sink_records("smtp") if r["idempotency_key"] == requested["2.0"].idem_key]
    assert len(mails) == 1
