"""run-api against the real stack: gRPC on 127.0.0.1, PostgreSQL, Kafka (the produced commands), Redis streams."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import grpc
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from psycopg import sql

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
from tether_contracts.records import CancelRun, DecideApproval, SubmitRun
from tether_messaging.envelopes import derived_id, make_envelope
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import decode_envelope, encode, fingerprint_hex, open_payload
from tether_run_api import admin
from tether_run_api.adapters.live import stream_key
from tether_run_api.api.status import error_info
from tether_run_api.cli.main import EXIT_NOT_FOUND
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_APPROVER, ROLE_MEMBER, hash_api_key
from tether_run_api.domain.runs import new_run_id
from tether_run_api.domain.views import Submission
from tether_testing.processes import free_port

pytestmark = pytest.mark.integration


def tenant(stack, *roles: str, spread: int = 1) -> tuple[str, str]:
    """A fresh tenant with a key of the given roles; returns (tenant_id, api_key)."""
    tenant_id = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(stack.app.store, tenant_id, spread=spread)
    key = admin.issue_key(stack.app.store, tenant_id, "alice", roles or (ROLE_MEMBER,))
    return tenant_id, key.api_key


def md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def reason(err: grpc.RpcError) -> str:
    info, _ = error_info(err)
    return info.reason if info else ""


def with_demo(stack) -> tuple[str, str]:
    """A tenant whose admin+approver key has an agent 'helper' with one granted tool."""
    tenant_id, key = tenant(stack, ROLE_ADMIN, ROLE_APPROVER)
    tools = tools_grpc.ToolServiceStub(stack.channel)
    tools.RegisterTool(tools_pb.RegisterToolRequest(tool=tools_pb.Tool(
        name="lookup", description="Look something up.",
        args_schema_json=json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}),
        risk_class=types_pb.RISK_CLASS_READ_ONLY, executor_kind="builtin", idempotent=True,
        executor_config_json='{"builtin": "kv_get"}',
        constraints_json='{"rules": [{"kind": "max_amount", "arg": "/q", "max": 5}]}')), metadata=md(key))
    admin.grant_tools(stack.app.store, tenant_id, "*", ["lookup"])
    agents_grpc.AgentServiceStub(stack.channel).CreateAgent(agents_pb.CreateAgentRequest(agent=agents_pb.Agent(
        agent_id="helper", display_name="Helper", instructions="Help.",
        model=types_pb.ModelRef(provider="openai", name="tether-scripted"), tool_allowlist=["lookup", "missing"],
        caps=types_pb.Caps(max_steps=4, max_wall_clock_ms=60_000, max_tokens=5_000, max_cost_usd_micros=10_000),
    )), metadata=md(key))
    return tenant_id, key


def records_for(stack, run_id: str, partition: int, expect: int, timeout_s: float = 30.0):
    """Every record keyed run_id on the commands topic's partition (waits until `expect` are there)."""
    consumer = Consumer({"bootstrap.servers": stack.settings.kafka_bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    topic = stack.settings.topic_prefix + "tether.commands.v1"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
            found, position = [], 0
            while position < high:
                msg = consumer.poll(1.0)
                if msg is None:
                    continue
                if msg.error():
                    raise RuntimeError(msg.error())
                position = msg.offset() + 1
                if msg.key() == run_id.encode():
                    found.append(msg)
            if len(found) >= expect or time.monotonic() > deadline:
                return found
            time.sleep(0.2)
    finally:
        consumer.close()


def test_wrong_api_key_is_unauthenticated(stack) -> None:
    runs = runs_grpc.RunServiceStub(stack.channel)
    with pytest.raises(grpc.RpcError) as err:
        runs.ListRuns(runs_pb.ListRunsRequest(), metadata=md("tk_" + "x" * 40))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED and reason(err.value) == "UNAUTHENTICATED_API_KEY"
    _, key = tenant(stack)
    assert stack.app.store.revoke_api_key(hash_api_key(key))
    with pytest.raises(grpc.RpcError) as err:
        runs.ListRuns(runs_pb.ListRunsRequest(), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED  # revoked (auth cache is off in tests)


def admin_cli(stack, monkeypatch, *args: str, input: str | None = None):  # noqa: A002 (click's name)
    """`tether [--json] admin ...` against this module's schema, as an operator runs it."""
    from typer.testing import CliRunner

    from tether_run_api.cli import main as cli

    monkeypatch.setenv("TETHER_PG_DSN", stack.settings.pg_dsn)
    monkeypatch.setenv("TETHER_RUN_API_PG_SCHEMA", stack.settings.pg_schema)
    return CliRunner().invoke(cli.app, list(args), input=input)


def test_a_key_revoked_with_the_cli_is_refused_once_the_auth_cache_has_passed(stack, monkeypatch) -> None:
    tenant_id, key = with_demo(stack)
    bob = admin.issue_key(stack.app.store, tenant_id, "bob", (ROLE_MEMBER,), label="bob's laptop")
    monkeypatch.setattr(stack.app.services, "auth_cache_s", 0.5)  # as in production, lookups are cached
    runs = runs_grpc.RunServiceStub(stack.channel)
    run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
    runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(key))  # works, and is cached now

    listed = admin_cli(stack, monkeypatch, "--json", "admin", "list-keys", tenant_id)
    assert listed.exit_code == 0, listed.output
    assert key not in listed.output and bob.api_key not in listed.output  # key ids only
    ids = {k["principal_id"]: k["key_id"] for k in json.loads(listed.stdout)}
    assert ids == {"alice": hash_api_key(key)[:12], "bob": bob.key_id}

    # A leaked key is revoked as the operator has it: on stdin (here as the export line bootstrap-demo prints).
    revoked = admin_cli(stack, monkeypatch, "admin", "revoke-key", "--key-file", "-",
                        input=f"export TETHER_API_KEY={key}\n")
    assert revoked.exit_code == 0, revoked.output
    assert f"revoked key {ids['alice']} of alice in {tenant_id}" in revoked.stdout and key not in revoked.output
    time.sleep(0.6)  # past the auth cache: the server looks the key up again
    calls = [lambda: runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)),
             lambda: runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(key))]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED and reason(err.value) == "UNAUTHENTICATED_API_KEY"

    again = admin_cli(stack, monkeypatch, "admin", "revoke-key", "--key-file", "-", input=key)
    assert again.exit_code == 0, again.output
    assert f"key {ids['alice']} of alice in {tenant_id}: already revoked at " in again.stdout

    # By key id (what list-keys shows), limited to the tenant; bob's key stops working too.
    by_id = admin_cli(stack, monkeypatch, "--json", "admin", "revoke-key", "--key-id", bob.key_id,
                      "--tenant", tenant_id)
    assert by_id.exit_code == 0, by_id.output
    result = json.loads(by_id.stdout)
    assert (result["key_id"], result["status"], result["principal_id"], result["label"]) == \
        (bob.key_id, "revoked", "bob", "bob's laptop") and result["revoked_at"]
    with pytest.raises(grpc.RpcError) as err:
        runs.ListRuns(runs_pb.ListRunsRequest(), metadata=md(bob.api_key))
    assert reason(err.value) == "UNAUTHENTICATED_API_KEY"

    # Not found: exit 3. Another tenant's key is left alone when --tenant names this one.
    _, other_key = tenant(stack)
    missing = admin_cli(stack, monkeypatch, "admin", "revoke-key", "--key-file", "-", "--tenant", tenant_id,
                        input=other_key)
    assert missing.exit_code == EXIT_NOT_FOUND and ": not found" in missing.stdout
    assert other_key not in missing.output
    assert runs.ListRuns(runs_pb.ListRunsRequest(), metadata=md(other_key)).runs == []
    unknown = admin_cli(stack, monkeypatch, "admin", "revoke-key", "--key-id", "00000000000f")
    assert unknown.exit_code == EXIT_NOT_FOUND and "key 00000000000f: not found" in unknown.stdout
    listed = json.loads(admin_cli(stack, monkeypatch, "--json", "admin", "list-keys", tenant_id).stdout)
    assert all(k["revoked_at"] for k in listed)


