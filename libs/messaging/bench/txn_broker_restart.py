"""Which transactional call hangs after a Kafka broker restart, and for how long.

Run against a PRIVATE broker (the probe stops and starts it), e.g.:

    export TETHER_STATE_DIR=/tmp/tether-hang TETHER_KAFKA_PORT=18092 TETHER_KAFKA_CONTROLLER_PORT=18093 \\
           TETHER_PG_PORT=18432 TETHER_REDIS_PORT=18379
    python3 deploy/local/stack.py up kafka
    .venv/bin/python libs/messaging/bench/txn_broker_restart.py --rounds 3 2> /tmp/tether-hang/probe-debug.log

A consume-transform-produce loop with the loop's producer and consumer settings
(`tether_messaging.loop`: read_committed, range assignment, linger 1 s, transaction.timeout.ms
10 s, retry.backoff.ms 5, 30 s call timeouts) copies a steady input (4 partitions, 20 records/s
each) to an output topic, one transaction per batch, while the main thread restarts the broker
`--rounds` times the way `make chaos` does (`deploy/local/stack.py down kafka`, 1-5 s away, `up
kafka`). Every begin / send_offsets_to_transaction / commit_transaction / abort_transaction is
timed; a call still running `--report-s` after it began is reported (its timeout is 30 s) and
waited for up to `--hang-cap-s`. Prints one JSON line per round: when the broker was back, when the
loop committed again (`back_to_commit_s`), and the slowest call of the round with its outcome.

`--debug` sets the producer's librdkafka debug contexts; its log goes to stderr with
librdkafka's own timestamps (redirect it to a file). `--producer-conf KEY=VALUE` (repeatable)
adds or overrides a producer setting, e.g. `metadata.recovery.strategy=none`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

REPO = Path(__file__).resolve().parents[3]
STACK = REPO / "deploy" / "local" / "stack.py"
PARTITIONS = 4
#: Ports of stacks this probe must never stop: the dev stack, CI's, chaos runs'.
FORBIDDEN_PORTS = {9092, 17092, 29092}


@dataclass
class CallRecord:
    name: str
    started: float  # time.time()
    seconds: float | None = None
    outcome: str = "running"


@dataclass
class LoopStats:
    calls: list[CallRecord] = field(default_factory=list)
    commits: list[float] = field(default_factory=list)  # time.time() of each committed batch
    current: CallRecord | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def stack(command: str) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, str(STACK), command, "kafka"], check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


class TxnLoop:
    """The loop's exactly-once cycle, reduced to copying records: consume, produce, send offsets, commit."""

    def __init__(self, bootstrap: str, inputs: str, outputs: str, debug: str, extra: dict[str, str]) -> None:
        self.bootstrap, self.inputs, self.outputs = bootstrap, inputs, outputs
        self.stats = LoopStats()
        self.stop = threading.Event()
        group = f"{inputs}.loop"
        self.consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": group, "isolation.level": "read_committed",
            "enable.auto.commit": False, "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "range", "session.timeout.ms": 10_000,
            "queued.max.messages.kbytes": 2048, "heartbeat.interval.ms": 2000,
        })
        self.producer_conf = {
            "bootstrap.servers": bootstrap, "enable.idempotence": True, "partitioner": "murmur2_random",
            "linger.ms": 1000, "transactional.id": f"{inputs}.loop-0", "transaction.timeout.ms": 10_000,
            "retry.backoff.ms": 5, **({"debug": debug} if debug else {}),
            "error_cb": lambda err: print(f"# producer error_cb {err}", file=sys.stderr, flush=True),
            **extra,
        }
        self.producer = Producer(self.producer_conf)
        self.thread = threading.Thread(target=self._run, name="txn-loop", daemon=True)

    def call(self, name: str, fn):
        rec = CallRecord(name, time.time())
        with self.stats.lock:
            self.stats.calls.append(rec)
            self.stats.current = rec
        t0 = time.monotonic()
        try:
            result = fn()
            rec.outcome = "ok"
            return result
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            rec.outcome = f"{err.name()} retriable={err.retriable()} abort={err.txn_requires_abort()} fatal={err.fatal()}"
            raise
        finally:
            rec.seconds = time.monotonic() - t0
            with self.stats.lock:
                self.stats.current = None

    def _retrying(self, name: str, fn) -> None:
        """The loop's `_call`: retriable errors are retried, abortable and fatal ones raised."""
        while True:
            try:
                return self.call(name, fn)
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal() or err.txn_requires_abort() or not err.retriable():
                    raise
                time.sleep(0.1)

    def _run(self) -> None:
        self._retrying("init_transactions", lambda: self.producer.init_transactions(30))
        self.consumer.subscribe([self.inputs])
        while not self.stop.is_set():
            msgs = [m for m in self.consumer.consume(500, timeout=0.2) if not m.error()]
            if not msgs:
                continue
            first: dict[int, int] = {}
            last: dict[int, int] = {}
            for m in msgs:
                first.setdefault(m.partition(), m.offset())
                last[m.partition()] = m.offset()
            try:
                self._retrying("begin_transaction", self.producer.begin_transaction)
                for m in msgs:
                    self.producer.produce(self.outputs, m.value(), m.key(), partition=m.partition())
                offsets = [TopicPartition(self.inputs, p, o + 1) for p, o in last.items()]
                meta = self.consumer.consumer_group_metadata()
                self._retrying("send_offsets_to_transaction",
                               lambda o=offsets, m=meta: self.producer.send_offsets_to_transaction(o, m, 30))
                self._retrying("commit_transaction", lambda: self.producer.commit_transaction(30))
                self.stats.commits.append(time.time())
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal():
                    # The probe is about hangs: a fatal error replaces the producer (init fences, aborts).
                    self.producer = Producer(self.producer_conf)
                    self._retrying("init_transactions", lambda: self.producer.init_transactions(30))
                else:
                    while True:
                        try:
                            self.call("abort_transaction", lambda: self.producer.abort_transaction(30))
                            break
                        except KafkaException as abort_exc:
                            abort_err = abort_exc.args[0]
                            if abort_err.fatal() and abort_err.code() == KafkaError.INVALID_TXN_STATE:
                                # As the loop does (librdkafka#4849): a new producer's init aborts it.
                                self.producer = Producer(self.producer_conf)
                                self._retrying("init_transactions", lambda: self.producer.init_transactions(30))
                                break
                            if not abort_err.retriable():
                                raise
                            time.sleep(0.5)
                for p, o in first.items():
                    self.consumer.seek(TopicPartition(self.inputs, p, o))


