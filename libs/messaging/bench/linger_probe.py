"""Measures what a transactional producer's `linger.ms` costs when a batch takes a while to handle.

Run: .venv/bin/python libs/messaging/bench/linger_probe.py [--bootstrap 127.0.0.1:9092] [--txns 30]
     [--records 60] [--gap-ms 1] [--linger 5,1000]

Like a loop batch under load: in each transaction, `--records` records are produced one every
`--gap-ms` (the handling time between outputs), then the transaction commits. Per linger value,
librdkafka's own statistics count the produce requests sent; the producer's CPU (this process,
all threads) and the commit latency are measured. commit_transaction sends what is queued at once
whatever the linger, so a long linger sends a batch's outputs at its commit. Prints one JSON line
per linger value.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic


def probe(bootstrap: str, topic: str, linger_ms: int, txns: int, records: int, gap_s: float) -> dict[str, float]:
    requests: dict[str, int] = {}

    def on_stats(raw: str) -> None:
        for broker in json.loads(raw)["brokers"].values():
            if broker.get("nodeid", -1) >= 0:
                requests["produce"] = broker["req"].get("Produce", 0)

    producer = Producer({
        "bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": linger_ms,
        "transactional.id": f"linger-probe-{uuid.uuid4().hex[:8]}", "transaction.timeout.ms": 10_000,
        "statistics.interval.ms": 100, "stats_cb": on_stats,
    })
    producer.init_transactions(30)
    commits = []
    cpu = time.process_time()
    for _ in range(txns):
        producer.begin_transaction()
        for i in range(records):
            producer.produce(topic, value=b"x" * 400, partition=i % 6, headers=[("tether-event-type", b"probe")])
            time.sleep(gap_s)
        began = time.perf_counter()
        producer.commit_transaction(30)
        commits.append((time.perf_counter() - began) * 1000)
    cpu = time.process_time() - cpu
    time.sleep(0.3)
    producer.poll(0.3)  # one more statistics report, after the last commit
    commits.sort()
    return {"linger_ms": linger_ms, "produce_requests_per_txn": round(requests.get("produce", 0) / txns, 1),
            "producer_cpu_ms_per_txn": round(cpu * 1000 / txns, 2), "commit_ms_p50": round(commits[len(commits) // 2], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--txns", type=int, default=30)
    parser.add_argument("--records", type=int, default=60)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--linger", default="5,1000", help="comma-separated linger.ms values")
    args = parser.parse_args()
    admin = AdminClient({"bootstrap.servers": args.bootstrap})
    topic = f"linger-probe-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, 6, 1)])[topic].result()
    try:
        for linger in (int(v) for v in args.linger.split(",")):
            print(json.dumps(probe(args.bootstrap, topic, linger, args.txns, args.records, args.gap_ms / 1000)),
                  flush=True)
    finally:
        admin.delete_topics([topic])[topic].result()


if __name__ == "__main__":
    main()
