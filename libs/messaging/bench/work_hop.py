"""Measures how long finished work waits before the loop hands it to `on_work_done` (one work hop).

Run: .venv/bin/python libs/messaging/bench/work_hop.py [--inputs 200] [--interval-ms 150] [--work-poll-ms 50]

Runs one `ProcessorLoop` in this process on the real Kafka (a unique topic prefix) with a
processor whose every input starts one work item that sleeps a random 30-80 ms and returns the
`time.monotonic()` at which it finished; `on_work_done` records now - that. Inputs arrive one
every `--interval-ms`, so the loop has usually committed the batch that started the work and
waits for input when the work finishes: the figure is the loop's wake-up delay, not queueing.
`--work-poll-ms 50` is the loop before it polled in short slices while work was in flight.
Prints one JSON line (ms).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import encode
from tether_messaging.topics import Topics

BOOTSTRAP = "127.0.0.1:9092"
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class TimedWork:
    """Each input starts one short work item; records how long its result waited for the loop."""

    state_codec = None

    def __init__(self, topics: Topics, expected: int) -> None:
        self.name = "workhop"
        self.inputs = [topics.commands]
        self.expected = expected
        self.waits_ms: list[float] = []
        self.done = threading.Event()

    def handle(self, msg: Inbound, ctx: Context) -> None:
        sleep_s = random.uniform(0.03, 0.08)

        def work() -> float:
            time.sleep(sleep_s)
            return time.monotonic()

        run_id = msg.envelope.run_id
        ctx.start_work(f"w:{run_id}", run_id, msg.envelope.tenant_id, work)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        self.waits_ms.append((time.monotonic() - done.result) * 1000)
        if len(self.waits_ms) >= self.expected:
            self.done.set()

    def on_tick(self, ctx: TickContext) -> None:
        return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=200)
    ap.add_argument("--interval-ms", type=int, default=150)
    ap.add_argument("--work-poll-ms", type=int, default=LoopConfig.work_poll_ms)
    args = ap.parse_args()

    prefix = f"bench-workhop-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    declare_topics(BOOTSTRAP, 1, ["workhop"], prefix=prefix)
    processor = TimedWork(topics, args.inputs)
    loop = ProcessorLoop(processor, LoopConfig(bootstrap=BOOTSTRAP, topics=topics, batch_max_ms=5,
                                                work_poll_ms=args.work_poll_ms))
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 0})
    try:
        while not loop.ready:
            time.sleep(0.05)
        for n in range(args.inputs):
            env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"run-{n}", tenant_id="t",
                                event_id=f"in:{n}", producer="bench", recorded_at_ms=0)
            producer.produce(topics.commands, encode(env), env.run_id.encode(), partition=0)
            producer.poll(0)
            time.sleep(args.interval_ms / 1000)
        producer.flush(30)
        processor.done.wait(60)
    finally:
        stop.set()
        thread.join(60)
        AdminClient({"bootstrap.servers": BOOTSTRAP}).delete_topics([s.name for s in topics.specs(["workhop"])])
    waits = sorted(processor.waits_ms)
    print(json.dumps({
        "work_poll_ms": args.work_poll_ms,
        "work_items": len(waits),
        "wait_ms_mean": round(statistics.fmean(waits), 2),
        "wait_ms_p50": round(waits[len(waits) // 2], 2),
        "wait_ms_p99": round(waits[min(len(waits) - 1, int(len(waits) * 0.99))], 2),
    }))


if __name__ == "__main__":
    main()