def feed(bootstrap: str, topic: str, stop: threading.Event) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    n = 0
    while not stop.wait(0.05):
        n += 1
        for p in range(PARTITIONS):
            try:
                producer.produce(topic, f"{n}".encode(), f"k{p}".encode(), partition=p)
            except BufferError:
                pass  # broker away long enough to fill the queue: skip, the loop only needs input
        producer.poll(0)
    producer.flush(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--debug", default="eos,broker,cgrp,metadata")
    ap.add_argument("--report-s", type=float, default=35.0, help="report a call running this long (timeout 30 s)")
    ap.add_argument("--hang-cap-s", type=float, default=240.0, help="give up on a call running this long")
    ap.add_argument("--settle-s", type=float, default=20.0, help="how long after a commit to wait before a restart")
    ap.add_argument("--producer-conf", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()

    port = int(os.environ.get("TETHER_KAFKA_PORT") or 0)
    if not port or port in FORBIDDEN_PORTS or not os.environ.get("TETHER_STATE_DIR"):
        sys.exit("set TETHER_STATE_DIR and TETHER_KAFKA_PORT (not 9092/17092/29092): the probe restarts that broker")
    bootstrap = f"127.0.0.1:{port}"
    rng = random.Random(args.seed)
    name = f"txn-restart-{uuid.uuid4().hex[:8]}"
    inputs, outputs = f"{name}.in", f"{name}.out"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in (inputs, outputs)]).values():
        fut.result(30)

    stop_feed = threading.Event()
    threading.Thread(target=feed, args=(bootstrap, inputs, stop_feed), daemon=True).start()
    extra = dict(kv.split("=", 1) for kv in args.producer_conf)
    loop = TxnLoop(bootstrap, inputs, outputs, args.debug, extra)
    loop.thread.start()

    def wait_commit_after(t: float, cap: float) -> float | None:
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline:
            after = [c for c in loop.stats.commits if c > t]
            if after:
                return after[0]
            cur = loop.stats.current
            if cur is not None and time.time() - cur.started > args.hang_cap_s:
                return None
            time.sleep(0.05)
        return None

    if wait_commit_after(0, 120) is None:
        sys.exit("the loop never committed")
    for rnd in range(1, args.rounds + 1):
        time.sleep(args.settle_s)
        n_calls = len(loop.stats.calls)
        down_at = time.time()
        print(f"# round {rnd}: broker down at {down_at:.3f}", file=sys.stderr, flush=True)
        stack("down")
        time.sleep(rng.uniform(1.0, 5.0))
        stack("up")
        back_at = time.time()
        print(f"# round {rnd}: broker back at {back_at:.3f}", file=sys.stderr, flush=True)
        reported = False
        deadline = time.monotonic() + args.hang_cap_s + 60
        committed = None
        while time.monotonic() < deadline:
            after = [c for c in loop.stats.commits if c > back_at]
            if after:
                committed = after[0]
                break
            cur = loop.stats.current
            if cur is not None and not reported and time.time() - cur.started > args.report_s:
                reported = True
                print(f"# round {rnd}: {cur.name} running {time.time() - cur.started:.1f}s", file=sys.stderr, flush=True)
            if cur is not None and time.time() - cur.started > args.hang_cap_s:
                break
            time.sleep(0.05)
        calls = loop.stats.calls[n_calls:]
        slowest = max(calls, key=lambda c: c.seconds if c.seconds is not None else time.time() - c.started,
                      default=None)
        over = [{"call": c.name, "s": round(c.seconds if c.seconds is not None else time.time() - c.started, 1),
                 "outcome": c.outcome, "started_after_back_s": round(c.started - back_at, 1)}
                for c in calls if (c.seconds if c.seconds is not None else time.time() - c.started) > 5]
        print(json.dumps({
            "round": rnd, "producer_conf": extra, "down_s": round(back_at - down_at, 1),
            "back_to_commit_s": round(committed - back_at, 1) if committed else None,
            "slowest": slowest and slowest.name, "calls_over_5s": over,
        }), flush=True)
        if committed is None:
            print("# the loop is stuck: giving up", file=sys.stderr, flush=True)
            break
    loop.stop.set()
    stop_feed.set()
    if loop.stats.current is None:
        loop.thread.join(10)
        admin.delete_topics([inputs, outputs])
    os._exit(0)  # a hung librdkafka call holds its thread: do not wait for it


if __name__ == "__main__":
    main()
