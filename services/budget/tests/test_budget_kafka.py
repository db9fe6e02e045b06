"""`python -m tether_budget` on the real broker: a run sequenced across a SIGKILL keeps one intact chain."""

from __future__ import annotations

import hashlib
import time
import urllib.request
import uuid
from pathlib import Path

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
    RunCompleted,
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
TENANT, RUN = "tenant-k", "run-k1"
MODEL = ModelRef(provider="openai", name="m")


class LogReader:
    """Reads the run event log with read_committed, as every downstream service does."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": f"{topic}.reader", "isolation.level": "read_committed",
             "enable.auto.commit": False}
        )
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        self.events: list[Envelope] = []

    def wait_for(self, count: int, service, timeout: float = 90.0) -> list[Envelope]:
        deadline = time.monotonic() + timeout
        while len(self.events) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"{len(self.events)}/{count} log events after {timeout:.0f}s; budget log:\n"
                            + "\n".join(service.log_text().splitlines()[-30:]))
            msg = self.consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise RuntimeError(msg.error().str())
            self.events.append(decode_envelope(msg.value()))
        return self.events

    def drain(self, seconds: float) -> list[Envelope]:
        """Keep reading for `seconds` more and return everything read."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is not None and not msg.error():
                self.events.append(decode_envelope(msg.value()))
        return self.events

    def close(self) -> None:
        self.consumer.close()


class Sender:
    """Produces commands and intake records the way run-api, planner and tool-gateway do."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.topics = topics
        self.partition = partition_for(TENANT, RUN, PARTITIONS)

    def send(self, topic: str, payload: AvroRecord, *what: object, producer: str) -> None:
        env = make_envelope(payload, run_id=RUN, tenant_id=TENANT, event_id=derived_id(RUN, *what),
                            producer=producer, recorded_at_ms=int(time.time() * 1000))
        self.producer.produce(topic, encode(env), RUN.encode(), partition=self.partition, headers=headers_for(env))
        if self.producer.flush(30):
            raise RuntimeError("record not delivered")


def _tool_call(step: int, index: int) -> ToolCall:
    args = f'{{"q":"{step}.{index}"}}'
    return ToolCall(call_id=f"{step}.{index}", call_index=index, idem_key=idem_key(RUN, step, index),
                    tool_name="search", args_json=args, args_hash=hashlib.sha256(args.encode()).hexdigest())


@pytest.mark.integration
def test_budget_sequences_a_run_across_a_crash(kafka_bootstrap: str, service_processes, tmp_path: Path) -> None:
    prefix = f"test-budget-{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    declare_topics(kafka_bootstrap, PARTITIONS, ["budget"], prefix=prefix)
    port = free_port()
    env = {
        "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TETHER_TOPIC_PREFIX": prefix,
        "TETHER_PARTITIONS": str(PARTITIONS),
        "TETHER_BUDGET_METRICS_PORT": str(port),
        "TETHER_BUDGET_BATCH_MAX_MS": "20",
        "TETHER_BUDGET_SESSION_TIMEOUT_MS": "6000",
    }
    reader = LogReader(kafka_bootstrap, topics.run_events)
    try:
        budget = service_processes.start("tether_budget", health_port=port, env=env, health_path="/readyz",
                                         timeout=90)
        send = Sender(kafka_bootstrap, topics)
        tools = [ToolSpec(name="search", version=1, description="s", args_schema_json="{}",
                          risk_class=RiskClass.READ_ONLY, idempotent=True, untrusted_source=False,
                          executor_kind="builtin")]
        caps = Caps(max_steps=5, max_wall_clock_ms=600_000, max_tokens=10_000, max_cost_usd_micros=10_000)
        send.send(topics.commands, SubmitRun(
            request_id="q1", principal_id="alice", goal="g", tools=tools, caps=caps,
            agent=AgentSpec(agent_id="a", version=1, name="a", instructions="i", model=MODEL,
                            tool_allowlist=["search"], caps=caps)), "SubmitRun", producer="run-api")
        reader.wait_for(2, budget)

        usage = Usage(input_tokens=10, output_tokens=5, cost_usd_micros=50)
        send.send(topics.run_intake, ModelCallCompleted(step=1, model=MODEL, usage=usage, tool_call_count=2,
                                                        finish_reason="tool_calls", latency_ms=1),
                  "ModelCallCompleted", 1, producer="planner")
        for i in range(2):
            send.send(topics.run_intake, ToolCallRequested(step=1, call=_tool_call(1, i)),
                      "ToolCallRequested", f"1.{i}", producer="planner")
        reader.wait_for(7, budget)

        # A crash: the ledger must come back from the changelog, not from memory.
        budget.kill()
        budget.restart(timeout=90)

        for i in range(2):
            done = ToolCallCompleted(step=1, call_id=f"1.{i}", idem_key=idem_key(RUN, 1, i), tool_name="search",
                                     result_json='{"hits": 1}', duration_ms=2)
            send.send(topics.run_intake, done, "ToolCallCompleted", f"1.{i}", producer="tool-gateway")
        # The gateway replays its last outcome after its own restart: same event id, dropped.
        send.send(topics.run_intake, done, "ToolCallCompleted", "1.1", producer="tool-gateway")
        send.send(topics.run_intake, ModelCallCompleted(step=2, model=MODEL, usage=usage, tool_call_count=0,
                                                        finish_reason="stop", latency_ms=1),
                  "ModelCallCompleted", 2, producer="planner")
        send.send(topics.run_intake, RunCompleted(step=2, answer="a", usage=usage), "RunCompleted", producer="planner")
        reader.wait_for(12, budget)
        events = reader.drain(2.0)  # a duplicate appended by mistake would arrive now

        assert len(events) == 12
        assert verify_chain(events) == []
        assert [e.seq for e in events] == list(range(1, 13))
        assert [open_payload(e).__class__.__name__ for e in events] == [
            "RunAccepted", "StepGranted", "ModelCallCompleted",
            "ToolCallRequested", "ToolCallBudgeted", "ToolCallRequested", "ToolCallBudgeted",
            "ToolCallCompleted", "ToolCallCompleted", "StepGranted", "ModelCallCompleted", "RunCompleted",
        ]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        assert "tether_budget_steps_granted_total" in metrics
    finally:
        reader.close()
        service_processes.stop_all()
        names = [s.name for s in topics.specs(["budget"])]
        for future in admin.delete_topics(names, operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # already gone
                pass