def test_a_revoked_grant_is_left_out_of_new_runs_and_the_gateway_denies_the_tool(stack, monkeypatch) -> None:
    from tether_tool_gateway.domain.canonical import sha256_hex
    from tether_tool_gateway.domain.policy import CallDecisionInputs, Deny, TrustPolicy

    tenant_id, key = with_demo(stack)  # lookup is granted to every principal ('*')
    runs = runs_grpc.RunServiceStub(stack.channel)

    def submit_and_decide() -> tuple[SubmitRun, object]:
        run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
        [msg] = records_for(stack, run_id, partition_for(tenant_id, run_id, stack.settings.partitions, 1), expect=1)
        cmd = open_payload(decode_envelope(msg.value()))
        args = '{"q": "1"}'
        verdict = TrustPolicy().decide_call(CallDecisionInputs(
            tool_name="lookup", args_json=args, args_hash=sha256_hex(args), tool=cmd.tools[0],
            tenant_grants=cmd.tenant_grants, agent_allowlist=cmd.agent.tool_allowlist, recorded_at_ms=1,
            tenant_id=tenant_id, agent_id="helper", principal_id="alice")).verdict
        return cmd, verdict

    granted = admin_cli(stack, monkeypatch, "admin", "grant", tenant_id, "lookup", "--principal", "alice")
    assert granted.exit_code == 0, granted.output
    own = admin_cli(stack, monkeypatch, "admin", "revoke-grant", tenant_id, "lookup", "--principal", "alice")
    assert own.exit_code == 0, own.output
    assert f"revoked grant of lookup to alice in {tenant_id}; still granted to every principal ('*')" in own.stdout
    cmd, verdict = submit_and_decide()
    assert cmd.tenant_grants == ["lookup"]
    assert not (isinstance(verdict, Deny) and verdict.reason_code == "TOOL_NOT_ALLOWED"), verdict

    everyone = admin_cli(stack, monkeypatch, "--json", "admin", "revoke-grant", tenant_id, "lookup")
    assert everyone.exit_code == 0, everyone.output
    assert json.loads(everyone.stdout) == {"tenant_id": tenant_id, "principal_id": "*", "tool_name": "lookup",
                                           "status": "revoked", "still_granted": False}
    cmd, verdict = submit_and_decide()
    assert cmd.tenant_grants == [] and [t.name for t in cmd.tools] == ["lookup"]  # offered by the agent, not granted
    assert isinstance(verdict, Deny) and verdict.reason_code == "TOOL_NOT_ALLOWED"
    assert "not granted to this principal" in verdict.detail

    again = admin_cli(stack, monkeypatch, "admin", "revoke-grant", tenant_id, "lookup")
    assert again.exit_code == EXIT_NOT_FOUND
    assert f"grant of lookup to every principal ('*') in {tenant_id}: not found" in again.stdout


