"""`python -m tether_approval` on the real broker: decides, refuses, expires, notifies, and after a SIGKILL
its restored state still refuses a duplicate decision."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from tether_approval.handlers import decided_event_id, refused_event_id
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    Caps,
    DecideApproval,
    ModelRef,
    RiskClass,
    RunAccepted,
    ToolSpec,
)
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import derived_id, headers_for, make_envelope
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics
from tether_testing.processes import free_port

PARTITIONS = 2
TENANT, RUN = "tenant-a", "run-a1"
ARGS_JSON = '{"to":"ceo@example.com"}'
ARGS_HASH = hashlib.sha256(ARGS_JSON.encode()).hexdigest()


class Intake:
    """Reads what the approval service produced to the run intake (read_committed, like budget)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}.reader",
                                  "isolation.level": "read_committed", "enable.auto.commit": False})
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        self.records: list[tuple[str, AvroRecord]] = []

    def poll_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is None or (msg.error() and msg.error().code() == KafkaError._PARTITION_EOF):
                continue
            if msg.error():
                raise RuntimeError(msg.error().str())
            env = decode_envelope(msg.value())
            self.records.append((env.event_id, open_payload(env)))

    def wait_for(self, count: int, service, timeout: float = 60.0) -> list[AvroRecord]:
        deadline = time.monotonic() + timeout
        while len(self.records) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"{len(self.records)}/{count} intake records after {timeout:.0f}s; service log:\n"
                            + "\n".join(service.log_text().splitlines()[-30:]))
            self.poll_for(0.5)
        return [payload for _, payload in self.records]


class Sender:
    def __init__(self, bootstrap: str) -> None:
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.partition = partition_for(TENANT, RUN, PARTITIONS)

    def send(self, topic: str, payload: AvroRecord, *what: object, producer: str,
             recorded_at_ms: int | None = None) -> None:
        env = make_envelope(payload, run_id=RUN, tenant_id=TENANT, event_id=derived_id(RUN, *what),
                            producer=producer,
                            recorded_at_ms=int(time.time() * 1000) if recorded_at_ms is None else recorded_at_ms)
        self.producer.produce(topic, encode(env), RUN.encode(), partition=self.partition, headers=headers_for(env))
        if self.producer.flush(30):
            raise RuntimeError("record not delivered")


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict]]]:
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/approvals", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def request(approval_id: str, call_id: str, expires_in_ms: int) -> ApprovalRequested:
    return ApprovalRequested(
        approval_id=approval_id, step=1, call_id=call_id, idem_key=f"idem-{call_id}", tool_name="send_email",
        args_json=ARGS_JSON, args_hash=ARGS_HASH, risk_class=RiskClass.IRREVERSIBLE, reasons=["RISK_CLASS"],
        expires_at_ms=int(time.time() * 1000) + expires_in_ms, policy_version="p1", inputs_hash="0" * 64,
    )


def decision(approval_id: str, call_id: str, approver: str, roles: list[str]) -> DecideApproval:
    return DecideApproval(approval_id=approval_id, call_id=call_id, args_hash=ARGS_HASH, approver_id=approver,
                          approver_roles=roles, approve=True)


def metric(port: int, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f"{name}{{{labels}}} "):
                return float(line.split()[-1])
    return 0.0


def accepted_run() -> RunAccepted:
    caps = Caps(max_steps=5, max_wall_clock_ms=600_000, max_tokens=10_000, max_cost_usd_micros=10_000)
    tools = [ToolSpec(name="send_email", version=1, description="s", args_schema_json="{}",
                      risk_class=RiskClass.IRREVERSIBLE, idempotent=False, untrusted_source=False,
                      executor_kind="builtin")]
    return RunAccepted(
        principal_id="alice", request_id="q1", goal="g", tools=tools, caps=caps, deadline_ms=0,
        agent=AgentSpec(agent_id="a", version=1, name="a", instructions="i",
                        model=ModelRef(provider="openai", name="m"), tool_allowlist=["send_email"], caps=caps),
    )


