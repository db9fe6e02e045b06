"""A live reader of the run event log (read_committed, every partition): what the load generator sees of each run."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from tether_bench.common import (
    APPROVAL_REQUESTED,
    MODEL_CALL_COMPLETED,
    TERMINAL_TYPES,
    TOOL_CALL_COMPLETED,
    TOOL_CALL_FAILED,
)
from tether_messaging.registry import envelope_codec
from tether_messaging.serde import open_payload


@dataclass(frozen=True)
class Seen:
    """One event of a run as the observer saw it."""

    seq: int
    event_type: str
    recorded_at_ms: int
    seen_ms: float  # wall clock (ms) when this reader got it: when a subscriber could first act on it
    producer: str
    #: ModelCallCompleted: latency_ms; ToolCallCompleted/Failed: duration_ms; ApprovalRequested: the request.
    extra: dict = field(default_factory=dict)


@dataclass
class Approval:
    """A pending approval as the log shows it (what an approver bot needs to decide it)."""

    run_id: str
    tenant_id: str
    approval_id: str
    args_hash: str
    call_id: str
    reasons: list[str]


class LogObserver:
    """Follows `topic` from offset 0 on a thread; keeps every run's events and calls back on the terminal
    event (`on_terminal(run_id, event_type)`) and on each ApprovalRequested (`on_approval(Approval)`)."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, *, schema_registry_url: str | None = None) -> None:
        self.topic = topic
        # The loops' codec: reads single-object and (given the registry) Confluent-framed values.
        self._codec = envelope_codec(schema_registry_url)
        self.partitions = partitions
        self._consumer = Consumer({
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-observer-{uuid.uuid4().hex}",  # never committed: offsets are assigned
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 10,
            "fetch.min.bytes": 1,
        })
        self._lock = threading.Lock()
        self.runs: dict[str, list[Seen]] = {}
        self.tenants: dict[str, str] = {}
        self.terminal: dict[str, str] = {}
        self.events_seen = 0
        self.on_terminal: list[Callable[[str, str], None]] = []
        self.on_approval: list[Callable[[Approval], None]] = []
        self.on_event: list[Callable[[Seen], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-observer", daemon=True)
        self.errors: list[str] = []

    def start(self) -> LogObserver:
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in range(self.partitions)])
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._consumer.close()

    # -- reading -------------------------------------------------------------------------------
    def events(self, run_id: str) -> list[Seen]:
        with self._lock:
            return list(self.runs.get(run_id, ()))

    def snapshot(self) -> dict[str, list[Seen]]:
        with self._lock:
            return {run: list(events) for run, events in self.runs.items()}

    def is_terminal(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self.terminal

    def wait_count(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    def _run(self) -> None:
        while not self._stop.is_set():
            # poll() returns as soon as one record is there; consume() would wait its whole timeout
            # unless 500 arrived (librdkafka's batch consume), adding up to 0.2 s to every `seen_ms`
            # (it made submit → first event read a constant ~200 ms). Then take what else is fetched.
            first = self._consumer.poll(0.2)
            if first is None:
                continue
            msgs = [first, *self._consumer.consume(num_messages=499, timeout=0)]
            now_ms = time.time() * 1000
            for msg in msgs:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        self.errors.append(msg.error().str())
                    continue
                self._handle(msg.value(), now_ms)

    def _handle(self, value: bytes, now_ms: float) -> None:
        env = self._codec.decode_value(value)
        extra: dict = {}
        approval = None
        if env.event_type == MODEL_CALL_COMPLETED:
            extra = {"latency_ms": open_payload(env).latency_ms}
        elif env.event_type in (TOOL_CALL_COMPLETED, TOOL_CALL_FAILED):
            payload = open_payload(env)
            extra = {"duration_ms": getattr(payload, "duration_ms", 0) or 0}
        elif env.event_type == APPROVAL_REQUESTED:
            payload = open_payload(env)
            approval = Approval(env.run_id, env.tenant_id, payload.approval_id, payload.args_hash, payload.call_id,
                                list(payload.reasons))
        seen = Seen(env.seq or 0, env.event_type, env.recorded_at_ms, now_ms, env.producer, extra)
        with self._lock:
            self.events_seen += 1
            self.runs.setdefault(env.run_id, []).append(seen)
            self.tenants.setdefault(env.run_id, env.tenant_id)
            terminal = env.event_type in TERMINAL_TYPES and env.run_id not in self.terminal
            if terminal:
                self.terminal[env.run_id] = env.event_type
        for callback in self.on_event:
            callback(seen)
        if approval is not None:
            for callback in self.on_approval:
                callback(approval)
        if terminal:
            for callback in self.on_terminal:
                callback(env.run_id, env.event_type)