def test_submit_produces_the_command_and_is_idempotent(stack) -> None:
    tenant_id, key = with_demo(stack)
    runs = runs_grpc.RunServiceStub(stack.channel)
    req = runs_pb.SubmitRunRequest(request_id=str(uuid.uuid4()), agent_id="helper", goal="Find the answer.",
                                   caps=types_pb.Caps(max_steps=2),
                                   delegated_scope=runs_pb.DelegatedScope(tools=["lookup"]))
    first = runs.SubmitRun(req, metadata=md(key))
    again = runs.SubmitRun(req, metadata=md(key))
    assert again.run_id == first.run_id and first.agent_version == 1
    partition = partition_for(tenant_id, first.run_id, stack.settings.partitions, 1)
    [msg] = records_for(stack, first.run_id, partition, expect=1)
    assert msg.partition() == partition
    env = decode_envelope(msg.value())
    assert (env.tenant_id, env.run_id, env.producer) == (tenant_id, first.run_id, "run-api")
    assert env.event_id == derived_id(first.run_id, "SubmitRun") and env.seq is None
    headers = {k: v.decode() for k, v in msg.headers()}
    assert headers["tether-tenant"] == tenant_id and headers["tether-run"] == first.run_id
    assert headers["tether-event-type"] == "tether.v1.SubmitRun"
    assert headers["tether-schema-fingerprint"] == fingerprint_hex(SubmitRun) == env.schema_fingerprint
    cmd = open_payload(env)
    assert isinstance(cmd, SubmitRun)
    assert cmd.goal == "Find the answer." and cmd.principal_id == "alice" and cmd.caps.max_steps == 2
    assert [t.name for t in cmd.tools] == ["lookup"] and cmd.tenant_grants == ["lookup"]
    assert cmd.agent.tool_allowlist == ["lookup", "missing"] and cmd.agent.version == 1
    assert cmd.delegated_scope == ["lookup"]
    assert cmd.tools[0].constraints_json == '{"rules":[{"arg":"/q","kind":"max_amount","max":5}]}'
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(request_id=req.request_id, agent_id="helper", goal="Other."),
                       metadata=md(key))
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS and reason(err.value) == "REQUEST_ID_REUSED"


def test_spread_tenant_runs_land_in_its_partitions(stack) -> None:
    tenant_id, key = with_demo(stack)
    admin.create_tenant(stack.app.store, tenant_id, spread=3)
    runs = runs_grpc.RunServiceStub(stack.channel)
    for _ in range(3):
        run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
        partition = partition_for(tenant_id, run_id, stack.settings.partitions, 3)
        assert len(records_for(stack, run_id, partition, expect=1)) == 1


def test_another_tenants_run_is_not_found(stack) -> None:
    _, key = with_demo(stack)
    _, other = tenant(stack, ROLE_ADMIN, ROLE_APPROVER)
    runs = runs_grpc.RunServiceStub(stack.channel)
    run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
    assert runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(key)).run.status == \
        runs_pb.RUN_STATUS_PENDING
    calls = [
        lambda: runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(other)),
        lambda: runs.CancelRun(runs_pb.CancelRunRequest(run_id=run_id), metadata=md(other)),
        lambda: runs.ListRunSteps(runs_pb.ListRunStepsRequest(run_id=run_id), metadata=md(other)),
        lambda: runs.GetRunTrace(runs_pb.GetRunTraceRequest(run_id=run_id), metadata=md(other)),
        lambda: list(runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id), metadata=md(other))),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() is grpc.StatusCode.NOT_FOUND and reason(err.value) == "RUN_NOT_FOUND"
    assert runs.ListRuns(runs_pb.ListRunsRequest(), metadata=md(other)).runs == []


def test_malformed_and_oversized_requests(stack) -> None:
    _, key = with_demo(stack)
    runs = runs_grpc.RunServiceStub(stack.channel)
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(request_id="no spaces allowed", agent_id="Helper!", goal=" ",
                                                caps=types_pb.Caps(max_steps=99)), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    _, details = error_info(err.value)
    fields = {v.field for d in details if isinstance(d, error_details_pb2.BadRequest) for v in d.field_violations}
    assert fields == {"request_id", "agent_id", "goal"}
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g", caps=types_pb.Caps(max_steps=99)),
                       metadata=md(key))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # loosening the agent's cap
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="x" * 300_000), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and reason(err.value) == "REQUEST_TOO_LARGE"
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="x" * 2_000_000), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # the transport ceiling, before any handler
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="ghost", goal="g"), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and reason(err.value) == "AGENT_NOT_FOUND"


