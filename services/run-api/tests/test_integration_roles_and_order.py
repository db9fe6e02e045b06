"""On the real stack: what an approver-only key may read, and a cancel never overtaking its run's submit."""

from __future__ import annotations

import json
import time
import uuid

import grpc
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
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
from tether_contracts.records import CancelRun, SubmitRun
from tether_messaging.serde import decode_envelope, open_payload
from tether_run_api import admin
from tether_run_api.adapters.kafka import KafkaCommandPublisher
from tether_run_api.api.status import error_info
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_APPROVER, ROLE_MEMBER

pytestmark = pytest.mark.integration


def md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def reason(err: grpc.RpcError) -> str:
    info, _ = error_info(err)
    return info.reason if info else ""


def with_agent(stack) -> tuple[str, str]:
    """A fresh tenant whose admin key (alice) has an agent 'helper' with one granted tool."""
    tenant_id = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(stack.app.store, tenant_id, spread=1)
    key = admin.issue_key(stack.app.store, tenant_id, "alice", (ROLE_ADMIN, ROLE_MEMBER)).api_key
    tools_grpc.ToolServiceStub(stack.channel).RegisterTool(tools_pb.RegisterToolRequest(tool=tools_pb.Tool(
        name="lookup", description="Look something up.",
        args_schema_json=json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}),
        risk_class=types_pb.RISK_CLASS_READ_ONLY, executor_kind="builtin", idempotent=True,
        executor_config_json='{"builtin": "kv_get"}')), metadata=md(key))
    admin.grant_tools(stack.app.store, tenant_id, "*", ["lookup"])
    agents_grpc.AgentServiceStub(stack.channel).CreateAgent(agents_pb.CreateAgentRequest(agent=agents_pb.Agent(
        agent_id="helper", display_name="Helper", instructions="Help.",
        model=types_pb.ModelRef(provider="openai", name="tether-scripted"), tool_allowlist=["lookup"],
        caps=types_pb.Caps(max_steps=4, max_wall_clock_ms=60_000, max_tokens=5_000, max_cost_usd_micros=10_000),
    )), metadata=md(key))
    return tenant_id, key


def pending_approval(stack, tenant_id: str, run_id: str, args_hash: str) -> str:
    approval_id = f"ap-{run_id}"
    with stack.pg() as conn:
        conn.execute(sql.SQL("INSERT INTO {}.approvals (approval_id, tenant_id, run_id, call_id, step, tool_name, "
                             "args_json, args_hash, risk_class, reasons, status, requested_at_ms, expires_at_ms) "
                             "VALUES (%s, %s, %s, '1.0', 1, 'send_email', '{{}}', %s, 'IRREVERSIBLE', "
                             "ARRAY['IRREVERSIBLE'], 'PENDING', 1, %s)").format(
            sql.Identifier(stack.settings.read_model_schema)),
            (approval_id, tenant_id, run_id, args_hash, int(time.time() * 1000) + 3_600_000))
    return approval_id


def run_records(stack, run_id: str, expect: int, timeout_s: float = 30.0) -> list:
    """Every record keyed run_id on the commands topic, per partition in offset order (waits for `expect`)."""
    consumer = Consumer({"bootstrap.servers": stack.settings.kafka_bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    topic = stack.settings.topic_prefix + "tether.commands.v1"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            found = []
            for partition in range(stack.settings.partitions):
                _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
                consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
                position = 0
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


def test_an_approver_only_key_reads_and_decides_its_tenants_approvals(stack) -> None:
    tenant_id, key = with_agent(stack)
    runs = runs_grpc.RunServiceStub(stack.channel)
    approvals = approvals_grpc.ApprovalServiceStub(stack.channel)
    run_id = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g"), metadata=md(key)).run_id
    approval_id = pending_approval(stack, tenant_id, run_id, "ab" * 32)
    bob = admin.issue_key(stack.app.store, tenant_id, "bob", (ROLE_APPROVER,)).api_key

    # What `tether approvals list` and `approve` do: list, read the one approval, then decide it.
    listed = approvals.ListApprovals(approvals_pb.ListApprovalsRequest(run_id=run_id), metadata=md(bob)).approvals
    assert [a.approval_id for a in listed] == [approval_id]
    shown = approvals.GetApproval(approvals_pb.GetApprovalRequest(approval_id=approval_id), metadata=md(bob)).approval
    assert shown.args_hash == "ab" * 32
    decided = approvals.DecideApproval(approvals_pb.DecideApprovalRequest(
        approval_id=approval_id, args_hash=shown.args_hash, approve=True), metadata=md(bob)).approval
    assert decided.status == approvals_pb.APPROVAL_STATUS_APPROVED

    # Tenant-scoped as for members: another tenant's approver sees nothing of it.
    other_tenant = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(stack.app.store, other_tenant, spread=1)
    eve = admin.issue_key(stack.app.store, other_tenant, "eve", (ROLE_APPROVER,)).api_key
    with pytest.raises(grpc.RpcError) as err:
        approvals.GetApproval(approvals_pb.GetApprovalRequest(approval_id=approval_id), metadata=md(eve))
    assert err.value.code() is grpc.StatusCode.NOT_FOUND and reason(err.value) == "APPROVAL_NOT_FOUND"
    assert not approvals.ListApprovals(approvals_pb.ListApprovalsRequest(), metadata=md(eve)).approvals

    # The approver role reads approvals only, not runs.
    with pytest.raises(grpc.RpcError) as err:
        runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(bob))
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED and reason(err.value) == "MISSING_ROLE"


def test_a_cancel_of_a_run_whose_submit_kafka_never_acknowledged_follows_that_submit(stack) -> None:
    tenant_id, key = with_agent(stack)
    runs = runs_grpc.RunServiceStub(stack.channel)
    services = stack.app.services
    live = services.publisher
    # A Kafka outage: a real producer whose broker does not answer.
    services.publisher = KafkaCommandPublisher("127.0.0.1:1", live.topic, delivery_timeout_ms=1000)
    try:
        with pytest.raises(grpc.RpcError) as err:
            runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="helper", goal="g", request_id="r-outage"),
                           metadata=md(key))
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE and reason(err.value) == "COMMAND_NOT_DELIVERED"
    finally:
        services.publisher.close(timeout_s=0)
        services.publisher = live
    submission = stack.app.store.get(tenant_id, "r-outage")
    assert submission is not None and not submission.delivered
    run_id = submission.run_id
    shown = runs.GetRun(runs_pb.GetRunRequest(run_id=run_id), metadata=md(key)).run
    assert shown.status == runs_pb.RUN_STATUS_PENDING

    # Kafka is back; the cancel comes before the sweeper's redelivery.
    runs.CancelRun(runs_pb.CancelRunRequest(run_id=run_id, reason="never mind"), metadata=md(key))
    msgs = run_records(stack, run_id, expect=2)
    assert {m.partition() for m in msgs} == {submission.partition}
    kinds = [type(open_payload(decode_envelope(m.value()))) for m in msgs]
    assert kinds == [SubmitRun, CancelRun]  # without the fix: [CancelRun], the submit left to the sweeper
    assert decode_envelope(msgs[0].value()).event_id == decode_envelope(submission.envelope).event_id
    assert stack.app.store.get(tenant_id, "r-outage").delivered  # the sweeper will not produce it again
