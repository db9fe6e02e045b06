"""What polling an idle consumer in short slices costs: the process's CPU per poll timeout.

Run: .venv/bin/python libs/messaging/bench/poll_cpu.py [--seconds 5]

One consumer, subscribed to an empty topic of its own (the loop's consumer between records),
polls for `--seconds` with each timeout the loop uses (50 ms idle, 2 ms while work is in
flight) and a few others. Prints one JSON line: polls per second and the whole process's CPU
(user + system, librdkafka's threads included) as a share of one core.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import uuid

from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient, NewTopic

BOOTSTRAP = "127.0.0.1:9092"


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    topic = f"bench-pollcpu-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": topic, "isolation.level": "read_committed"})
    result: dict[str, dict[str, float]] = {}
    try:
        consumer.subscribe([topic])
        settle = time.monotonic() + 8  # joined and assigned, nothing to fetch
        while time.monotonic() < settle:
            consumer.poll(0.05)
        for timeout_ms in (50, 5, 2, 1):
            cpu, started, polls = _cpu_s(), time.monotonic(), 0
            while time.monotonic() - started < args.seconds:
                consumer.poll(timeout_ms / 1000)
                polls += 1
            elapsed = time.monotonic() - started
            result[f"poll_{timeout_ms}ms"] = {"polls_per_s": round(polls / elapsed),
                                              "cpu_pct_of_a_core": round(100 * (_cpu_s() - cpu) / elapsed, 1)}
    finally:
        consumer.close()
        admin.delete_topics([topic])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