def test_catalog_versions_pages_and_idempotent_creates(stack) -> None:
    tenant_id, key = with_demo(stack)
    agents = agents_grpc.AgentServiceStub(stack.channel)
    tools = tools_grpc.ToolServiceStub(stack.channel)
    base = agents.GetAgent(agents_pb.GetAgentRequest(agent_id="helper"), metadata=md(key)).agent
    for i in range(3):
        a = agents_pb.Agent()
        a.CopyFrom(base)
        a.agent_id = f"agent-{i}"
        rid = f"create-{i}"
        made = agents.CreateAgent(agents_pb.CreateAgentRequest(request_id=rid, agent=a), metadata=md(key)).agent
        assert agents.CreateAgent(agents_pb.CreateAgentRequest(request_id=rid, agent=a),
                                  metadata=md(key)).agent == made
    update = agents_pb.Agent(agent_id="helper", version=1, instructions="Be brief.")
    v2 = agents.UpdateAgent(agents_pb.UpdateAgentRequest(agent=update, update_mask={"paths": ["instructions"]}),
                            metadata=md(key)).agent
    assert (v2.version, v2.instructions, v2.display_name) == (2, "Be brief.", "Helper")
    with pytest.raises(grpc.RpcError) as err:
        agents.UpdateAgent(agents_pb.UpdateAgentRequest(agent=update, update_mask={"paths": ["instructions"]}),
                           metadata=md(key))
    assert err.value.code() is grpc.StatusCode.ABORTED and reason(err.value) == "AGENT_VERSION_CONFLICT"
    assert agents.GetAgent(agents_pb.GetAgentRequest(agent_id="helper", version=1),
                           metadata=md(key)).agent.instructions == "Help."
    seen, token = [], ""
    while True:
        page = agents.ListAgents(agents_pb.ListAgentsRequest(page_size=2, page_token=token), metadata=md(key))
        seen += [(a.agent_id, a.version) for a in page.agents]
        token = page.next_page_token
        if not token:
            break
    assert seen == [("agent-0", 1), ("agent-1", 1), ("agent-2", 1), ("helper", 2)]
    with pytest.raises(grpc.RpcError) as err:
        agents.CreateAgent(agents_pb.CreateAgentRequest(agent=base), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS and reason(err.value) == "AGENT_ALREADY_EXISTS"

    lookup = tools.GetTool(tools_pb.GetToolRequest(name="lookup"), metadata=md(key)).tool
    lookup.description = "Look it up, v2."
    v2_tool = tools.RegisterTool(tools_pb.RegisterToolRequest(tool=lookup), metadata=md(key)).tool
    assert v2_tool.version == 2
    assert list(tools.DisableTool(tools_pb.DisableToolRequest(name="lookup", version=2),
                                  metadata=md(key)).disabled_versions) == [2]
    listed = tools.ListTools(tools_pb.ListToolsRequest(show_disabled=True), metadata=md(key)).tools
    assert [(t.name, t.version, t.disabled) for t in listed] == [("lookup", 2, True)]
    assert tools.ListTools(tools_pb.ListToolsRequest(), metadata=md(key)).tools == []
    # New runs snapshot the latest *enabled* version.
    assert [t.spec.version for t in stack.app.store.latest_enabled_tools(tenant_id, ["lookup"])] == [1]


def _seed_run(stack, tenant_id: str, run_id: str, status: str = "RUNNING", last_seq: int = 0) -> None:
    with stack.pg() as conn:
        conn.execute(sql.SQL("INSERT INTO {}.runs (run_id, tenant_id, status, agent_id, agent_version, goal, "
                             "principal_id, created_at_ms, updated_at_ms, last_seq, last_hash, state) "
                             "VALUES (%s, %s, %s, 'helper', 1, 'g', 'alice', 1, 1, %s, '', '{{}}')").format(
            sql.Identifier(stack.settings.read_model_schema)), (run_id, tenant_id, status, last_seq))


def _event(run_id: str, seq: int, etype: str) -> dict:
    return {"run_id": run_id, "seq": seq, "event_id": f"ev-{seq}", "event_type": f"tether.v1.{etype}",
            "recorded_at_ms": 1_700_000_000_000 + seq * 10, "payload": {"step": seq}, "hash": f"h{seq}",
            "prev_hash": f"h{seq - 1}"}


def _store_event(stack, tenant_id: str, e: dict) -> None:
    with stack.pg() as conn:
        conn.execute(sql.SQL("INSERT INTO {}.events (tenant_id, run_id, seq, event_id, event_type, recorded_at_ms, "
                             "payload, hash, prev_hash, producer) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, "
                             "'budget')").format(
            sql.Identifier(stack.settings.read_model_schema)),
            (tenant_id, e["run_id"], e["seq"], e["event_id"], e["event_type"], e["recorded_at_ms"],
             json.dumps(e["payload"]), e["hash"], e["prev_hash"]))


def _publish(stack, e: dict, *, bare: bool = False) -> None:
    key = stream_key(e["run_id"], stack.settings.live_key_prefix)
    fields = {"seq": e["seq"]} if bare else {
        "seq": e["seq"], "event_id": e["event_id"], "event_type": e["event_type"],
        "recorded_at_ms": e["recorded_at_ms"], "payload": json.dumps(e["payload"]), "hash": e["hash"],
        "prev_hash": e["prev_hash"]}
    stack.redis.xadd(key, fields)


def test_stream_run_events_catches_up_follows_live_and_resumes(stack) -> None:
    tenant_id, key = with_demo(stack)
    runs = runs_grpc.RunServiceStub(stack.channel)
    run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
    _seed_run(stack, tenant_id, run_id, status="ACCEPTED")
    assert runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(key)).run.status == \
        runs_pb.RUN_STATUS_RUNNING
    types = ["RunAccepted", "StepGranted", "ModelCallCompleted", "ToolCallRequested", "ToolCallBudgeted",
             "ToolCallCompleted", "StepGranted", "ModelCallCompleted", "RunCompleted"]
    events = [_event(run_id, i + 1, t) for i, t in enumerate(types)]
    for e in events[:3]:  # already projected and published before the client connects
        _store_event(stack, tenant_id, e)
        _publish(stack, e)

    got: list[runs_pb.RunEvent] = []
    caught_up = threading.Event()
    failure: list[BaseException] = []

    def collect() -> None:
        try:
            for resp in runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=1),
                                             metadata=md(key), timeout=60):
                got.append(resp.event)
                if resp.event.seq == 3:
                    caught_up.set()
        except BaseException as exc:  # surfaced in the main thread
            failure.append(exc)
            caught_up.set()

    reader = threading.Thread(target=collect)
    reader.start()
    assert caught_up.wait(30), "catch-up never delivered seq 3"
    _store_event(stack, tenant_id, events[3])
    _publish(stack, events[3])
    _store_event(stack, tenant_id, events[4])  # committed, but its live publish is lost
    _store_event(stack, tenant_id, events[5])
    _publish(stack, events[5])  # seq 6 arrives live before 5 was sent: 5 comes from the read model
    _publish(stack, events[3])  # a replayed publish of seq 4: dropped
    _store_event(stack, tenant_id, events[6])
    _publish(stack, events[6], bare=True)  # a bare notification: read from the read model
    _store_event(stack, tenant_id, events[7])
    _publish(stack, events[7])
    _store_event(stack, tenant_id, events[8])
    _publish(stack, events[8])
    reader.join(60)
    assert not reader.is_alive() and not failure, failure
    assert [e.seq for e in got] == list(range(1, 10))
    assert [e.event_type for e in got] == [f"tether.v1.{t}" for t in types]
    assert got[-1].terminal and json.loads(got[4].payload_json) == {"step": 5}

    # A client that saw up to seq 5 reconnects: it gets 6.. exactly once, and the stream ends.
    with stack.pg() as conn:
        conn.execute(sql.SQL("UPDATE {}.runs SET status = 'COMPLETED', last_seq = 9 WHERE run_id = %s").format(
            sql.Identifier(stack.settings.read_model_schema)), (run_id,))
    resumed = [r.event.seq for r in runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=6),
                                                         metadata=md(key), timeout=30)]
    assert resumed == [6, 7, 8, 9]
    assert list(runs.StreamRunEvents(runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=10),
                                     metadata=md(key), timeout=30)) == []
    trace = runs.GetRunTrace(runs_pb.GetRunTraceRequest(run_id=run_id), metadata=md(key))
    assert [t.seq for t in trace.events] == list(range(1, 10)) and trace.duration_ms == 80
    assert trace.run.status == runs_pb.RUN_STATUS_COMPLETED


