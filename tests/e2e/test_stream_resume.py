"""StreamRunEvents resumed mid-run from a sequence number (also across a run-api crash) loses and repeats nothing."""

from __future__ import annotations

import json

import grpc
import pytest

from tether_api.v1 import run_service_pb2 as runs_pb

pytestmark = pytest.mark.e2e


def key(event) -> tuple[int, str, str, str]:
    return (event.seq, event.event_id, event.event_type, event.hash)


def test_a_stream_resumed_from_a_seq_loses_no_event_and_duplicates_none(tether_system, runs, event_log):
    system = tether_system
    run_id, _ = runs.submit()
    seen: list[runs_pb.RunEvent] = []

    # 1. From the start; the client goes away after three events.
    first = system.client.events(run_id, 1, timeout_s=120)
    for event in first:
        seen.append(event)
        if len(seen) == 3:
            break
    first.close()

    # 2. Resumed from the next seq, up to the approval the run now waits for; then run-api crashes
    #    under the open stream.
    second = system.client.events(run_id, seen[-1].seq + 1, timeout_s=120)
    approval = None
    for event in second:
        seen.append(event)
        if event.event_type == "tether.v1.ApprovalRequested":
            approval = json.loads(event.payload_json)
            break
    assert approval is not None, "the stream ended before the approval"
    system.kill("run-api")
    with pytest.raises(grpc.RpcError):
        next(second)
    second.close()
    system.restart("run-api")

    # 3. The run goes on once approved; resumed from the next seq to the terminal event.
    system.approver.decide(approval["approval_id"], approval["args_hash"], approve=True)
    seen.extend(system.client.follow(run_id, seen[-1].seq + 1, timeout_s=180))
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()

    log = event_log.run(run_id)
    assert [e.seq for e in seen] == list(range(1, len(log) + 1))
    assert [key(e) for e in seen] == [(e.seq, e.event_id, e.event_type, e.hash) for e in log]
    assert seen[-1].terminal and not any(e.terminal for e in seen[:-1])

    # A reader catching up after the end from any seq gets exactly the rest of the log.
    rest = list(system.client.events(run_id, 5, timeout_s=60))
    assert [key(e) for e in rest] == [key(e) for e in seen[4:]]
