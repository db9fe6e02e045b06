"""A SIGKILLed slot restarted at once gets its partitions back as a static member: the other slot never rebalances."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import REGISTRY

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics
from tether_testing.processes import ServiceProcess, free_port

TESTS_DIR = Path(__file__).resolve().parent
# The exactly-once checker of the kill tests: slot 0 runs it as a process, slot 1 in this one.
_spec = importlib.util.spec_from_file_location("eos_processor", TESTS_DIR / "eos_processor.py")
eos_processor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eos_processor)
PARTITIONS = 4
INPUTS_PER_ROUND = 10
#: Far longer than a restart takes even on a starved machine: the restarted slot always
#: rejoins before the coordinator would give up on it.
SESSION_TIMEOUT_MS = 45_000
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


def _restores() -> float:
    """Partition assignments this process's loops restored (one per rebalance that assigns)."""
    return REGISTRY.get_sample_value("tether_loop_restore_seconds_count", {"service": "eos"}) or 0.0


def _events(proc: ServiceProcess, name: str) -> list[dict]:
    """The processor's JSON log lines with event `name`, in order, over every incarnation."""
    out = []
    for line in proc.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == name:
            out.append(entry)
    return out


def _produce_round(producer: Producer, topic: str, first: int) -> dict[str, list[str]]:
    """INPUTS_PER_ROUND numbered inputs for each run `p<partition>`, starting at input `first`."""
    sent: dict[str, list[str]] = defaultdict(list)
    for n in range(first, first + INPUTS_PER_ROUND):
        for p in range(PARTITIONS):
            env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"p{p}", tenant_id="t",
                                event_id=f"in:p{p}:{n}", producer="test", recorded_at_ms=0)
            producer.produce(topic, encode(env), env.run_id.encode(), partition=p)
            sent[env.run_id].append(env.event_id)
    assert producer.flush(30) == 0
    return sent