def test_cancel_and_decide_produce_commands_to_the_runs_partition(stack) -> None:
    tenant_id, key = with_demo(stack)
    runs = runs_grpc.RunServiceStub(stack.channel)
    approvals = approvals_grpc.ApprovalServiceStub(stack.channel)
    run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
    partition = partition_for(tenant_id, run_id, stack.settings.partitions, 1)
    args_hash = "ab" * 32
    with stack.pg() as conn:
        conn.execute(sql.SQL("INSERT INTO {}.approvals (approval_id, tenant_id, run_id, call_id, step, tool_name, "
                             "args_json, args_hash, risk_class, reasons, status, requested_at_ms, expires_at_ms) "
                             "VALUES (%s, %s, %s, '1.0', 1, 'send_email', '{{}}', %s, 'IRREVERSIBLE', "
                             "ARRAY['IRREVERSIBLE'], 'PENDING', 1, %s)").format(
            sql.Identifier(stack.settings.read_model_schema)),
            (f"ap-{run_id}", tenant_id, run_id, args_hash, int(time.time() * 1000) + 3_600_000))
    listed = approvals.ListApprovals(approvals_pb.ListApprovalsRequest(run_id=run_id), metadata=md(key)).approvals
    assert [a.approval_id for a in listed] == [f"ap-{run_id}"] and listed[0].risk_class == \
        types_pb.RISK_CLASS_IRREVERSIBLE
    bob = admin.issue_key(stack.app.store, tenant_id, "bob", (ROLE_APPROVER,)).api_key
    with pytest.raises(grpc.RpcError) as err:
        approvals.DecideApproval(approvals_pb.DecideApprovalRequest(approval_id=f"ap-{run_id}", args_hash="cd" * 32,
                                                                    approve=True), metadata=md(bob))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION and reason(err.value) == "STALE_ARGS_HASH"
    with pytest.raises(grpc.RpcError) as err:  # alice submitted the run: she may not approve its calls
        approvals.DecideApproval(approvals_pb.DecideApprovalRequest(approval_id=f"ap-{run_id}", args_hash=args_hash,
                                                                    approve=True), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED and reason(err.value) == "SELF_APPROVAL"
    decided = approvals.DecideApproval(approvals_pb.DecideApprovalRequest(
        approval_id=f"ap-{run_id}", args_hash=args_hash, approve=True, comment="ok"), metadata=md(bob)).approval
    assert decided.status == approvals_pb.APPROVAL_STATUS_APPROVED
    runs.CancelRun(runs_pb.CancelRunRequest(run_id=run_id, reason="enough"), metadata=md(key))
    msgs = records_for(stack, run_id, partition, expect=3)
    kinds = [type(open_payload(decode_envelope(m.value()))) for m in msgs]
    assert kinds == [SubmitRun, DecideApproval, CancelRun]
    decide = open_payload(decode_envelope(msgs[1].value()))
    assert (decide.approval_id, decide.args_hash, decide.approver_id, decide.approve) == \
        (f"ap-{run_id}", args_hash, "bob", True)
    assert decide.approver_roles == ["approver"] and decide.call_id == "1.0"
    assert open_payload(decode_envelope(msgs[2].value())).reason == "enough"


def _orphan_submission(stack, tenant_id: str) -> Submission:
    """A ledger row whose command never reached Kafka (its replica died before the ack)."""
    run_id = new_run_id(1_000, uuid.uuid4().bytes[:10])
    envelope = make_envelope(CancelRun(principal_id="alice", reason="stand-in payload"), run_id=run_id,
                             tenant_id=tenant_id, event_id=derived_id(run_id, "SubmitRun"), producer="run-api",
                             recorded_at_ms=1_000)
    return stack.app.store.claim(Submission(
        tenant_id=tenant_id, request_id=f"orphan-{run_id}", request_hash="h", run_id=run_id, principal_id="alice",
        agent_id="helper", agent_version=1, goal="g", partition=partition_for(tenant_id, run_id, 3, 1),
        envelope=encode(envelope), created_at_ms=1_000))


def test_the_service_process_serves_grpc_health_and_metrics(stack, service_processes) -> None:
    s = stack.settings
    orphan = _orphan_submission(stack, tenant(stack)[0])
    grpc_port, http_port = free_port(), free_port()
    env = {
        "TETHER_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "TETHER_PG_DSN": s.pg_dsn, "TETHER_REDIS_URL": s.redis_url,
        "TETHER_PARTITIONS": str(s.partitions), "TETHER_TOPIC_PREFIX": s.topic_prefix,
        "TETHER_RUN_API_PG_SCHEMA": s.pg_schema, "TETHER_RUN_API_READ_MODEL_SCHEMA": s.read_model_schema,
        "TETHER_RUN_API_PORT": str(grpc_port), "TETHER_RUN_API_METRICS_PORT": str(http_port),
        "TETHER_RUN_API_GRPC_WORKERS": "8", "TETHER_RUN_API_REDELIVER_INTERVAL_S": "0.2",
    }
    # /readyz: /healthz answers as soon as the process is up, while it may still wait for PostgreSQL.
    proc = service_processes.start("tether_run_api", health_port=http_port, health_path="/readyz", env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="tether.v1.RunService"), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        _, key = tenant(stack)
        with pytest.raises(grpc.RpcError):
            runs_grpc.RunServiceStub(channel).GetRun(runs_pb.GetRunRequest(run_id="0" * 26), metadata=md(key),
                                                     timeout=10)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
        assert 'tether_run_api_rpcs_total{code="NOT_FOUND",method="GetRun"} 1.0' in metrics
        # The sweeper produced the orphaned submit, byte for byte as recorded.
        [msg] = records_for(stack, orphan.run_id, orphan.partition, expect=1)
        assert msg.value() == orphan.envelope
        deadline = time.monotonic() + 30
        while not stack.app.store.get(orphan.tenant_id, orphan.request_id).delivered:
            assert time.monotonic() < deadline, "the sweeper never marked the orphan delivered"
            time.sleep(0.1)
    finally:
        channel.close()
    proc.stop()
    assert proc.returncode == 0


def test_bootstrap_demo_is_repeatable_and_its_keys_work(stack, monkeypatch, tmp_path) -> None:
    from typer.testing import CliRunner

    from tether_run_api.cli import main as cli

    monkeypatch.setenv("TETHER_PG_DSN", stack.settings.pg_dsn)
    monkeypatch.setenv("TETHER_RUN_API_PG_SCHEMA", stack.settings.pg_schema)
    tenant_id = f"demo-{uuid.uuid4().hex[:8]}"
    env_file = tmp_path / "demo.env"
    first = CliRunner().invoke(cli.app, ["admin", "bootstrap-demo", "--tenant", tenant_id, "--env-file", str(env_file)])
    assert first.exit_code == 0, first.output
    keys = dict(line.split("=", 1) for line in env_file.read_text().split())
    assert set(keys) == {"TETHER_API_KEY", "TETHER_APPROVER_KEY"}
    for name in ("http_get", "kv_put", "kv_get", "send_email", "agent demo v1"):
        assert name in first.output

    again = CliRunner().invoke(cli.app, ["admin", "bootstrap-demo", "--tenant", tenant_id,
                                         "--api-key", keys["TETHER_API_KEY"],
                                         "--approver-key", keys["TETHER_APPROVER_KEY"]])
    assert again.exit_code == 0, again.output
    assert "+ " not in again.output and "export" not in again.output  # nothing new: same tools, agent, keys

    # An operator spreads the tenant; neither renaming it nor re-running the set-up undoes that.
    spread = CliRunner().invoke(cli.app, ["admin", "create-tenant", tenant_id, "--spread", "3"])
    assert spread.exit_code == 0, spread.output
    assert f"tenant {tenant_id}: spread 1 -> 3" in spread.stdout
    renamed = CliRunner().invoke(cli.app, ["--json", "admin", "create-tenant", tenant_id, "--display-name", "Demo"])
    assert renamed.exit_code == 0, renamed.output
    assert json.loads(renamed.stdout) == {"tenant_id": tenant_id, "created": False, "spread": 3,
                                          "previous_spread": 3}
    third = CliRunner().invoke(cli.app, ["admin", "bootstrap-demo", "--tenant", tenant_id,
                                         "--api-key", keys["TETHER_API_KEY"],
                                         "--approver-key", keys["TETHER_APPROVER_KEY"]])
    assert third.exit_code == 0, third.output
    assert f"tenant {tenant_id} (spread 3)" in third.output and "+ " not in third.output
    assert stack.app.store.tenant_spread(tenant_id) == 3

    user, approver = keys["TETHER_API_KEY"], keys["TETHER_APPROVER_KEY"]
    runs = runs_grpc.RunServiceStub(stack.channel)
    sub = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="demo", goal="Hello"), metadata=md(user))
    partition = partition_for(tenant_id, sub.run_id, stack.settings.partitions, 3)
    [msg] = records_for(stack, sub.run_id, partition, expect=1)
    cmd = open_payload(decode_envelope(msg.value()))
    assert [t.name for t in cmd.tools] == ["http_get", "kv_put", "kv_get", "send_email"]
    assert cmd.tenant_grants == sorted(["http_get", "kv_put", "kv_get", "send_email"])
    assert cmd.agent.model.name == "tether-scripted"
    with pytest.raises(grpc.RpcError) as err:  # the approver key cannot write the catalog
        agents_grpc.AgentServiceStub(stack.channel).CreateAgent(
            agents_pb.CreateAgentRequest(agent=agents_pb.Agent(agent_id="x")), metadata=md(approver))
    assert reason(err.value) == "MISSING_ROLE"

    # The env file it wrote is what revoke-key reads; a revoked key is not taken back by a re-run.
    revoked = CliRunner().invoke(cli.app, ["admin", "revoke-key", "--key-file", str(env_file)])
    assert revoked.exit_code == 0 and revoked.stdout.count("revoked key ") == 2, revoked.output
    rerun = CliRunner().invoke(cli.app, ["admin", "bootstrap-demo", "--tenant", tenant_id, "--api-key", user])
    assert rerun.exception.exit_code == cli.EXIT_INVALID_ARGUMENT and "was revoked" in str(rerun.exception)
    assert user not in str(rerun.exception)


