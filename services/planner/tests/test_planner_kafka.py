"""`python -m tether_planner` on the real broker: a run's model calls across a SIGKILL, counted at the model server."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    Caps,
    Envelope,
    ModelCallCompleted,
    ModelRef,
    Remaining,
    RiskClass,
    RunAccepted,
    RunCompleted,
    StepGranted,
    ToolCallCompleted,
    ToolCallRequested,
    ToolSpec,
)
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import derived_id, headers_for, make_envelope
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics
from tether_modelserver import ModelServer, load_scenarios
from tether_testing.processes import free_port

PARTITIONS = 2
TENANT = "tenant-p"
SCENARIOS = Path(__file__).parent / "scenarios"
TOOLS = [
    ToolSpec(name="http_get", version=1, description="GET a URL",
             args_schema_json='{"type":"object","properties":{"url":{"type":"string"}},"required":["url"]}',
             risk_class=RiskClass.READ_ONLY, idempotent=True, untrusted_source=True, executor_kind="builtin")
]


class Budget:
    """Plays the sequencer: appends sealed events to the run event log and reads the planner's intake."""

    def __init__(self, bootstrap: str, topics: Topics, run_id: str) -> None:
        self.topics, self.run_id = topics, run_id
        self.partition = partition_for(TENANT, run_id, PARTITIONS)
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": f"{topics.run_intake}.reader",
             "isolation.level": "read_committed", "enable.auto.commit": False}
        )
        self.consumer.assign([TopicPartition(topics.run_intake, p, 0) for p in range(PARTITIONS)])
        self.seq = 0
        self.intake: list[Envelope] = []

    def append(self, payload: AvroRecord) -> None:
        self.seq += 1
        env = make_envelope(payload, run_id=self.run_id, tenant_id=TENANT,
                            event_id=derived_id(self.run_id, payload.AVRO_NAME, self.seq), producer="budget",
                            recorded_at_ms=int(time.time() * 1000))
        env = env.model_copy(update={"seq": self.seq, "prev_hash": "0" * 64, "hash": f"{self.seq:064x}"})
        self.producer.produce(self.topics.run_events, encode(env), self.run_id.encode(), partition=self.partition,
                              headers=headers_for(env))
        if self.producer.flush(30):
            raise RuntimeError("record not delivered")

    def wait_for(self, count: int, planner, timeout: float = 90.0) -> list[AvroRecord]:
        deadline = time.monotonic() + timeout
        while len(self.intake) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"{len(self.intake)}/{count} intake records after {timeout:.0f}s; planner log:\n"
                            + "\n".join(planner.log_text().splitlines()[-30:]))
            msg = self.consumer.poll(0.2)
            if msg is None or msg.error():
                if msg is not None and msg.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(msg.error().str())
                continue
            assert msg.partition() == self.partition
            self.intake.append(decode_envelope(msg.value()))
        return [open_payload(e) for e in self.intake]

    def drain(self, seconds: float) -> list[AvroRecord]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is not None and not msg.error():
                self.intake.append(decode_envelope(msg.value()))
        return [open_payload(e) for e in self.intake]

    def close(self) -> None:
        self.consumer.close()


def _requests_for(server: ModelServer, run_id: str, step: int) -> list[dict]:
    return [r for r in server.requests()
            if r["headers"].get("x-tether-run") == run_id and r["headers"].get("x-tether-step") == str(step)]


@pytest.mark.integration
def test_planner_process_across_a_crash_never_repeats_a_finished_model_call(
    kafka_bootstrap: str, service_processes, tmp_path: Path
) -> None:
    prefix = f"test-planner-{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    declare_topics(kafka_bootstrap, PARTITIONS, ["planner"], prefix=prefix)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    port = free_port()
    server = ModelServer(load_scenarios([SCENARIOS]), request_log=tmp_path / "model-requests.jsonl").start()
    env = {
        "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "TETHER_TOPIC_PREFIX": prefix,
        "TETHER_PARTITIONS": str(PARTITIONS),
        "TETHER_PLANNER_METRICS_PORT": str(port),
        "TETHER_PLANNER_BATCH_MAX_MS": "20",
        "TETHER_PLANNER_SESSION_TIMEOUT_MS": "6000",
        "TETHER_LLM_BASE_URL": server.base_url,
        "OPENAI_API_KEY": "sk-integration-secret-42",
    }
    budget = Budget(kafka_bootstrap, topics, run_id)
    try:
        planner = service_processes.start("tether_planner", health_port=port, env=env, health_path="/readyz",
                                          timeout=90)
        caps = Caps(max_steps=5, max_wall_clock_ms=600_000, max_tokens=100_000, max_cost_usd_micros=1_000_000)
        budget.append(RunAccepted(
            principal_id="alice", request_id="q1", goal="[t:crash] fetch and report", caps=caps, tools=TOOLS,
            agent=AgentSpec(agent_id="a", version=1, name="a", instructions="Be brief.",
                            model=ModelRef(provider="openai", name="tether-scripted"),
                            tool_allowlist=["http_get"], caps=caps),
            deadline_ms=int(time.time() * 1000) + 600_000,
        ))
        remaining = Remaining(steps=4, tokens=100_000, cost_usd_micros=1_000_000, wall_clock_ms=600_000)
        budget.append(StepGranted(step=1, remaining=remaining))
        out = budget.wait_for(2, planner)
        assert [type(p).__name__ for p in out] == ["ModelCallCompleted", "ToolCallRequested"]
        request = out[1]
        assert isinstance(request, ToolCallRequested)
        for p in out:  # the budget sequences the planner's events into the log
            budget.append(p)
        budget.append(ToolCallCompleted(step=1, call_id="1.0", idem_key=request.call.idem_key, tool_name="http_get",
                                        result_json='"<html>hello</html>"', duration_ms=3))
        budget.append(StepGranted(step=2, remaining=remaining))

        # Kill the planner while step 2's (slow) model call is in flight.
        deadline = time.monotonic() + 60
        while not _requests_for(server, run_id, 2):
            assert time.monotonic() < deadline, planner.log_text()[-3000:]
            time.sleep(0.05)
        planner.kill()
        planner.restart(timeout=90)

        out = budget.wait_for(4, planner)
        out = budget.drain(2.0)  # a duplicate emitted by mistake would arrive now
        assert [type(p).__name__ for p in out] == ["ModelCallCompleted", "ToolCallRequested", "ModelCallCompleted",
                                                   "RunCompleted"]
        final = out[3]
        assert isinstance(final, RunCompleted) and final.answer == 'done: "<html>hello</html>"'
        assert isinstance(out[2], ModelCallCompleted) and out[2].step == 2

        # Step 1 finished before the crash: its model request was never repeated. Step 2's
        # interrupted call was made again by the new incarnation (the held grant), once.
        assert len(_requests_for(server, run_id, 1)) == 1
        assert len(_requests_for(server, run_id, 2)) == 2
        assert "sk-integration-secret-42" not in planner.log_text()
    finally:
        budget.close()
        service_processes.stop_all()
        server.stop()
        names = [s.name for s in topics.specs(["planner"])]
        for future in admin.delete_topics(names, operation_timeout=30).values():
            try:
                future.result(timeout=30)
            except Exception:  # already gone
                pass
