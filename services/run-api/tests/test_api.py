"""The gRPC boundary over loopback with fake ports: auth metadata, rich error details, size limits, health, reflection."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tether_api.v1 import (
    agent_service_pb2 as agents_pb,
    agent_service_pb2_grpc as agents_grpc,
    approval_service_pb2 as approvals_pb,
    approval_service_pb2_grpc as approvals_grpc,
    run_service_pb2 as runs_pb,
    run_service_pb2_grpc as runs_grpc,
    tool_service_pb2 as tools_pb,
    tool_service_pb2_grpc as tools_grpc,
    types_pb2 as types_pb,
)
from tether_run_api import handlers
from tether_run_api.api.server import SERVICE_NAMES, RunningServer, start_server
from tether_run_api.api.servicers import Services
from tether_run_api.api.status import error_info
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_APPROVER, ROLE_MEMBER, Principal, hash_api_key
from tether_run_api.domain.runs import new_run_id
from tether_run_api.domain.views import EventView, RunStatus, RunView
from tether_run_api.settings import RunApiSettings
from tether_run_api.testing import (
    FakeApiKeys,
    FakeCatalog,
    FakeLedger,
    FakeLiveEvents,
    FakePublisher,
    FakeReadModel,
)

ADMIN_KEY = "tk_admin_" + "a" * 30
MEMBER_KEY = "tk_member_" + "b" * 30
OTHER_KEY = "tk_other_" + "c" * 30


class Harness:
    def __init__(self, services: Services, server: RunningServer, channel: grpc.Channel) -> None:
        self.services = services
        self.server = server
        self.channel = channel
        self.agents = agents_grpc.AgentServiceStub(channel)
        self.tools = tools_grpc.ToolServiceStub(channel)
        self.runs = runs_grpc.RunServiceStub(channel)
        self.approvals = approvals_grpc.ApprovalServiceStub(channel)


@pytest.fixture
def harness() -> Iterator[Harness]:
    keys = FakeApiKeys()
    keys.keys[hash_api_key(ADMIN_KEY)] = Principal("acme", "root", frozenset({ROLE_ADMIN, ROLE_APPROVER}))
    keys.keys[hash_api_key(MEMBER_KEY)] = Principal("acme", "alice", frozenset({ROLE_MEMBER}))
    keys.keys[hash_api_key(OTHER_KEY)] = Principal("evil", "mallory", frozenset({ROLE_ADMIN}))
    services = Services(
        keys=keys, catalog=FakeCatalog(), ledger=FakeLedger(), read_model=FakeReadModel(), live=FakeLiveEvents(),
        publisher=FakePublisher(), limiter=SubmitRateLimiter(1000, 1000), partitioning=handlers.Partitioning(6),
        max_request_bytes=64 * 1024,
        stream_policy=handlers.StreamPolicy(block_ms=10, gap_wait_s=0.2, gap_poll_s=0.01),
    )
    server = start_server(services, port=0, workers=8, max_receive_message_bytes=256 * 1024)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Harness(services, server, channel)
    finally:
        channel.close()
        server.stop(0)


def auth(key: str, header: str = "authorization") -> list[tuple[str, str]]:
    return [(header, f"Bearer {key}" if header == "authorization" else key)]


def reason_of(err: grpc.RpcError) -> str:
    info, _ = error_info(err)
    assert info is not None, f"no ErrorInfo on {err.code()}: {err.details()}"
    assert info.domain == "tether.dev"
    return info.reason


def agent(agent_id: str = "helper") -> agents_pb.Agent:
    return agents_pb.Agent(
        agent_id=agent_id, display_name="Helper", instructions="Help.",
        model=types_pb.ModelRef(provider="openai", name="m"), tool_allowlist=["web_search"],
        caps=types_pb.Caps(max_steps=5, max_wall_clock_ms=60_000, max_tokens=10_000, max_cost_usd_micros=100_000),
    )


def test_wrong_or_missing_api_key_is_unauthenticated_with_reason(harness: Harness) -> None:
    for metadata in ([], auth("tk_unknown_" + "z" * 30), [("authorization", "Token x")]):
        with pytest.raises(grpc.RpcError) as err:
            harness.agents.ListAgents(agents_pb.ListAgentsRequest(), metadata=metadata)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert reason_of(err.value) == "UNAUTHENTICATED_API_KEY"


def test_x_api_key_header_works_and_tenant_comes_from_the_key(harness: Harness) -> None:
    created = harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()),
                                         metadata=auth(ADMIN_KEY, "x-api-key")).agent
    assert created.version == 1 and created.created_by == "root"
    assert [a.agent_id for a in harness.agents.ListAgents(agents_pb.ListAgentsRequest(),
                                                           metadata=auth(MEMBER_KEY)).agents] == ["helper"]
    assert harness.agents.ListAgents(agents_pb.ListAgentsRequest(), metadata=auth(OTHER_KEY)).agents == []


def test_invalid_argument_carries_bad_request_field_violations(harness: Harness) -> None:
    bad = agent("Bad Id")
    bad.caps.max_steps = 0
    with pytest.raises(grpc.RpcError) as err:
        harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=bad), metadata=auth(ADMIN_KEY))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info, details = error_info(err.value)
    assert info.reason == "INVALID_ARGUMENT"
    [bad_request] = [d for d in details if isinstance(d, error_details_pb2.BadRequest)]
    assert {v.field for v in bad_request.field_violations} == {"agent.agent_id", "agent.caps.max_steps"}


def test_invalid_tool_schema_is_refused(harness: Harness) -> None:
    tool = tools_pb.Tool(name="t", description="d", args_schema_json='{"type": 12}',
                         risk_class=types_pb.RISK_CLASS_READ_ONLY, executor_kind="builtin")
    with pytest.raises(grpc.RpcError) as err:
        harness.tools.RegisterTool(tools_pb.RegisterToolRequest(tool=tool), metadata=auth(ADMIN_KEY))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    tool.args_schema_json = '{"type": "object"}'
    assert harness.tools.RegisterTool(tools_pb.RegisterToolRequest(tool=tool), metadata=auth(ADMIN_KEY)).tool.version == 1


def test_member_cannot_write_the_catalog(harness: Harness) -> None:
    with pytest.raises(grpc.RpcError) as err:
        harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert reason_of(err.value) == "MISSING_ROLE"


def test_oversized_requests_are_refused_at_both_limits(harness: Harness) -> None:
    # Above the handler limit (64 KiB here) but below the transport ceiling: a rich error.
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="x" * 100_000),
                               metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reason_of(err.value) == "REQUEST_TOO_LARGE"
    # Above the transport ceiling (256 KiB here): gRPC refuses it before any handler runs.
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="x" * 300_000),
                               metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert harness.services.publisher.published == []


def test_bytes_that_are_no_request_message_are_malformed_not_internal(harness: Harness) -> None:
    garbage = b"\xff\xff\xff\xff\x0f not a protobuf"
    submit = harness.channel.unary_unary("/tether.v1.RunService/SubmitRun")
    with pytest.raises(grpc.RpcError) as err:
        submit(garbage, metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    info, _ = error_info(err.value)
    assert info.reason == "MALFORMED_REQUEST" and info.domain == "tether.dev"
    assert info.metadata["method"] == "/tether.v1.RunService/SubmitRun"
    assert info.metadata["size_bytes"] == str(len(garbage))
    # Authentication still comes first; a server-streaming method is guarded the same way.
    with pytest.raises(grpc.RpcError) as err:
        submit(garbage, metadata=auth("tk_nobody_" + "d" * 30))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    stream = harness.channel.unary_stream("/tether.v1.RunService/StreamRunEvents")
    with pytest.raises(grpc.RpcError) as err:
        list(stream(garbage, metadata=auth(MEMBER_KEY)))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and reason_of(err.value) == "MALFORMED_REQUEST"
    assert harness.services.publisher.published == []


def test_goal_cap_is_a_field_violation(harness: Harness) -> None:
    harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(ADMIN_KEY))
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="x" * 40_000),
                               metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    _, details = error_info(err.value)
    assert [v.field for d in details if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations] \
        == ["goal"]


def test_rate_limit_carries_retry_info(harness: Harness) -> None:
    harness.services.limiter = SubmitRateLimiter(0.5, 1)
    harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(ADMIN_KEY))
    harness.runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r1", agent_id="helper", goal="g"),
                           metadata=auth(MEMBER_KEY))
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r2", agent_id="helper", goal="g"),
                               metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    info, details = error_info(err.value)
    assert info.reason == "RATE_LIMITED"
    [retry] = [d for d in details if isinstance(d, error_details_pb2.RetryInfo)]
    assert retry.retry_delay.ToMilliseconds() > 0


def test_submit_get_and_other_tenant_not_found(harness: Harness) -> None:
    harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(ADMIN_KEY))
    sub = harness.runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r1", agent_id="helper", goal="g"),
                                 metadata=auth(MEMBER_KEY))
    again = harness.runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r1", agent_id="helper", goal="g"),
                                   metadata=auth(MEMBER_KEY))
    assert again.run_id == sub.run_id and sub.agent_version == 1
    run = harness.runs.GetRun(runs_pb.GetRunRequest(run_id=sub.run_id), metadata=auth(MEMBER_KEY)).run
    assert run.status == runs_pb.RUN_STATUS_PENDING and run.goal == "g"
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.GetRun(runs_pb.GetRunRequest(run_id=sub.run_id), metadata=auth(OTHER_KEY))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and reason_of(err.value) == "RUN_NOT_FOUND"
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.GetRun(runs_pb.GetRunRequest(run_id="nope"), metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_agent_is_not_found(harness: Harness) -> None:
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="ghost", goal="g"), metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and reason_of(err.value) == "AGENT_NOT_FOUND"


def test_stream_run_events_from_a_seq(harness: Harness) -> None:
    harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(ADMIN_KEY))
    run_id = harness.runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"),
                                    metadata=auth(MEMBER_KEY)).run_id
    events = [EventView(run_id, s, f"e{s}", "tether.v1.RunCompleted" if s == 4 else "tether.v1.StepGranted",
                        1000 + s, json.dumps({"step": s})) for s in range(1, 5)]
    harness.services.read_model.add_events("acme", events)
    got = [r.event for r in harness.runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=2),
                                                         metadata=auth(MEMBER_KEY))]
    assert [e.seq for e in got] == [2, 3, 4] and got[-1].terminal
    assert got[0].record_time.ToMilliseconds() == 1002 and json.loads(got[0].payload_json) == {"step": 2}
    with pytest.raises(grpc.RpcError) as err:
        list(harness.runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id), metadata=auth(OTHER_KEY)))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and reason_of(err.value) == "RUN_NOT_FOUND"


def test_decide_needs_the_approver_role(harness: Harness) -> None:
    with pytest.raises(grpc.RpcError) as err:
        harness.approvals.DecideApproval(approvals_pb.DecideApprovalRequest(approval_id="a", args_hash="0" * 64),
                                         metadata=auth(MEMBER_KEY))
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        harness.approvals.DecideApproval(approvals_pb.DecideApprovalRequest(approval_id="a", args_hash="0" * 64),
                                         metadata=auth(ADMIN_KEY))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and reason_of(err.value) == "APPROVAL_NOT_FOUND"


def test_health_and_reflection(harness: Harness) -> None:
    health = health_pb2_grpc.HealthStub(harness.channel)
    for name in ("", *SERVICE_NAMES):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(harness.channel)
    [reply] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert set(SERVICE_NAMES) <= names and "grpc.health.v1.Health" in names


def _violated_fields(err: grpc.RpcError) -> set[str]:
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    info, details = error_info(err)
    assert info is not None and info.reason == "INVALID_ARGUMENT"
    return {v.field for d in details if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations}


def test_a_nul_character_in_any_stored_string_is_a_field_violation(harness: Harness) -> None:
    # proto3 strings may hold U+0000; PostgreSQL text and jsonb cannot, so each is refused up front.
    bad_agent = agent()
    bad_agent.display_name, bad_agent.instructions, bad_agent.model.name = "He\x00lper", "Help\x00.", "m\x00"
    with pytest.raises(grpc.RpcError) as err:
        harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=bad_agent), metadata=auth(ADMIN_KEY))
    assert _violated_fields(err.value) == {"agent.display_name", "agent.instructions", "agent.model.name"}
    tool = tools_pb.Tool(name="t", description="d\x00", risk_class=types_pb.RISK_CLASS_READ_ONLY,
                         executor_kind="builtin", args_schema_json='{"type": "object", "title": "a\\u0000b"}',
                         constraints_json='{"k\\u0000": 1}')
    with pytest.raises(grpc.RpcError) as err:
        harness.tools.RegisterTool(tools_pb.RegisterToolRequest(tool=tool), metadata=auth(ADMIN_KEY))
    assert _violated_fields(err.value) == {"tool.description", "tool.args_schema_json", "tool.constraints_json"}

    # The goal is refused before a rate-limit token is spent: the one token left still admits a run.
    harness.services.limiter = SubmitRateLimiter(0.001, 1)
    harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(ADMIN_KEY))
    with pytest.raises(grpc.RpcError) as err:
        harness.runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r1", agent_id="helper", goal="find\x00things"),
                               metadata=auth(MEMBER_KEY))
    assert _violated_fields(err.value) == {"goal"}
    assert harness.services.publisher.published == []
    run_id = harness.runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="r2", agent_id="helper", goal="g"),
                                    metadata=auth(MEMBER_KEY)).run_id

    with pytest.raises(grpc.RpcError) as err:
        harness.runs.CancelRun(runs_pb.CancelRunRequest(run_id=run_id, reason="stop\x00"), metadata=auth(MEMBER_KEY))
    assert _violated_fields(err.value) == {"reason"}
    with pytest.raises(grpc.RpcError) as err:
        harness.approvals.GetApproval(approvals_pb.GetApprovalRequest(approval_id="a\x00"), metadata=auth(MEMBER_KEY))
    assert _violated_fields(err.value) == {"approval_id"}
    with pytest.raises(grpc.RpcError) as err:
        harness.approvals.DecideApproval(approvals_pb.DecideApprovalRequest(
            approval_id="a\x00", args_hash="0" * 64, approve=True, comment="ok\x00"), metadata=auth(ADMIN_KEY))
    assert _violated_fields(err.value) == {"approval_id", "comment"}
    assert len(harness.services.publisher.published) == 1  # only the valid submit


def _token(listing: str, key: object) -> str:
    return base64.urlsafe_b64encode(json.dumps({"l": listing, "k": key}).encode()).decode().rstrip("=")


def test_a_crafted_page_token_is_invalid_page_token_not_internal(harness: Harness) -> None:
    # Each listing's token is bound to it and decodes to a key of one shape; any other key, though
    # valid JSON for that listing, is refused as INVALID_PAGE_TOKEN before it reaches a query.
    harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(ADMIN_KEY))
    run_id = harness.runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"),
                                    metadata=auth(MEMBER_KEY)).run_id
    md = auth(ADMIN_KEY)
    calls = {
        "approvals:PENDING:": lambda t: harness.approvals.ListApprovals(
            approvals_pb.ListApprovalsRequest(page_token=t), metadata=md),
        "agents": lambda t: harness.agents.ListAgents(agents_pb.ListAgentsRequest(page_token=t), metadata=md),
        "tools": lambda t: harness.tools.ListTools(tools_pb.ListToolsRequest(page_token=t), metadata=md),
        "runs": lambda t: harness.runs.ListRuns(runs_pb.ListRunsRequest(page_token=t), metadata=md),
        f"steps:{run_id}": lambda t: harness.runs.ListRunSteps(
            runs_pb.ListRunStepsRequest(run_id=run_id, page_token=t), metadata=md),
    }
    crafted = {
        "approvals:PENDING:": [["x", "y"], [1, 2], [True, "a"], [1.5, "a"], [-1, "a"], [2**64, "a"], [1, ""],
                               [1, "a\x00"], [1, "a", 3], {"a": 1}, "1"],
        "agents": [5, ["helper"], "Helper", "helper\x00", "helper\n"],
        "tools": [5, "Web", "web_search\x00"],
        "runs": [5, "RUN1", run_id + "\x00", [run_id]],
        f"steps:{run_id}": ["1", True, 1.5, -1, 2**40, [1]],
    }
    for listing, keys in crafted.items():
        for key in keys:
            with pytest.raises(grpc.RpcError) as err:
                calls[listing](_token(listing, key))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (listing, key, err.value.details())
            assert reason_of(err.value) == "INVALID_PAGE_TOKEN", (listing, key)
    # The keys the server issues still resume.
    for listing, key in {"approvals:PENDING:": [1, "a"], "agents": "helper", "tools": "web_search",
                         "runs": run_id, f"steps:{run_id}": 1}.items():
        calls[listing](_token(listing, key))


def test_an_undecodable_or_oversized_page_token_is_invalid_page_token_not_internal(harness: Harness) -> None:
    # json.loads raises RecursionError (no ValueError) on deep nesting, which fits in a short token;
    # a token longer than any the server issues is refused unread, even when it would decode.
    harness.agents.CreateAgent(agents_pb.CreateAgentRequest(agent=agent()), metadata=auth(ADMIN_KEY))
    run_id = harness.runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"),
                                    metadata=auth(MEMBER_KEY)).run_id
    md = auth(ADMIN_KEY)
    calls = {
        "approvals:PENDING:": lambda t: harness.approvals.ListApprovals(
            approvals_pb.ListApprovalsRequest(page_token=t), metadata=md),
        "agents": lambda t: harness.agents.ListAgents(agents_pb.ListAgentsRequest(page_token=t), metadata=md),
        "tools": lambda t: harness.tools.ListTools(tools_pb.ListToolsRequest(page_token=t), metadata=md),
        "runs": lambda t: harness.runs.ListRuns(runs_pb.ListRunsRequest(page_token=t), metadata=md),
        f"steps:{run_id}": lambda t: harness.runs.ListRunSteps(
            runs_pb.ListRunStepsRequest(run_id=run_id, page_token=t), metadata=md),
    }
    resumable = {"approvals:PENDING:": [1, "a"], "agents": "helper", "tools": "web_search", "runs": run_id,
                 f"steps:{run_id}": 1}

    def padded(listing: str) -> str:
        body = {"l": listing, "k": resumable[listing], "pad": "x" * 5000}
        return base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")

    for listing, call in calls.items():
        deep = [base64.urlsafe_b64encode(opener * 1000).decode().rstrip("=") for opener in (b"[", b'{"a":')]
        for token in (*deep, padded(listing)):
            with pytest.raises(grpc.RpcError) as err:
                call(token)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (listing, token[:20], err.value.details())
            assert reason_of(err.value) == "INVALID_PAGE_TOKEN", listing
        call(_token(listing, resumable[listing]))  # the tokens the server issues still resume


class _BlockingLive(FakeLiveEvents):
    """A quiet feed that waits block_ms, as XREAD BLOCK does, instead of answering at once."""

    def read(self, run_id: str, cursor: str, block_ms: int):
        entries, cursor = super().read(run_id, cursor, block_ms)
        if not entries:
            time.sleep(block_ms / 1000)
        return entries, cursor


def test_one_tenant_cannot_take_every_stream_slot() -> None:
    # 3 slots, at most 2 per tenant: a tenant watching its live runs is refused its third stream with
    # its own reason while another tenant is still served; only a full server is TOO_MANY_STREAMS.
    keys = FakeApiKeys()
    keys.keys[hash_api_key(MEMBER_KEY)] = Principal("acme", "alice", frozenset({ROLE_MEMBER}))
    keys.keys[hash_api_key(OTHER_KEY)] = Principal("evil", "mallory", frozenset({ROLE_MEMBER}))
    read_model = FakeReadModel()
    runs = {}
    for i, tenant in enumerate(("acme", "evil")):
        run_id = runs[tenant] = new_run_id(1_700_000_000_000, bytes([i]) * 10)
        read_model.runs[(tenant, run_id)] = RunView(run_id, RunStatus.RUNNING, last_seq=1)
        read_model.add_events(tenant, [EventView(run_id, 1, "e1", "tether.v1.RunAccepted", 1, "{}")])
    services = Services(
        keys=keys, catalog=FakeCatalog(), ledger=FakeLedger(), read_model=read_model, live=_BlockingLive(),
        publisher=FakePublisher(), limiter=SubmitRateLimiter(1000, 1000), partitioning=handlers.Partitioning(6),
        max_streams=3, max_streams_per_tenant=2, stream_policy=handlers.StreamPolicy(block_ms=20),
    )
    server = start_server(services, port=0, workers=8)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = runs_grpc.RunServiceStub(channel)
    held = []

    def hold(tenant: str, key: str) -> None:
        call = stub.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=runs[tenant]), metadata=auth(key))
        assert next(call).event.seq == 1  # the server has taken the slot; the run goes on, so does the call
        held.append(call)

    def refusal(tenant: str, key: str) -> str:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=runs[tenant]), metadata=auth(key),
                                      timeout=10))
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        return reason_of(err.value)

    try:
        hold("evil", OTHER_KEY)
        hold("evil", OTHER_KEY)
        assert refusal("evil", OTHER_KEY) == "TENANT_TOO_MANY_STREAMS"
        hold("acme", MEMBER_KEY)  # the other tenant still gets the last slot
        assert refusal("acme", MEMBER_KEY) == "TOO_MANY_STREAMS"  # now the server is full
    finally:
        for call in held:
            call.cancel()
        channel.close()
        server.stop(0)


def test_a_tenants_share_of_stream_slots_defaults_to_a_quarter() -> None:
    def share(max_streams: int, per_tenant: int = 0) -> int:
        return Services(keys=FakeApiKeys(), catalog=FakeCatalog(), ledger=FakeLedger(), read_model=FakeReadModel(),
                        live=FakeLiveEvents(), publisher=FakePublisher(), limiter=SubmitRateLimiter(1, 1),
                        partitioning=handlers.Partitioning(6), max_streams=max_streams,
                        max_streams_per_tenant=per_tenant).streams_per_tenant()

    assert RunApiSettings.model_fields["max_streams_per_tenant"].default == 0
    assert (share(32), share(3), share(1), share(32, 5), share(4, 10)) == (8, 1, 1, 5, 4)


def test_an_unknown_approval_status_is_a_field_violation_not_pending(harness: Harness) -> None:
    # proto3 enums are open: a number this server does not know reaches it as is, and must not be
    # read as UNSPECIFIED (which lists PENDING).
    with pytest.raises(grpc.RpcError) as err:
        harness.approvals.ListApprovals(approvals_pb.ListApprovalsRequest(status=99), metadata=auth(MEMBER_KEY))
    assert _violated_fields(err.value) == {"status"}
    assert harness.approvals.ListApprovals(approvals_pb.ListApprovalsRequest(
        status=approvals_pb.APPROVAL_STATUS_UNSPECIFIED), metadata=auth(MEMBER_KEY)).approvals == []
