"""Bad input gets clear, machine-readable errors and breaks nothing: malformed and oversized gRPC
requests, wrong API keys, another tenant's run, and a model answering broken JSON, unknown tools and
wrong argument types. Runs submitted alongside all complete; all six processes are still up."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether_api.v1 import approval_service_pb2 as approvals_pb, run_service_pb2 as runs_pb, types_pb2 as types_pb
from tether_contracts.records import ModelCallCompleted, ModelCallFailed, RunTerminated, ToolCallRequested
from tether_messaging.chain import verify_chain
from tether_messaging.serde import open_payload
from tether_run_api import admin
from tether_run_api.adapters.postgres import PostgresStore, open_pool
from tether_run_api.api.status import error_info
from tether_security import open_envelope
from tether_testing.system import SERVICES, ApiClient, TetherSystem

pytestmark = pytest.mark.e2e

DOMAIN = "tether.dev"
BYSTANDERS = 3


@dataclass
class Baseline:
    """Runs submitted before the bad input, and how often each process had been started by then."""

    runs: list[str]
    starts: dict[str, int]


@pytest.fixture(scope="module")
def baseline(tether_system: TetherSystem) -> Baseline:
    starts = {name: tether_system.processes[name].starts for name in SERVICES}
    runs = [tether_system.client.submit(f"[scenario:e2e-bystander] Keep going #{i}.") for i in range(BYSTANDERS)]
    return Baseline(runs, starts)


@pytest.fixture(scope="module")
def other_tenant(tether_system: TetherSystem, pg_dsn: str) -> ApiClient:
    """A member (and approver) of a second tenant of the same system."""
    tenant_id = f"other-{uuid.uuid4().hex[:8]}"
    pool = open_pool(pg_dsn, max_size=1)
    try:
        store = PostgresStore(pool, tether_system.names.run_api_schema)
        admin.create_tenant(store, tenant_id, display_name="Another tenant")
        key = admin.issue_key(store, tenant_id, "mallory", ["member", "approver"], label="e2e").api_key
    finally:
        pool.close()
    client = ApiClient(tether_system.address, key)
    yield client
    client.close()


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)  # a server stream fails on its first read
    return caught.value


def reason(err: grpc.RpcError) -> str | None:
    info, _ = error_info(err)
    assert info is None or info.domain == DOMAIN, info
    return None if info is None else info.reason


def violations(err: grpc.RpcError) -> set[str]:
    _, details = error_info(err)
    return {v.field for d in details if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations}


def submit_request(goal: str = "[scenario:e2e-bystander] hello", **kw) -> runs_pb.SubmitRunRequest:
    request_id, agent_id = kw.pop("request_id", str(uuid.uuid4())), kw.pop("agent_id", "demo")
    return runs_pb.SubmitRunRequest(request_id=request_id, agent_id=agent_id, goal=goal, **kw)


def test_malformed_requests_are_invalid_argument_naming_every_bad_field(baseline, tether_system):
    client = tether_system.client
    md = client.metadata
    err = refused(lambda: client.runs.SubmitRun(
        submit_request(goal="  ", request_id="not a valid id", agent_id="Bad Agent!",
                       caps=types_pb.Caps(max_steps=-1, max_tokens=-5)), metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and reason(err) == "INVALID_ARGUMENT"
    assert violations(err) == {"request_id", "agent_id", "goal", "caps.max_steps", "caps.max_tokens"}

    err = refused(lambda: client.runs.SubmitRun(submit_request(caps=types_pb.Caps(max_steps=1_000)),
                                                metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and violations(err) == {"caps.max_steps"}

    err = refused(lambda: client.runs.GetRun(runs_pb.GetRunRequest(run_id="../../etc/passwd"), metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and violations(err) == {"run_id"}

    err = refused(lambda: client.runs.SubmitRun(submit_request(agent_id="ghost"), metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.NOT_FOUND and reason(err) == "AGENT_NOT_FOUND"

    # Bytes that are no SubmitRunRequest at all.
    raw = client.channel.unary_unary("/tether.v1.RunService/SubmitRun")
    err = refused(lambda: raw(b"\xff\xff\xff\xff\x0f not a protobuf", metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and reason(err) == "MALFORMED_REQUEST", \
        (err.code(), err.details())


def test_oversized_requests_are_refused_before_anything_is_done(baseline, tether_system):
    client = tether_system.client
    md = client.metadata
    err = refused(lambda: client.runs.SubmitRun(submit_request(goal="g" * 40_000), metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and violations(err) == {"goal"}

    err = refused(lambda: client.runs.SubmitRun(submit_request(goal="g" * 2_000_000), metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and reason(err) == "REQUEST_TOO_LARGE"
    info, _ = error_info(err)
    assert int(info.metadata["size_bytes"]) > int(info.metadata["limit_bytes"])

    # Above the transport's ceiling gRPC itself refuses, before any handler (no Tether details).
    err = refused(lambda: client.runs.SubmitRun(submit_request(goal="g" * 5_000_000), metadata=md, timeout=30))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err


def test_a_wrong_api_key_is_unauthenticated_and_a_missing_role_is_permission_denied(baseline, tether_system):
    system = tether_system
    runs_stub = system.client.runs
    run_id = baseline.runs[0]
    for metadata in ((("authorization", "Bearer tk_not-a-key-of-anyone"),), (("x-api-key", "garbage"),),
                     (("authorization", "Basic dXNlcjpwYXNz"),), ()):
        for call in (lambda md=metadata: runs_stub.SubmitRun(submit_request(), metadata=md, timeout=30),
                     lambda md=metadata: runs_stub.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md, timeout=30),
                     lambda md=metadata: runs_stub.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id),
                                                                   metadata=md, timeout=30)):
            err = refused(call)
            assert err.code() is grpc.StatusCode.UNAUTHENTICATED, (metadata, err)
            assert reason(err) == "UNAUTHENTICATED_API_KEY"
    # The user's key is no approver's: deciding an approval needs that role.
    err = refused(lambda: system.client.approvals.DecideApproval(
        approvals_pb.DecideApprovalRequest(approval_id="apr_0123456789abcdef0123456789abcdef", args_hash="0" * 64,
                                           approve=True), metadata=system.client.metadata, timeout=30))
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED and reason(err) == "MISSING_ROLE"


def test_another_tenants_run_is_not_found_and_cannot_be_touched(baseline, tether_system, other_tenant):
    run_id = baseline.runs[1]
    stub, md = other_tenant.runs, other_tenant.metadata
    calls = {
        "GetRun": lambda: stub.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md, timeout=30),
        "CancelRun": lambda: stub.CancelRun(runs_pb.CancelRunRequest(run_id=run_id, reason="mine now"), metadata=md,
                                            timeout=30),
        "ListRunSteps": lambda: stub.ListRunSteps(runs_pb.ListRunStepsRequest(run_id=run_id), metadata=md, timeout=30),
        "GetRunTrace": lambda: stub.GetRunTrace(runs_pb.GetRunTraceRequest(run_id=run_id), metadata=md, timeout=30),
        "StreamRunEvents": lambda: stub.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id), metadata=md,
                                                        timeout=30),
    }
    for name, call in calls.items():
        err = refused(call)
        assert (err.code(), reason(err)) == (grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND"), (name, err)
    assert run_id not in {r.run_id for r in stub.ListRuns(runs_pb.ListRunsRequest(), metadata=md, timeout=30).runs}
    # Its own agent catalogue is empty: it cannot even name the first tenant's agent.
    err = refused(lambda: stub.SubmitRun(submit_request(), metadata=md, timeout=30))
    assert (err.code(), reason(err)) == (grpc.StatusCode.NOT_FOUND, "AGENT_NOT_FOUND")


def tool_errors(request: dict) -> list[tuple[str, dict]]:
    """(status, the planner's structured error) of every tool message the model was sent."""
    out = []
    for message in request["body"]["messages"]:
        if message["role"] == "tool":
            envelope = open_envelope(message["content"])  # the platform's untrusted-data envelope
            assert envelope is not None, message["content"]
            out.append((envelope.status, json.loads(envelope.content).get("error", {})))
    return out


def step_one_requests(system: TetherSystem, run_id: str) -> list[dict]:
    requests = [r for r in system.model_requests() if r["headers"].get("x-tether-run") == run_id
                and r["headers"].get("x-tether-step") == "1"]
    return sorted(requests, key=lambda r: int(r["headers"]["x-tether-call"]))


def test_a_model_answering_garbage_three_times_fails_the_step_and_the_run(baseline, tether_system, runs, event_log):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-model-broken-thrice] Write a note.")
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_TERMINATED, runs.logs()
    assert run.termination.reason_code == "MODEL_FAILED" and "MALFORMED_OUTPUT" in run.termination.last_error

    requests = step_one_requests(system, run_id)
    assert [(r["headers"]["x-tether-call"], r["status"]) for r in requests] == [("0", 200), ("1", 200), ("2", 200)]
    # Each bad answer went back to the model as a structured error for the call, and nothing ran.
    assert tool_errors(requests[0]) == []
    (status, error), = tool_errors(requests[1])
    assert status == "rejected" and error["code"] == "INVALID_JSON" and error["tool"] == "kv_put"
    (status, error), = tool_errors(requests[2])[-1:]
    assert error["code"] == "UNKNOWN_TOOL" and error["tool"] == "launch_rockets"
    assert set(error["available_tools"]) >= {"kv_put", "http_get", "send_email"}

    log = event_log.run(run_id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1)) and verify_chain(log) == []
    payloads = [open_payload(e) for e in log]
    failed = [p for p in payloads if isinstance(p, ModelCallFailed)]
    assert [(p.step, p.error_code) for p in failed] == [(1, "MALFORMED_OUTPUT")]
    assert "3 consecutive" in failed[0].detail and "INVALID_ARGS" in failed[0].detail, failed[0].detail
    assert isinstance(payloads[-1], RunTerminated) and payloads[-1].reason_code == "MODEL_FAILED"
    assert not [p for p in payloads if isinstance(p, ToolCallRequested)]
    assert not [r for r in system.sink_records("kv") if f"bad/{run_id}" in r["key"]]