def _read(reader: Consumer, outputs: list, count: int, linger_s: float = 0.0) -> None:
    """Read until `count` outputs are in, then `linger_s` longer (a duplicate would show up)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(outputs) >= count:
            deadline, count = min(deadline, time.monotonic() + linger_s), float("inf")
        msg = reader.poll(0.2)
        if msg is not None and not msg.error():
            outputs.append((msg.partition(), msg.offset(), decode_envelope(msg.value())))


@pytest.mark.integration
def test_a_restarted_slot_takes_its_partitions_back_without_a_rebalance(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["eos"], prefix=topic_prefix)
    port = free_port()
    slot0 = ServiceProcess(
        "eos_processor", health_port=port, health_path="/readyz", log_dir=tmp_path, cwd=TESTS_DIR, name="slot0",
        env={
            "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "TETHER_TOPIC_PREFIX": topic_prefix,
            "TETHER_PARTITIONS": str(PARTITIONS),
            "TETHER_EOS_BATCH_MAX_MS": "20",
            "TETHER_EOS_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
            # As a StatefulSet sets it: an explicit slot makes the member static.
            "TETHER_EOS_INSTANCE_ID": "0",
            "TETHER_EOS_METRICS_PORT": str(port),
        },
    )
    slot1 = ProcessorLoop(
        eos_processor.EosProcessor(topics, work_sleep_ms=20),
        LoopConfig(bootstrap=kafka_bootstrap, topics=topics, instance_id=1, static_membership=True,
                   session_timeout_ms=SESSION_TIMEOUT_MS, batch_max_ms=20),
    )
    stop_slot1 = threading.Event()
    slot1_errors: list[BaseException] = []

    def run_slot1() -> None:
        try:
            slot1.run(stop_slot1)
        except BaseException as exc:  # surfaced below
            slot1_errors.append(exc)

    slot1_thread = threading.Thread(target=run_slot1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
    outputs: list = []
    try:
        slot1_thread.start()
        slot0.start(timeout=180)
        expected = _produce_round(producer, topics.commands, 1)
        _read(reader, outputs, PARTITIONS * INPUTS_PER_ROUND)  # both slots own and handle partitions

        owned_before = _events(slot0, "partitions_assigned")[-1]["partitions"]
        restores_of_slot1 = _restores()
        slot0.kill()
        slot0.start(timeout=180)
        for run, ids in _produce_round(producer, topics.commands, 1 + INPUTS_PER_ROUND).items():
            expected[run] += ids
        _read(reader, outputs, 2 * PARTITIONS * INPUTS_PER_ROUND, linger_s=1.0)
        restores_of_slot1_after = _restores()
        owned_after = _events(slot0, "partitions_assigned")[-1]["partitions"]
    finally:
        slot0.stop()
        stop_slot1.set()
        slot1_thread.join(60)
        reader.close()
    assert not slot1_errors, slot1_errors

    restarted = slot0.log_text().split("--- start #2")[1]
    assert '"group_instance_id"' in restarted and f"{topic_prefix}eos-0" in restarted
    assert owned_after == owned_before, (
        "the restarted slot did not get its own partitions back"
    )
    assert restores_of_slot1_after == restores_of_slot1, (
        "the other slot was rebalanced by the restart (a dynamic member would be)"
    )
    assert len(outputs) == 2 * PARTITIONS * INPUTS_PER_ROUND
    per_run: dict[str, list[tuple[int, str | None]]] = defaultdict(list)
    for _p, _o, env in sorted(outputs, key=lambda o: (o[0], o[1])):
        per_run[env.run_id].append((open_payload(env).step, env.causation_id))
    for run, outs in per_run.items():
        assert [step for step, _ in outs] == list(range(1, 2 * INPUTS_PER_ROUND + 1)), f"{run}: {outs}"
        assert [cause for _, cause in outs] == expected[run], f"{run}: not one output per input in order"


def test_only_an_explicitly_set_slot_makes_the_loop_a_static_member(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deployment replicas leave the instance id at its default and share it: they must stay dynamic.
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "p.")
    monkeypatch.delenv("TETHER_EOS_INSTANCE_ID", raising=False)
    assert not LoopConfig.from_settings(eos_processor.EosSettings()).static_membership
    monkeypatch.setenv("TETHER_EOS_INSTANCE_ID", "3")
    config = LoopConfig.from_settings(eos_processor.EosSettings())
    assert config.static_membership
    stateless = eos_processor.EosProcessor(config.topics, work_sleep_ms=0)
    stateless.state_codec = None  # no state store: nothing to open or clean up
    loop = ProcessorLoop(stateless, config)
    assert loop.group_instance_id == loop.transactional_id == "p.eos-3"
    assert loop._consumer_config()["group.instance.id"] == "p.eos-3"


def _producer_conf(config: LoopConfig) -> dict:
    stateless = eos_processor.EosProcessor(config.topics, work_sleep_ms=0)
    stateless.state_codec = None  # no state store: nothing to open or clean up
    return ProcessorLoop(stateless, config)._producer_config()


def test_the_loop_producer_retries_after_a_short_backoff_a_service_can_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # Back-to-back transactions meet CONCURRENT_TRANSACTIONS while the last one's markers are
    # written; each retry waits retry.backoff.ms (librdkafka: 100 ms). Measured, not asserted
    # here: libs/messaging/bench/hop_latency.py, docs/benchmarks.md.
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "p.")
    monkeypatch.delenv("TETHER_EOS_KAFKA_RETRY_BACKOFF_MS", raising=False)
    default = _producer_conf(LoopConfig.from_settings(eos_processor.EosSettings()))
    assert default["retry.backoff.ms"] == 5 and "transactional.id" in default
    monkeypatch.setenv("TETHER_EOS_KAFKA_RETRY_BACKOFF_MS", "20")
    assert _producer_conf(LoopConfig.from_settings(eos_processor.EosSettings()))["retry.backoff.ms"] == 20
    # An explicit librdkafka override still wins.
    config = LoopConfig.from_settings(eos_processor.EosSettings(), producer_overrides={"retry.backoff.ms": 50})
    assert _producer_conf(config)["retry.backoff.ms"] == 50