def test_queries_map_the_projectors_rows(stack) -> None:
    tenant_id, key = with_demo(stack)
    runs = runs_grpc.RunServiceStub(stack.channel)
    approvals = approvals_grpc.ApprovalServiceStub(stack.channel)
    run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
    rm = sql.Identifier(stack.settings.read_model_schema)
    report = {"reason_code": "STEP_CAP", "detail": "4 steps", "steps_done": 4, "tool_calls_done": ["1.0 lookup COMPLETED"],
              "pending": ["2.0 lookup"], "usage": {"input_tokens": 10, "output_tokens": 5, "cost_usd_micros": 7},
              "last_error": None, "suggested_next_action": "raise max_steps"}
    with stack.pg() as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {}.runs (run_id, tenant_id, status, principal_id, goal, agent_id, agent_version, "
            "termination, input_tokens, output_tokens, cost_usd_micros, steps, created_at_ms, updated_at_ms, "
            "ended_at_ms, last_seq, last_hash, state) VALUES (%s, %s, 'WAITING_APPROVAL', 'alice', 'g', 'helper', "
            "1, NULL, 10, 5, 7, 2, 1000, 2000, NULL, 12, 'h', '{{}}')").format(rm), (run_id, tenant_id))
        for step in (1, 2):
            conn.execute(sql.SQL(
                "INSERT INTO {}.steps (run_id, step, tenant_id, status, input_tokens, output_tokens, "
                "cost_usd_micros, assistant_text, finish_reason, started_at_ms, ended_at_ms) "
                "VALUES (%s, %s, %s, 'TOOL_CALLS', 5, 2, 3, 'thinking', 'tool_calls', 1000, NULL)").format(rm),
                (run_id, step, tenant_id))
            for index, status in enumerate(("COMPLETED", "WAITING_APPROVAL")):
                conn.execute(sql.SQL(
                    "INSERT INTO {}.tool_calls (run_id, call_id, tenant_id, step, call_index, tool_name, args_json, "
                    "args_hash, status, approval_id) VALUES (%s, %s, %s, %s, %s, 'lookup', '{{\"q\":1}}', 'x', %s, "
                    "%s)").format(rm),
                    (run_id, f"{step}.{index}", tenant_id, step, index, status,
                     f"ap-{run_id}-{step}" if index else None))
        conn.execute(sql.SQL(
            "INSERT INTO {}.approvals (approval_id, tenant_id, run_id, call_id, step, tool_name, args_json, args_hash, "
            "risk_class, reasons, status, requested_at_ms, expires_at_ms) VALUES (%s, %s, %s, '1.1', 1, 'lookup', "
            "'{{}}', %s, 'WRITE', ARRAY['TAINTED_EGRESS'], 'WITHDRAWN', 5, 10)").format(rm),
            (f"ap-{run_id}-1", tenant_id, run_id, "ef" * 32))

    run = runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(key)).run
    assert run.status == runs_pb.RUN_STATUS_WAITING and run.steps == 2 and run.last_seq == 12
    assert (run.usage.input_tokens, run.usage.output_tokens, run.usage.cost_usd_micros) == (10, 5, 7)
    assert not run.HasField("termination") and not run.HasField("end_time")
    with stack.pg() as conn:
        conn.execute(sql.SQL("UPDATE {}.runs SET status = 'TERMINATED', termination = %s, ended_at_ms = 3000 "
                             "WHERE run_id = %s").format(rm), (json.dumps(report), run_id))
    run = runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(key)).run
    assert run.status == runs_pb.RUN_STATUS_TERMINATED and run.end_time.ToMilliseconds() == 3000
    assert run.termination.reason_code == "STEP_CAP" and list(run.termination.pending) == ["2.0 lookup"]
    assert run.termination.suggested_next_action == "raise max_steps"
    with pytest.raises(grpc.RpcError) as err:
        runs.CancelRun(runs_pb.CancelRunRequest(run_id=run_id), metadata=md(key))
    assert reason(err.value) == "RUN_ALREADY_FINISHED"

    first = runs.ListRunSteps(runs_pb.ListRunStepsRequest(run_id=run_id, page_size=1), metadata=md(key))
    assert [s.step for s in first.steps] == [1] and first.next_page_token
    second = runs.ListRunSteps(runs_pb.ListRunStepsRequest(run_id=run_id, page_size=1,
                                                           page_token=first.next_page_token), metadata=md(key))
    assert [s.step for s in second.steps] == [2] and not second.next_page_token
    calls = first.steps[0].tool_calls
    assert [(c.call_id, c.status, c.approval_id) for c in calls] == \
        [("1.0", "COMPLETED", ""), ("1.1", "WAITING_APPROVAL", f"ap-{run_id}-1")]
    assert first.steps[0].usage.cost_usd_micros == 3 and first.steps[0].assistant_text == "thinking"

    assert approvals.ListApprovals(approvals_pb.ListApprovalsRequest(run_id=run_id), metadata=md(key)).approvals == []
    withdrawn = approvals.ListApprovals(approvals_pb.ListApprovalsRequest(
        run_id=run_id, status=approvals_pb.APPROVAL_STATUS_WITHDRAWN), metadata=md(key)).approvals
    assert [(a.approval_id, list(a.reasons), a.risk_class) for a in withdrawn] == \
        [(f"ap-{run_id}-1", ["TAINTED_EGRESS"], types_pb.RISK_CLASS_WRITE)]
    bob = admin.issue_key(stack.app.store, tenant_id, "bob", (ROLE_APPROVER,)).api_key
    with pytest.raises(grpc.RpcError) as err:
        approvals.DecideApproval(approvals_pb.DecideApprovalRequest(approval_id=f"ap-{run_id}-1",
                                                                    args_hash="ef" * 32, approve=True),
                                 metadata=md(bob))
    assert reason(err.value) == "APPROVAL_NOT_PENDING"