@pytest.mark.integration
def test_a_decision_read_after_its_approval_expired_is_refused_visibly_on_the_real_broker(
    kafka_bootstrap: str, service_processes
) -> None:
    # run-api took bob's APPROVE in time (its recorded_at_ms is before expires_at) but its record reached
    # the commands topic only after the expiry and its grace had decided EXPIRED (later than the grace allows).
    # EXPIRED stays the approval's only decision; bob's is refused DECISION_AFTER_EXPIRY, logged and
    # counted, not folded into the duplicates (APPROVAL_NOT_PENDING) as if nothing had been lost.
    prefix = f"test-approval-late-{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["approval"], prefix=prefix)
    port = free_port()
    env = {
        "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TETHER_TOPIC_PREFIX": prefix,
        "TETHER_PARTITIONS": str(PARTITIONS),
        "TETHER_APPROVAL_METRICS_PORT": str(port),
        "TETHER_APPROVAL_BATCH_MAX_MS": "20",
        "TETHER_APPROVAL_EXPIRY_GRACE_MS": "500",
    }
    intake = Intake(kafka_bootstrap, topics.run_intake)
    try:
        service = service_processes.start("tether_approval", health_port=port, env=env, health_path="/readyz",
                                          timeout=90)
        send = Sender(kafka_bootstrap)
        send.send(topics.run_events, accepted_run(), "RunAccepted", producer="budget")
        asked = request("apr_1", "1.0", 1_000)
        send.send(topics.run_events, asked, "ApprovalRequested", 1, producer="budget")
        [expired] = intake.wait_for(1, service)
        assert (expired.approval_id, expired.outcome) == ("apr_1", ApprovalOutcome.EXPIRED)

        send.send(topics.commands, decision("apr_1", "1.0", "bob", ["approver"]), "Decide", 1, producer="run-api",
                  recorded_at_ms=asked.expires_at_ms - 200)
        send.send(topics.commands, decision("apr_1", "1.0", "carol", ["approver"]), "Decide", 2, producer="run-api")
        deadline = time.monotonic() + 60
        while metric(port, "tether_approval_refusals_total", 'reason="APPROVAL_NOT_PENDING"') < 1:
            if time.monotonic() > deadline:
                pytest.fail("carol's decision was not read; service log:\n" + service.log_text()[-3000:])
            time.sleep(0.2)
        assert metric(port, "tether_approval_refusals_total", 'reason="DECISION_AFTER_EXPIRY"') == 1
        assert metric(port, "tether_approval_decisions_after_expiry_total", 'decision="approve"') == 1
        assert metric(port, "tether_approval_refusals_total", 'reason="APPROVAL_NOT_PENDING"') == 1  # carol, late
        refused = [json.loads(line) for line in service.log_text().splitlines()
                   if '"decision_refused"' in line and '"DECISION_AFTER_EXPIRY"' in line]
        assert [(r["approval_id"], r["approver_id"], r["approve"], r["recorded_at_ms"], r["expires_at_ms"])
                for r in refused] == [("apr_1", "bob", True, asked.expires_at_ms - 200, asked.expires_at_ms)]
        intake.poll_for(2)
        # EXPIRED stands; bob's decision is on the intake as the record of a decision that did not take
        # effect (budget sequences it into the run's log); carol's duplicate-like late one is not.
        bob_command = derived_id(RUN, "Decide", 1)
        assert [event_id for event_id, _ in intake.records] == [
            decided_event_id(RUN, "apr_1"), refused_event_id(RUN, bob_command)]
        refusal = intake.records[1][1]
        assert isinstance(refusal, ApprovalDecisionRefused)
        assert (refusal.approval_id, refusal.approver_id, refusal.approve, refusal.reason, refusal.decided_at_ms,
                refusal.expires_at_ms) == ("apr_1", "bob", True, "DECISION_AFTER_EXPIRY",
                                           asked.expires_at_ms - 200, asked.expires_at_ms)
    finally:
        intake.consumer.close()


