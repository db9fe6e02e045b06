"""Responses cut by bytes below the server's send limit (loopback gRPC, fake ports): a trace and a page
of steps of a run with ~300 tool results of 60 KB, and one step alone past the limit."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from tether_api.v1 import run_service_pb2 as runs_pb, run_service_pb2_grpc as runs_grpc
from tether_run_api import handlers
from tether_run_api.api.metrics import RPCS
from tether_run_api.api.server import start_server
from tether_run_api.api.servicers import Services
from tether_run_api.api.status import error_info
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import ROLE_MEMBER, Principal, hash_api_key
from tether_run_api.domain.runs import new_run_id
from tether_run_api.domain.views import EventView, RunStatus, RunView, StepView, ToolCallView
from tether_run_api.domain.wire import step_bytes, trace_event_bytes
from tether_run_api.testing import FakeApiKeys, FakeCatalog, FakeLedger, FakeLiveEvents, FakePublisher, FakeReadModel

KEY = "tk_member_" + "b" * 30
RUN = new_run_id(1_700_000_000_000, b"\x01" * 10)
RESULT = json.dumps({"body": "é" * 10 + "x" * 60_000}, ensure_ascii=False)  # a 60 KB tool result (non-ASCII counts twice)
N = 300
LIMIT = 16 * 1024 * 1024  # the server's default max_send_message_bytes


def _step(n: int) -> StepView:
    return StepView(step=n, status="DONE", assistant_text="calling", finish_reason="tool_calls",
                    tool_calls=(ToolCallView(call_id=f"{n}.0", tool_name="http_get", args_json='{"url": "u"}',
                                             args_hash="a" * 64, status="COMPLETED", result_json=RESULT),),
                    started_at_ms=1, ended_at_ms=2)


def _event(n: int) -> EventView:
    payload = json.dumps({"step": n, "call_id": f"{n}.0", "tool_name": "http_get", "result_json": RESULT}, ensure_ascii=False)
    return EventView(RUN, n, f"ev-{n}", "tether.v1.ToolCallCompleted", 1_000 + n, payload)


def _serve(read_model: FakeReadModel, max_send: int) -> tuple[grpc.Server, grpc.Channel]:
    keys = FakeApiKeys()
    keys.keys[hash_api_key(KEY)] = Principal("acme", "alice", frozenset({ROLE_MEMBER}))
    services = Services(keys=keys, catalog=FakeCatalog(), ledger=FakeLedger(), read_model=read_model,
                        live=FakeLiveEvents(), publisher=FakePublisher(), limiter=SubmitRateLimiter(10, 10),
                        partitioning=handlers.Partitioning(3))
    server = start_server(services, port=0, workers=4, max_send_message_bytes=max_send)
    # The client takes any size: what is tested is what the server sends.
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.max_receive_message_length", -1)])
    return server, channel


@pytest.fixture
def big_run() -> Iterator[runs_grpc.RunServiceStub]:
    read_model = FakeReadModel()
    read_model.runs[("acme", RUN)] = RunView(RUN, RunStatus.COMPLETED, agent_id="a", goal="g", last_seq=N, steps=N)
    read_model.steps[("acme", RUN)] = [_step(n) for n in range(1, N + 1)]
    read_model.add_events("acme", [_event(n) for n in range(1, N + 1)])
    server, channel = _serve(read_model, LIMIT)
    try:
        yield runs_grpc.RunServiceStub(channel)
    finally:
        channel.close()
        server.stop(0)


def md() -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEY}")]


def test_a_trace_larger_than_the_send_limit_is_cut_by_bytes_and_marked_truncated(big_run) -> None:
    trace = big_run.GetRunTrace(runs_pb.GetRunTraceRequest(run_id=RUN), metadata=md())
    assert trace.truncated and trace.ByteSize() <= LIMIT
    seqs = [e.seq for e in trace.events]
    assert 200 < len(seqs) < N and seqs == list(range(1, len(seqs) + 1))  # the first events, whole
    assert all(e.payload_json == _event(e.seq).payload_json for e in trace.events)


def test_a_page_of_steps_larger_than_the_send_limit_is_shorter_and_the_token_resumes_after_it(big_run) -> None:
    got: list[int] = []
    token, pages = "", 0
    while True:
        page = big_run.ListRunSteps(runs_pb.ListRunStepsRequest(run_id=RUN, page_size=500, page_token=token),
                                    metadata=md())
        assert page.ByteSize() <= LIMIT
        got += [s.step for s in page.steps]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert pages == 2 and got == list(range(1, N + 1))  # every step once, in order


def test_one_step_alone_past_the_limit_is_response_too_large_with_a_reason_and_counted_so() -> None:
    read_model = FakeReadModel()
    read_model.runs[("acme", RUN)] = RunView(RUN, RunStatus.RUNNING)
    read_model.steps[("acme", RUN)] = [_step(1)]
    server, channel = _serve(read_model, 32 * 1024)
    before = RPCS.labels("ListRunSteps", "RESOURCE_EXHAUSTED")._value.get()
    try:
        with pytest.raises(grpc.RpcError) as err:
            runs_grpc.RunServiceStub(channel).ListRunSteps(runs_pb.ListRunStepsRequest(run_id=RUN), metadata=md())
    finally:
        channel.close()
        server.stop(0)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    info, _ = error_info(err.value)
    assert info is not None and info.reason == "RESPONSE_TOO_LARGE"
    assert info.metadata["method"] == "ListRunSteps" and info.metadata["limit_bytes"] == str(32 * 1024)
    assert RPCS.labels("ListRunSteps", "RESOURCE_EXHAUSTED")._value.get() == before + 1


def test_the_size_bounds_are_above_the_encoded_sizes() -> None:
    from tether_run_api.api import convert
    from tether_run_api.domain.trace import build_trace

    step = _step(7)
    assert step_bytes(step) >= len(runs_pb.ListRunStepsResponse(steps=[convert.step_pb(step)]).SerializeToString())
    events = [_event(n) for n in range(1, 4)]
    trace = convert.trace_pb(RunView(RUN, RunStatus.RUNNING), build_trace(events))
    bare = convert.trace_pb(RunView(RUN, RunStatus.RUNNING), build_trace([]))
    assert sum(trace_event_bytes(e) for e in events) >= trace.ByteSize() - bare.ByteSize()