def test_a_model_that_fixes_its_calls_after_structured_errors_completes(baseline, tether_system, runs, event_log):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-model-recovers] Write a note.")
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()

    requests = step_one_requests(system, run_id)
    assert [r["headers"]["x-tether-call"] for r in requests] == ["0", "1", "2"]
    assert [e["code"] for _, e in tool_errors(requests[2])] == ["INVALID_JSON", "INVALID_ARGS"]
    assert "/key" in tool_errors(requests[2])[1][1]["detail"]

    payloads = [open_payload(e) for e in event_log.run(run_id)]
    requested = [p.call for p in payloads if isinstance(p, ToolCallRequested)]
    assert [(c.call_id, c.tool_name, json.loads(c.args_json)) for c in requested] == [
        ("1.0", "kv_put", {"key": f"ok/{run_id}", "value": {"fixed": True}})]
    step_one = [p for p in payloads if isinstance(p, ModelCallCompleted) and p.step == 1]
    assert len(step_one) == 1 and step_one[0].tool_call_count == 1
    writes = [r for r in system.sink_records("kv") if r["key"] == system.kv_store_key(f"ok/{run_id}")]
    assert [r["applied"] for r in writes] == [True]


def test_nothing_crashed_and_nothing_was_lost(baseline, tether_system, runs, event_log):
    system = tether_system
    for run_id in baseline.runs:
        run = runs.wait_for_end(run_id)
        assert run.status == runs_pb.RUN_STATUS_COMPLETED, f"{run_id}: {run}\n{runs.logs()}"
        log = event_log.run(run_id)
        assert [e.seq for e in log] == list(range(1, len(log) + 1)) and verify_chain(log) == []
        for n in (1, 2):
            writes = [r for r in system.sink_records("kv") if r["key"] == system.kv_store_key(f"bystander/{run_id}/{n}")]
            assert [r["applied"] for r in writes] == [True], writes
    for name in SERVICES:
        proc = system.processes[name]
        assert proc.running and proc.starts == baseline.starts[name], f"{name} crashed or was restarted"
        assert proc.healthy(), f"{name} is not ready"
    health = health_pb2_grpc.HealthStub(system.client.channel)
    deadline = time.monotonic() + 30
    while True:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service="tether.v1.RunService"), timeout=10).status
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert status == health_pb2.HealthCheckResponse.SERVING
