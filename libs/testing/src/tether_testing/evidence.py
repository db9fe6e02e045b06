"""Everything a running system recorded, as bytes to search for leaked secrets: every Kafka topic of its
namespace (all partitions from offset 0, aborted transactions included), every log, a pg_dump of its
schemas, its Redis keys and values, and every request the model server received."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import redis
from confluent_kafka import Consumer, KafkaError, TopicPartition

from tether_testing.system import TetherSystem


@dataclass(frozen=True)
class Evidence:
    """One place something was recorded (`where`) and its bytes."""

    where: str
    data: bytes


def kafka_evidence(bootstrap: str, prefix: str, *, timeout_s: float = 120.0) -> Iterator[Evidence]:
    """Key, value and headers of every record of every topic named `prefix*` (read_uncommitted: all bytes)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"evidence-{uuid.uuid4().hex}",
                         "isolation.level": "read_uncommitted", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    try:
        topics = sorted(t for t in consumer.list_topics(timeout=30).topics if t.startswith(prefix))
        if not topics:
            raise RuntimeError(f"no topics named {prefix}*")
        parts = [TopicPartition(t, p, 0) for t in topics
                 for p in consumer.list_topics(t, timeout=30).topics[t].partitions]
        ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=30)[1] for tp in parts}
        consumer.assign(parts)
        done = {k for k, end in ends.items() if end == 0}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics {topics} not read to their ends {ends}")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            key = (msg.topic(), msg.partition())
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    if msg.offset() >= ends[key]:
                        done.add(key)
                    continue
                raise RuntimeError(msg.error().str())
            headers = b"".join(k.encode() + b"=" + (v or b"") for k, v in (msg.headers() or []))
            yield Evidence(f"kafka {msg.topic()}[{msg.partition()}]@{msg.offset()}",
                           (msg.key() or b"") + b"\n" + (msg.value() or b"") + b"\n" + headers)
            if msg.offset() + 1 >= ends[key]:
                done.add(key)
    finally:
        consumer.close()


def log_evidence(system: TetherSystem) -> Iterator[Evidence]:
    """Every log file of the system's processes (services, sinks, model server)."""
    if not system.processes:
        raise RuntimeError("the system has no processes (not started?)")
    for name, proc in sorted(system.processes.items()):
        path = proc.log_path
        if path.is_file():
            yield Evidence(f"log {name} ({path.name})", path.read_bytes())


def postgres_evidence(pg_dsn: str, schemas: Iterable[str]) -> Iterator[Evidence]:
    """pg_dump (schema and data, plain text) of each schema."""
    for schema in schemas:
        out = subprocess.run(["pg_dump", "--dbname", pg_dsn, "--schema", schema, "--no-owner"],
                             check=True, capture_output=True, timeout=120).stdout
        yield Evidence(f"pg_dump {schema}", out)


def redis_evidence(redis_url: str, patterns: Iterable[str]) -> Iterator[Evidence]:
    """Every key matching the patterns with its value, whatever its type."""
    client = redis.Redis.from_url(redis_url)
    try:
        seen: set[bytes] = set()
        for pattern in patterns:
            for key in client.scan_iter(match=pattern, count=1000):
                if key in seen:
                    continue
                seen.add(key)
                kind = client.type(key).decode()
                if kind == "string":
                    value = client.get(key) or b""
                elif kind == "hash":
                    value = b"\n".join(k + b"=" + v for k, v in client.hgetall(key).items())
                elif kind == "list":
                    value = b"\n".join(client.lrange(key, 0, -1))
                elif kind == "set":
                    value = b"\n".join(client.smembers(key))
                elif kind == "zset":
                    value = b"\n".join(m for m, _ in client.zrange(key, 0, -1, withscores=True))
                elif kind == "stream":
                    value = b"\n".join(k + b"=" + v for _, fields in client.xrange(key) for k, v in fields.items())
                else:
                    value = b""
                yield Evidence(f"redis {key.decode(errors='replace')} ({kind})", key + b"\n" + value)
    finally:
        client.close()


def model_evidence(system: TetherSystem) -> Iterator[Evidence]:
    """The model server's request log (every request body and header it received)."""
    path = system.model_request_log
    yield Evidence(f"model request log {path.name}", path.read_bytes())


def collect(system: TetherSystem) -> list[Evidence]:
    """All of it, for a system started with TetherSystem (its namespace's topics, schemas and keys)."""
    cfg, names = system.config, system.names
    found = list(kafka_evidence(cfg.kafka_bootstrap, names.topic_prefix))
    found += log_evidence(system)
    found += postgres_evidence(cfg.pg_dsn, names.schemas)
    found += redis_evidence(cfg.redis_url, [f"*{names.namespace}*"])
    found += model_evidence(system)
    return found


def _unwrapped(data: bytes) -> bytes:
    # A value split over lines (or over JSON-escaped line breaks) is found again with the breaks removed.
    for brk in (b"\\r\\n", b"\\n", b"\r\n", b"\n", b"\\r", b"\r"):
        data = data.replace(brk, b"")
    return data


def leaks(evidence: Iterable[Evidence], needles: Mapping[str, bytes]) -> list[str]:
    """`where: needle-name` for every needle found in any evidence (as is, or with line breaks removed)."""
    hits = []
    for ev in evidence:
        flat = _unwrapped(ev.data)
        for name, needle in needles.items():
            if needle in ev.data or needle in flat:
                hits.append(f"{ev.where}: {name}")
    return hits