@pytest.mark.integration
def test_approval_service_on_the_real_broker(kafka_bootstrap: str, service_processes, webhook) -> None:
    hook_url, received = webhook
    prefix = f"test-approval-{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["approval"], prefix=prefix)
    port = free_port()
    env = {
        "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TETHER_TOPIC_PREFIX": prefix,
        "TETHER_PARTITIONS": str(PARTITIONS),
        "TETHER_APPROVAL_METRICS_PORT": str(port),
        "TETHER_APPROVAL_BATCH_MAX_MS": "20",
        "TETHER_APPROVAL_SESSION_TIMEOUT_MS": "6000",
        "TETHER_APPROVAL_WEBHOOK_URL": hook_url,
        "TETHER_APPROVAL_EXPIRY_GRACE_MS": "500",
    }
    intake = Intake(kafka_bootstrap, topics.run_intake)
    try:
        service = service_processes.start("tether_approval", health_port=port, env=env, health_path="/readyz",
                                          timeout=90)
        send = Sender(kafka_bootstrap)
        caps = Caps(max_steps=5, max_wall_clock_ms=600_000, max_tokens=10_000, max_cost_usd_micros=10_000)
        tools = [ToolSpec(name="send_email", version=1, description="s", args_schema_json="{}",
                          risk_class=RiskClass.IRREVERSIBLE, idempotent=False, untrusted_source=False,
                          executor_kind="builtin")]
        send.send(topics.run_events, RunAccepted(
            principal_id="alice", request_id="q1", goal="g", tools=tools, caps=caps, deadline_ms=0,
            agent=AgentSpec(agent_id="a", version=1, name="a", instructions="i",
                            model=ModelRef(provider="openai", name="m"), tool_allowlist=["send_email"], caps=caps),
        ), "RunAccepted", producer="budget")
        send.send(topics.run_events, request("apr_1", "1.0", 600_000), "ApprovalRequested", 1, producer="budget")
        send.send(topics.run_events, request("apr_2", "1.1", 3_000), "ApprovalRequested", 2, producer="budget")
        send.send(topics.commands, decision("apr_2", "1.1", "bob", ["viewer"]), "Decide", 1, producer="run-api")
        send.send(topics.commands, decision("apr_1", "1.0", "bob", ["approver"]), "Decide", 2, producer="run-api")

        first, second = intake.wait_for(2, service)
        by_id = {d.approval_id: d for d in (first, second)}
        assert all(isinstance(d, ApprovalDecided) for d in by_id.values())
        assert (by_id["apr_1"].outcome, by_id["apr_1"].approver_id) == (ApprovalOutcome.APPROVED, "bob")
        assert (by_id["apr_2"].outcome, by_id["apr_2"].approver_id) == (ApprovalOutcome.EXPIRED, "system")
        assert {event_id for event_id, _ in intake.records} == {decided_event_id(RUN, "apr_1"),
                                                               decided_event_id(RUN, "apr_2")}
        assert metric(port, "tether_approval_refusals_total", 'reason="NOT_AN_APPROVER"') == 1
        deadline = time.monotonic() + 30
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(n["approval_id"] for n in received) == ["apr_1", "apr_2"]
        assert received[0]["args"] == {"to": "ceo@example.com"}

        # A crash: the state comes back from the changelog, so a duplicate decision is still refused.
        service.kill()
        service.restart(timeout=90)
        send.send(topics.commands, decision("apr_1", "1.0", "carol", ["approver"]), "Decide", 3, producer="run-api")
        send.send(topics.run_events, request("apr_3", "2.0", 600_000), "ApprovalRequested", 3, producer="budget")
        send.send(topics.commands, decision("apr_3", "2.0", "carol", ["approver"]), "Decide", 4, producer="run-api")
        records = intake.wait_for(3, service)
        assert records[2].approval_id == "apr_3"
        intake.poll_for(3)
        assert len(intake.records) == 3  # no second decision for apr_1
        assert metric(port, "tether_approval_refusals_total", 'reason="APPROVAL_NOT_PENDING"') == 1
    finally:
        intake.consumer.close()
