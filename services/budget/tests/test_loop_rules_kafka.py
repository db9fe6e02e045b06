"""`python -m tether_budget` on the real broker: a run in flight across an upgrade keeps the loop rules it started with."""

from __future__ import annotations

import hashlib
import json
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from tether_budget.domain.decisions import idem_key
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    Caps,
    Envelope,
    ModelCallCompleted,
    ModelRef,
    RiskClass,
    RunAccepted,
    RunTerminated,
    StepGranted,
    SubmitRun,
    ToolCall,
    ToolCallCompleted,
    ToolCallRequested,
    ToolSpec,
    Usage,
)
from tether_messaging.admin import declare_topics
from tether_messaging.chain import verify_chain
from tether_messaging.envelopes import derived_id, headers_for, make_envelope
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics
from tether_testing.processes import free_port

PARTITIONS = 2
TENANT, RUN = "tenant-lr", "run-lr1"
MODEL = ModelRef(provider="openai", name="m")
RETRIES = ["retry in 5 min", "retry in 30 min", "retry in 10 min", "retry in 2 min", "retry in 15 min"]


def _consumer(bootstrap: str, topic: str, partitions: list[int]) -> Consumer:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}.reader-{uuid.uuid4().hex[:6]}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    return consumer


def _read_events(consumer: Consumer, count: int, service, timeout: float = 90.0) -> list[Envelope]:
    events: list[Envelope] = []
    deadline = time.monotonic() + timeout
    while len(events) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{len(events)}/{count} log events after {timeout:.0f}s; budget log:\n"
                        + "\n".join(service.log_text().splitlines()[-30:]))
        msg = consumer.poll(0.2)
        if msg is None or (msg.error() and msg.error().code() == KafkaError._PARTITION_EOF):
            continue
        if msg.error():
            raise RuntimeError(msg.error().str())
        events.append(decode_envelope(msg.value()))
    return events


def _latest_checkpoint(bootstrap: str, changelog: str, partition: int) -> bytes:
    """The run's last committed checkpoint on its changelog partition."""
    consumer = _consumer(bootstrap, changelog, [partition])
    latest: bytes | None = None
    try:
        while True:
            msg = consumer.poll(5.0)
            if msg is None:
                break
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    break
                raise RuntimeError(msg.error().str())
            if msg.key() == RUN.encode():
                latest = msg.value()
    finally:
        consumer.close()
    assert latest is not None, "no checkpoint of the run"
    return latest


@pytest.mark.integration
def test_a_run_in_flight_across_an_upgrade_keeps_the_loop_rules_its_checkpoint_was_written_under(
    kafka_bootstrap: str, service_processes
) -> None:
    prefix = f"test-loop-rules-{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    declare_topics(kafka_bootstrap, PARTITIONS, ["budget"], prefix=prefix)
    port = free_port()
    env = {"TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap, "TETHER_TOPIC_PREFIX": prefix,
           "TETHER_PARTITIONS": str(PARTITIONS), "TETHER_BUDGET_METRICS_PORT": str(port),
           "TETHER_BUDGET_BATCH_MAX_MS": "20", "TETHER_BUDGET_SESSION_TIMEOUT_MS": "6000"}
    partition = partition_for(TENANT, RUN, PARTITIONS)
    reader = _consumer(kafka_bootstrap, topics.run_events, [partition])
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})

    def send(topic: str, payload: AvroRecord, *what: object, producer_name: str) -> None:
        envelope = make_envelope(payload, run_id=RUN, tenant_id=TENANT, event_id=derived_id(RUN, *what),
                                 producer=producer_name, recorded_at_ms=int(time.time() * 1000))
        producer.produce(topic, encode(envelope), RUN.encode(), partition=partition, headers=headers_for(envelope))
        assert producer.flush(30) == 0

    try:
        budget = service_processes.start("tether_budget", health_port=port, env=env, health_path="/readyz",
                                         timeout=90)
        tools = [ToolSpec(name="job_status", version=1, description="s", args_schema_json="{}",
                          risk_class=RiskClass.READ_ONLY, idempotent=True, untrusted_source=False,
                          executor_kind="builtin")]
        caps = Caps(max_steps=10, max_wall_clock_ms=600_000, max_tokens=10_000, max_cost_usd_micros=10_000)
        send(topics.commands, SubmitRun(request_id="q1", principal_id="alice", goal="g", tools=tools, caps=caps,
                                        agent=AgentSpec(agent_id="a", version=1, name="a", instructions="i",
                                                        model=MODEL, tool_allowlist=["job_status"], caps=caps)),
             "SubmitRun", producer_name="run-api")
        events = _read_events(reader, 2, budget)
        accepted = open_payload(events[0])
        assert isinstance(accepted, RunAccepted) and accepted.loop_guard_version == 2  # a new run: the current rules

        # The run is in flight (step 1 granted) when the budget is replaced: its checkpoint is the
        # one the previous release wrote, without a rules version.
        budget.kill()
        changelog = topics.changelog("budget")
        checkpoint = json.loads(_latest_checkpoint(kafka_bootstrap, changelog, partition))
        assert checkpoint["loop"]["rules"] == 2
        del checkpoint["loop"]["rules"]
        producer.produce(changelog, json.dumps(checkpoint).encode(), RUN.encode(), partition=partition)
        assert producer.flush(30) == 0
        budget.restart(timeout=90)

        usage = Usage(input_tokens=10, output_tokens=5, cost_usd_micros=50)
        for step, answer in enumerate(RETRIES, start=1):
            args = '{"job":"j1"}'
            call = ToolCall(call_id=f"{step}.0", call_index=0, idem_key=idem_key(RUN, step, 0), tool_name="job_status",
                            args_json=args, args_hash=hashlib.sha256(args.encode()).hexdigest())
            send(topics.run_intake, ModelCallCompleted(step=step, model=MODEL, usage=usage, tool_call_count=1,
                                                       finish_reason="tool_calls", latency_ms=1),
                 "ModelCallCompleted", step, producer_name="planner")
            send(topics.run_intake, ToolCallRequested(step=step, call=call), "ToolCallRequested", call.call_id,
                 producer_name="planner")
            send(topics.run_intake, ToolCallCompleted(step=step, call_id=call.call_id, idem_key=call.idem_key,
                                                      tool_name="job_status", duration_ms=2,
                                                      result_json=json.dumps({"state": "busy", "detail": answer})),
                 "ToolCallCompleted", call.call_id, producer_name="tool-gateway")
        events += _read_events(reader, 5 * len(RETRIES), budget)

        assert verify_chain(events) == []
        payloads = [open_payload(e) for e in events]
        grants = [p for p in payloads if isinstance(p, StepGranted)]
        # Judged by v1, as when it started: the five different waits are one result, a repeat.
        assert [g.loop_warning is not None for g in grants] == [False, False, False, False, True]
        assert isinstance(payloads[-1], RunTerminated) and payloads[-1].reason_code == "LOOP_DETECTED"
        assert "R1_REPEAT" in payloads[-1].report.detail
    finally:
        reader.close()
        service_processes.stop_all()
        names = [s.name for s in topics.specs(["budget"])]
        for future in admin.delete_topics(names, operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # already gone
                pass
