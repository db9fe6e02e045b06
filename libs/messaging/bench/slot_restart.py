"""Measures how soon a SIGKILLed loop slot handles input again after a restart, with and without static membership.

Run: .venv/bin/python libs/messaging/bench/slot_restart.py [--rounds 3] [--session-timeout-ms 10000]

Two slots (0 and 1) of the exactly-once test processor (`libs/messaging/tests/eos_processor.py`)
run as processes in one consumer group on 4 partitions, while a producer sends one input per
partition every 100 ms. Each round SIGKILLs slot 0, starts it again at once (same slot) and
measures, from the kill: `ready_s` (the new process serves /readyz) and `resumed_s` (every
partition has a committed output recorded after the kill: the whole group handles input again).
First with dynamic membership (the loop before: a restarted slot is a new member, and the group
waits for the dead one's session to expire), then with static membership (`group.instance.id`
= the slot). Prints one JSON line (seconds).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.serde import decode_envelope, encode
from tether_messaging.topics import Topics
from tether_testing.processes import ServiceProcess, free_port

BOOTSTRAP = "127.0.0.1:9092"
PARTITIONS = 4
TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Feed:
    """One input per partition every 100 ms (run `p<partition>`, numbered inputs)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.stop = threading.Event()
        self.producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 5})
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self.stop.wait(0.1):
            n += 1
            for p in range(PARTITIONS):
                env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"p{p}", tenant_id="t",
                                    event_id=f"in:p{p}:{n}", producer="bench", recorded_at_ms=0)
                self.producer.produce(self.topic, encode(env), env.run_id.encode(), partition=p)
            self.producer.poll(0)
        self.producer.flush(30)


class Outputs:
    """Latest committed output time (recorded_at_ms) per partition, read in a background thread."""

    def __init__(self, topic: str) -> None:
        self.latest: dict[int, int] = {}
        self.stop = threading.Event()
        self.consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"{topic}.bench",
                                  "isolation.level": "read_committed", "enable.auto.commit": False})
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            msg = self.consumer.poll(0.1)
            if msg is not None and not msg.error():
                self.latest[msg.partition()] = decode_envelope(msg.value()).recorded_at_ms
        self.consumer.close()

    def resumed_after(self, kill_ms: int) -> bool:
        return len(self.latest) == PARTITIONS and all(t >= kill_ms for t in self.latest.values())


def measure(static: bool, rounds: int, session_timeout_ms: int, logs: Path) -> dict[str, list[float]]:
    prefix = f"bench-restart-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    declare_topics(BOOTSTRAP, PARTITIONS, ["eos"], prefix=prefix)
    env = {
        "TETHER_KAFKA_BOOTSTRAP": BOOTSTRAP,
        "TETHER_TOPIC_PREFIX": prefix,
        "TETHER_PARTITIONS": str(PARTITIONS),
        "TETHER_EOS_SESSION_TIMEOUT_MS": str(session_timeout_ms),
        "TETHER_EOS_BATCH_MAX_MS": "20",
        "TETHER_EOS_STATIC_MEMBERSHIP": "true" if static else "false",
    }
    slots = {}
    for slot in (0, 1):
        port = free_port()
        slots[slot] = ServiceProcess(
            "eos_processor", health_port=port, health_path="/readyz", log_dir=logs, cwd=TESTS_DIR,
            name=f"{'static' if static else 'dynamic'}-slot{slot}",
            env={**env, "TETHER_EOS_INSTANCE_ID": str(slot), "TETHER_EOS_METRICS_PORT": str(port)},
        )
    feed, outputs = Feed(topics.commands), Outputs(topics.run_events)
    figures: dict[str, list[float]] = {"ready_s": [], "resumed_s": []}
    try:
        for proc in slots.values():
            proc.start(timeout=180)
        feed.thread.start()
        outputs.thread.start()
        for _ in range(rounds):
            settle = time.time() * 1000
            deadline = time.monotonic() + 120
            while not outputs.resumed_after(int(settle)) and time.monotonic() < deadline:
                time.sleep(0.1)  # both slots handle input before the kill
            time.sleep(2)
            kill_ms = int(time.time() * 1000)
            started = time.monotonic()
            slots[0].kill(signal.SIGKILL)
            slots[0].start(timeout=180)
            figures["ready_s"].append(round(time.monotonic() - started, 2))
            deadline = time.monotonic() + 120
            while not outputs.resumed_after(kill_ms) and time.monotonic() < deadline:
                time.sleep(0.05)
            figures["resumed_s"].append(round(time.monotonic() - started, 2))
    finally:
        feed.stop.set()
        outputs.stop.set()
        for proc in slots.values():
            proc.stop()
        feed.thread.join(30)
        outputs.thread.join(30)
        AdminClient({"bootstrap.servers": BOOTSTRAP}).delete_topics([s.name for s in topics.specs(["eos"])])
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--session-timeout-ms", type=int, default=10_000)
    args = ap.parse_args()
    result: dict[str, object] = {"session_timeout_ms": args.session_timeout_ms, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="slot-restart-") as logs:
        for mode, static in (("dynamic", False), ("static", True)):
            figures = measure(static, args.rounds, args.session_timeout_ms, Path(logs))
            for name, values in figures.items():
                result[f"{mode}_{name}"] = values
                result[f"{mode}_{name}_median"] = round(statistics.median(values), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
