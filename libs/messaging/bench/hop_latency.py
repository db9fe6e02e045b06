"""Measures the floor of one loop hop: a transactional produce until a read_committed consumer has it.

Run: .venv/bin/python libs/messaging/bench/hop_latency.py [--bootstrap 127.0.0.1:9092] [--hops 40]
     [--fetch-wait-ms 500,10] [--linger 5,1000] [--offsets no,yes] [--retry-backoff-ms 100,5]
     [--gap-ms 0]

Each hop: begin a transaction, produce one 300-byte record (with `--offsets yes`, also send a
consumer offset, as the loop does), commit, and poll a read_committed consumer (assigned to the
partition) until the record arrives. A step of a run crosses six such
hops in series (docs/benchmarks.md), so six times this figure is the least a step's platform
overhead can be with one Kafka transaction per hop, whatever the services do. Prints one JSON
line per combination: commit p50 and produce → consumed p50/p90, in ms.

`--gap-ms` is the pause between hops. The loop begins its next transaction as soon as the last
one committed (0, the default); a pause of ~50 ms hides what back-to-back transactions cost: the
coordinator answers CONCURRENT_TRANSACTIONS while the last one's markers are still being written,
and librdkafka retries after `retry.backoff.ms` (100 ms by default).
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def probe(bootstrap: str, fetch_wait_ms: int, linger_ms: int, hops: int, offsets: bool, retry_backoff_ms: int,
          gap_ms: int) -> dict[str, float]:
    topic = f"hop-latency-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result()
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": topic, "isolation.level": "read_committed",
                         "enable.auto.commit": False, "fetch.wait.max.ms": fetch_wait_ms})
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": linger_ms,
                         "transactional.id": topic, "transaction.timeout.ms": 10_000,
                         "retry.backoff.ms": retry_backoff_ms})
    try:
        # A just-created topic may need a moment for its leader and the coordinator.
        deadline = time.monotonic() + 30
        while True:
            try:
                producer.init_transactions(10)
                break
            except Exception:  # noqa: BLE001 - retried until the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        consumer.assign([TopicPartition(topic, 0, 0)])
        commits, hop_ms = [], []
        for _ in range(hops):
            producer.begin_transaction()
            began = time.perf_counter()
            producer.produce(topic, value=b"x" * 300, partition=0)
            produced = time.perf_counter()
            if offsets:
                # As the loop does: the consumed input's offset commits in the same transaction.
                producer.send_offsets_to_transaction([TopicPartition(topic, 0, len(commits))],
                                                     consumer.consumer_group_metadata(), 30)
            producer.commit_transaction(30)
            commits.append((time.perf_counter() - produced) * 1000)
            while True:
                msg = consumer.poll(5)
                if msg is not None and not msg.error():
                    break
            hop_ms.append((time.perf_counter() - began) * 1000)
            time.sleep(gap_ms / 1000)
    finally:
        consumer.close()
        admin.delete_topics([topic])
    commits.sort()
    hop_ms.sort()
    return {"fetch_wait_max_ms": fetch_wait_ms, "linger_ms": linger_ms, "offsets_in_txn": offsets, "hops": hops,
            "retry_backoff_ms": retry_backoff_ms, "gap_ms": gap_ms,
            "commit_ms_p50": round(commits[hops // 2], 1), "hop_ms_p50": round(hop_ms[hops // 2], 1),
            "hop_ms_p90": round(hop_ms[int(hops * 0.9)], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--hops", type=int, default=40)
    parser.add_argument("--fetch-wait-ms", default="500,10")
    parser.add_argument("--linger", default="5,1000")
    parser.add_argument("--offsets", default="no,yes", help="also send a consumer offset in each transaction")
    parser.add_argument("--retry-backoff-ms", default="100,5")
    parser.add_argument("--gap-ms", type=int, default=0, help="pause between hops (the loop makes none)")
    args = parser.parse_args()
    for fetch_wait in (int(v) for v in args.fetch_wait_ms.split(",")):
        for linger in (int(v) for v in args.linger.split(",")):
            for offsets in (v == "yes" for v in args.offsets.split(",")):
                for backoff in (int(v) for v in args.retry_backoff_ms.split(",")):
                    print(json.dumps(probe(args.bootstrap, fetch_wait, linger, args.hops, offsets, backoff,
                                           args.gap_ms)), flush=True)


if __name__ == "__main__":
    main()
