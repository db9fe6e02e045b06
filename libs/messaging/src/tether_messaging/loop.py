"""The one consume → handle → produce loop: outputs, state checkpoints and input offsets in one Kafka transaction.

How a batch runs (docs/architecture.md, "The exactly-once loop"):

1. wait for input, finished work or a due tick; then take whatever else is already fetched,
   up to `batch_max_messages` records or `batch_max_ms`;
2. begin a transaction; deliver finished work (`Processor.on_work_done`), then each record
   (decode → `Processor.handle`; undecodable records and `Unprocessable` go to the
   dead-letter topic — a record whose decode failure `LoopConfig.fail_on_decode_errors` names
   blocks its partition instead — and so, after an abort and replay of the batch, do records
   whose outputs or state checkpoint are too large ever to be produced: `_PoisonBatch`), then
   `on_tick` when due;
3. call `Processor.before_commit()` if the processor has one (an at-least-once processor
   flushes the batch's external effects there), produce the changed per-run states to the
   service's changelog, send the input offsets, commit. Only after the commit are the changed
   states written to the state store and the work a handler started submitted to the worker
   pool, so neither reflects an aborted decision.

Per-run states live in a `tether_messaging.statestore.StateStore`: a local SQLite cache of the
changelog with a bounded LRU of decoded states, so an idle run costs no memory; ticks see only
the runs whose timer is due (`TickContext.runs_due`, from the processor's optional
`wake_at_ms`). docs/loop.md, "Per-run state". A processor with `tick_after_backlog` has a newly
assigned partition tick only once the input found there at the assignment is handled, and is told
how far its ticks' view of the input goes (`TickContext.inputs_read_through_ms`, from input marks).

Replay contract for handlers. The committed offset of a partition never passes its oldest
input whose work is unfinished (work holds the input). After a crash or rebalance the new
owner restores the states from the changelog, then re-delivers ONLY the held inputs: the
loop checkpoints, with the states, which inputs above the committed offset were already
handled, and skips those. A held input is re-delivered with the state its first handling
left, so its handler must recognise "work started, not finished" and start it again (same
key). Work started from `on_work_done` inherits the hold of the finished work's input, so
the re-delivered input may belong to an earlier link of the chain: the handler restarts
whatever unfinished work the run's state records. Work started from `on_tick` holds no
input: after a failover, the next tick re-derives it from the state.

A revoke (a member joins or leaves) first hands over: the revoked partitions' running work is
waited for (`revoke_drain_ms`) and its outcomes committed in one last transaction, so the next
owner continues from them instead of redoing the work; queued work of those partitions never
starts here. Lost partitions (this member's session expired) are only dropped.

Work runs on `work_threads` worker threads that take it from a fair queue
(`tether_messaging.fairqueue`): weighted deficit round-robin over the work's tenants, so a
tenant with many runs in flight does not delay a tenant with few.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import structlog
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType
from prometheus_client import Counter, Gauge, Histogram

from tether_contracts.base import AvroRecord
from tether_contracts.records import Envelope
from tether_messaging.envelopes import header_event_type, headers_for, make_envelope
from tether_messaging.errors import Unprocessable
from tether_messaging.fairqueue import FairWorkQueue
from tether_messaging.processor import Inbound, Processor, WorkDone
from tether_messaging.registry import envelope_codec
from tether_messaging.serde import SerdeError, open_payload
from tether_messaging.statestore import StateStore
from tether_messaging.topics import Topics
from tether_runtime.logging import log_redactor
from tether_runtime.settings import LoopServiceSettings

log = structlog.get_logger("tether_messaging.loop")

#: Changelog key of the loop's own per-partition checkpoint (which inputs above the
#: committed offset were handled). Run ids never take this form.
LOOP_META_KEY = b"__tether.loop__"

#: Dead-letter headers (the original record's headers, key and value are kept as they were).
DLQ_REASON = "tether-dlq-reason"
DLQ_DETAIL = "tether-dlq-detail"
DLQ_SERVICE = "tether-dlq-service"
DLQ_TOPIC = "tether-dlq-topic"
DLQ_PARTITION = "tether-dlq-partition"
DLQ_OFFSET = "tether-dlq-offset"
DLQ_WORK_KEY = "tether-dlq-work-key"
#: Set (to the value's size) on a dead letter whose original value was too large to include.
DLQ_VALUE_OMITTED = "tether-dlq-value-omitted"

# -- metrics -------------------------------------------------------------------------------
RECORDS = Counter("tether_loop_records_total", "Input records by outcome.", ["service", "topic", "outcome"])
BATCHES = Counter("tether_loop_batches_total", "Loop batches by outcome.", ["service", "outcome"])
COMMIT_SECONDS = Histogram(
    "tether_loop_commit_seconds",
    "Latency of send_offsets + commit of a batch transaction.",
    ["service"],
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
#: Where a hop's time goes (docs/loop.md, "Latency of a hop"): input age (upstream commit,
#: read_committed visibility, fetch), handling, commit, and for work the wait for a worker
#: thread and the wait for the loop to deliver the result.
_HOP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
INPUT_AGE_SECONDS = Histogram(
    "tether_loop_input_age_seconds",
    "From an input record's producer timestamp to the loop taking it into a batch: the upstream "
    "commit, read_committed visibility and the fetch (includes clock skew between hosts).",
    ["service"],
    buckets=_HOP_BUCKETS,
)
HANDLE_SECONDS = Histogram(
    "tether_loop_handle_seconds",
    "A batch from begin_transaction to before its commit: delivering work, handlers, tick, checkpoint.",
    ["service"],
    buckets=_HOP_BUCKETS,
)
WORK_START_SECONDS = Histogram(
    "tether_loop_work_start_seconds",
    "From the commit of the batch that decided a piece of work to a worker thread starting it.",
    ["service"],
    buckets=_HOP_BUCKETS,
)
WORK_DELIVER_SECONDS = Histogram(
    "tether_loop_work_deliver_seconds",
    "From a piece of work finishing to the start of the batch that delivers its result.",
    ["service"],
    buckets=_HOP_BUCKETS,
)
DEAD_LETTERS = Counter("tether_loop_dead_letters_total", "Records sent to the dead-letter topic.", ["service", "reason"])
WORK_IN_FLIGHT = Gauge("tether_loop_work_in_flight", "Work started and not yet delivered back.", ["service"])
WORK_WAITING = Gauge("tether_loop_work_waiting", "Work committed and waiting for a worker thread.", ["service"])
WORK_DONE = Counter("tether_loop_work_done_total", "Work delivered back to the processor.", ["service", "outcome"])
LAG = Gauge("tether_loop_lag_records", "High watermark minus the loop's position.", ["service", "topic", "partition"])
#: 1 while the loop holds a partition at a record this build cannot read (`fail_on_decode_errors`);
#: the series goes when the partition does (the next owner is blocked by it in turn) or the loop ends.
BLOCKED = Gauge(
    "tether_loop_blocked",
    "1 while a partition is held at a record this build cannot decode (LoopConfig.fail_on_decode_errors): "
    "its lag grows until a build that reads it is running.",
    ["service", "topic", "partition", "reason"],
)
RESTORE_SECONDS = Histogram("tether_loop_restore_seconds", "Time to restore states on assignment.", ["service"])
CARRIED = Counter(
    "tether_loop_records_carried_total",
    "Fetched records left for the next batch because the transaction's handling time ran out.",
    ["service"],
)
HANDOVERS = Counter(
    "tether_loop_handover_work_total",
    "Finished work of revoked partitions committed before handing them over (not redone by the next owner).",
    ["service"],
)
PRODUCERS_REPLACED = Counter(
    "tether_loop_producers_replaced_total",
    "Transactional producers replaced in-process after librdkafka failed an abort fatally (INVALID_TXN_STATE) "
    "or after an abort of records the broker refused as too large (their sequence numbers).",
    ["service"],
)


#: Offset-commit errors that mean "the group coordinator is not there yet" (a broker restart,
#: a coordinator move): retried. librdkafka does not mark a failed synchronous commit's error
#: retriable, so they are named here. Generation errors (a rebalance) are not among them.
_COMMIT_RETRIABLE = frozenset({
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._WAIT_COORD,
})

#: Produce errors no retry can cure: a record larger than the producer accepts (`message.max.bytes`,
#: refused by produce() itself) or than the broker accepts for its topic (`max.message.bytes`, in the
#: delivery report, which then fails the transaction). The record that caused it is a poison record
#: (`_PoisonBatch`); any other produce error aborts the batch and replays it as before.
_TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
#: Bytes a one-record batch adds to a record's key and value (the v2 batch header is 61 bytes;
#: the record's own varints and attributes more). Only a record too large even alone is blamed.
_BATCH_OVERHEAD = 61

#: Written by `headers_for` on every envelope (tether_messaging.envelopes).


# -- errors --------------------------------------------------------------------------------
class FatalLoopError(Exception):
    """The loop cannot continue (producer fenced by a newer instance, fatal client error);
    the process must exit non-zero so its supervisor restarts it."""


class RestoreTimeout(FatalLoopError):
    """A changelog partition could not be read to its end in time."""


class ContextMisuse(Exception):
    """A handler used a context in a way the loop cannot honour (e.g. emitting from the
    tick context without choosing a partition)."""


class _AbortBatch(Exception):
    """The open transaction must be aborted and the batch replayed."""

    def __init__(self, message: str, kafka_error: KafkaError | None = None) -> None:
        super().__init__(message)
        #: The transactional call's error, when one ended the batch (`ProcessorLoop._call`).
        self.kafka_error = kafka_error


#: What a handler call's effects came from: ("record", topic, partition, offset) for an input,
#: ("work", partition, key, epoch) for delivered work, ("tick",) for the tick.
_Origin = tuple[Any, ...]


#: Dead-letter reasons of a poison record (what could not be produced) → the detail's wording.
_WHAT_TOO_LARGE = {"OUTPUT_TOO_LARGE": "output", "STATE_TOO_LARGE": "state checkpoint"}


class _PoisonBatch(_AbortBatch):
    """A record too large ever to be produced. With an `origin` (the handler call whose output
    or state it is) the batch is aborted and replayed with that call's input dead-lettered
    instead of handled; without one (the loop's own records) it is an ordinary abort."""

    def __init__(self, origin: _Origin | None, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.origin = origin
        self.reason = reason
        self.detail = detail


# -- configuration -------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopConfig:
    """Everything the loop needs besides the processor; build it with `from_settings`."""

    bootstrap: str
    topics: Topics = field(default_factory=Topics)
    instance_id: int = 0
    batch_max_ms: int = 100
    batch_max_messages: int = 500
    work_threads: int = 8
    #: Share of the worker pool per tenant while several tenants' work waits (deficit
    #: round-robin, in items per round); tenants not listed have weight 1.
    tenant_weights: Mapping[str, int] = field(default_factory=dict)
    tick_interval_ms: int = 1000
    #: Longest one consumer poll blocks while no work is in flight: how late a stop request
    #: is noticed when nothing happens (records and due ticks end a poll at once).
    idle_poll_ms: int = 50
    #: Longest one consumer poll blocks while work is in flight: how long finished work may
    #: wait for the loop (≈ 2% of a core while polling in 2 ms slices, nothing when idle:
    #: libs/messaging/bench/poll_cpu.py).
    work_poll_ms: int = 2
    session_timeout_ms: int = 10_000
    #: Static group membership (`group.instance.id` = the slot, as the transactional id): a
    #: restarted slot rejoins within the session timeout and gets its partitions back at
    #: once, without a rebalance of the other members. The price: a static member does not
    #: leave the group when it stops, so the partitions of a slot that stops for good (scale-
    #: in) move only after the session timeout, as a crashed member's always do. Only for a
    #: configured, stable slot (a StatefulSet ordinal): two members with one id fence each other.
    static_membership: bool = False
    #: A producer that dies mid-transaction blocks read_committed readers of its partitions
    #: until this expires (unless its slot restarts first, which aborts it at once), so keep
    #: it short; batches last ms, and `transaction_handling_share` keeps an overloaded batch
    #: well inside it. (A slot that never returns stalls its partitions for the longer of
    #: this and the session timeout: the same 10 s, Kafka Streams' exactly-once default too.)
    transaction_timeout_ms: int = 10_000
    #: A batch stops handling input once its transaction has been open this share of
    #: `transaction_timeout_ms`: it commits what is done and leaves the rest of the fetched
    #: records (and finished work, and a due tick) to the next batch, so an overloaded loop
    #: slows down instead of having its transaction rolled back by the coordinator (which
    #: fences the producer). The rest of the timeout is for the commit itself.
    transaction_handling_share: float = 0.5
    #: When partitions are revoked (a member joins or leaves), how long the loop waits for
    #: work of those partitions already running (a model call, a tool execution) so it can
    #: commit the outcome before handing the partitions over; the new owner then continues from
    #: it instead of asking again. Work not started by then is not run here; work still running
    #: after it is given up (its input is held, so the new owner redoes it). The whole group
    #: waits for this member's rejoin meanwhile (eager rebalancing), so keep it short.
    revoke_drain_ms: int = 5_000
    #: First backoff of a retried Kafka request of the transactional producer (see _producer_config).
    retry_backoff_ms: int = 5
    #: Wait before replaying a batch that aborted again right after an aborted one: doubling
    #: from this to `abort_backoff_max_ms`, reset by a commit (the first replay is at once). A
    #: batch that keeps failing (its member fenced or gone from the group, a broker refusing)
    #: otherwise retried every few milliseconds, each time a transaction and an abort marker on
    #: every partition it wrote; the consumer is served between tries either way (`_collect`).
    abort_backoff_ms: int = 10
    abort_backoff_max_ms: int = 1_000
    #: A batch that changed nothing — its records passed over (event types the processor does
    #: not act on, `event_types`) or handled without emitting, putting state or starting work,
    #: no work delivered — commits nothing: its offsets go with the next commit, or with one at
    #: most this long after the last (a due tick runs a batch about once a second). A replay of
    #: such records meets the same committed state and changes nothing again (handlers decide
    #: from the state and the record: the replay contract below), so nothing depends on them
    #: being committed; each commit saved is a transaction (AddOffsetsToTxn, TxnOffsetCommit,
    #: EndTxn and its markers) the broker does not serve. Records handled by an at-least-once
    #: processor or one with `before_commit` (external effects) are always committed. 0 = commit
    #: every batch.
    noop_commit_ms: int = 1_000
    #: How long an abort (and, at least once, an offset commit) is retried while the broker is
    #: away (restarting) before the process exits for its supervisor to restart it.
    abort_retry_s: float = 120.0
    #: A transactional producer call (begin, send offsets, commit, abort) that has not returned
    #: after this long is hung, and the process exits at once, as if killed: its successor's
    #: init_transactions fences it and aborts what was open. librdkafka can block in
    #: commit_transaction well past the timeout it is given after a broker restart (a `make
    #: chaos` approval slot sat in one for 10 minutes, holding its partitions' runs); a healthy
    #: call returns within its 30 s timeout.
    txn_call_hang_s: float = 120.0
    restore_timeout_s: float = 120.0
    #: False = at-least-once: outputs flushed, then offsets committed (for idempotent consumers).
    transactional: bool = True
    #: What an unexpected exception in a handler does: dead-letter the record and carry on
    #: (one run suffers, the partition's other runs keep moving), or fail the process.
    handler_errors: Literal["dead-letter", "fail"] = "dead-letter"
    #: Reasons of decode failures (`SerdeError.reason`) that block the record's partition instead
    #: of dead-lettering the record: for a consumer that must not lose a record it will read after
    #: an upgrade (the projector on UNKNOWN_FINGERPRINT: a newer producer's schema). The records
    #: before it are committed, the record and the rest of its partition are not consumed (the
    #: partition is paused, the group's offset stays at the record), while the other partitions keep
    #: flowing and the process keeps serving its metrics: `tether_loop_blocked` = 1 and the
    #: partition's lag, `ready` false (/readyz 503). Only a restart with a build that reads it, or a
    #: rebalance that moves the partition to one, reads it again. Empty: dead-letter them all.
    fail_on_decode_errors: frozenset[str] = frozenset()
    #: Most input the consumer fetches ahead of the loop (librdkafka `queued.max.messages.kbytes`,
    #: may be overshot by one fetch of a partition). librdkafka's default, 64 MiB, is what a
    #: lagging consumer then holds (and the allocator keeps after it): it made the projector, the
    #: slowest consumer, grow ~1 KB per parked run in the bench's park phase. A few batches ahead
    #: is all the loop uses (a batch is at most `batch_max_messages` records).
    consumer_prefetch_kib: int = 2048
    consumer_overrides: Mapping[str, Any] = field(default_factory=dict)
    producer_overrides: Mapping[str, Any] = field(default_factory=dict)
    #: Confluent Schema Registry URL: values are written in its wire format when set (either
    #: format is read); single-object encoding otherwise.
    schema_registry_url: str | None = None
    #: Where the per-run state store (`tether_messaging.statestore`, an SQLite cache of the
    #: changelog) puts its file: a fresh directory inside this one, deleted at shutdown.
    #: None = the system's temporary directory. Use local disk, not a memory filesystem.
    state_dir: str | None = None
    #: Decoded run states kept in memory (LRU); the rest stay encoded on disk until read.
    #: Enough for the runs in flight keeps the hot path free of decoding.
    state_cache_runs: int = 256

    @classmethod
    def from_settings(cls, settings: LoopServiceSettings, **overrides: Any) -> LoopConfig:
        """The loop configuration a service's settings describe."""
        values: dict[str, Any] = dict(
            bootstrap=settings.kafka_bootstrap,
            topics=Topics(settings.topic_prefix),
            instance_id=settings.instance_id,
            batch_max_ms=settings.batch_max_ms,
            batch_max_messages=settings.batch_max_messages,
            work_threads=settings.work_threads,
            tenant_weights=dict(settings.tenant_weights),
            session_timeout_ms=settings.session_timeout_ms,
            # A slot set explicitly is stable; a default 0 may be shared (Deployment replicas).
            static_membership="instance_id" in settings.model_fields_set,
            transaction_timeout_ms=settings.transaction_timeout_ms,
            revoke_drain_ms=settings.revoke_drain_ms,
            retry_backoff_ms=settings.kafka_retry_backoff_ms,
            noop_commit_ms=settings.noop_commit_ms,
            schema_registry_url=settings.schema_registry_url,
            state_dir=settings.state_dir,
            state_cache_runs=settings.state_cache_runs,
        )
        values.update(overrides)
        return cls(**values)


# -- bookkeeping ---------------------------------------------------------------------------
TP = tuple[str, int]


@dataclass
class _Work:
    key: str
    run_id: str
    tenant_id: str
    partition: int
    epoch: int
    origin: TP | None
    origin_offset: int | None
    fn: Callable[[], Any]
    #: Set by a worker thread when it starts `fn` / by a revoke for work that must not start;
    #: both under the loop's `_work_lock`, so a revoke knows exactly which work is running.
    running: bool = False
    cancelled: bool = False
    #: time.monotonic() when the deciding batch committed (for tether_loop_work_start_seconds).
    committed_at: float = 0.0


@dataclass
class _Finished:
    key: str
    epoch: int
    result: Any = None
    error: BaseException | None = None
    finished_at: float = field(default_factory=time.monotonic)


@dataclass
class _Unit:
    """What one handler call did, applied only if the handler returns normally."""

    outputs: list[tuple[str, int, bytes, bytes, list[tuple[str, bytes]]]] = field(default_factory=list)
    states: dict[tuple[int, str], Any] = field(default_factory=dict)
    starts: list[_Work] = field(default_factory=list)
    #: Whose effects these are: what a poison record's dead letter (or dropped tick) names.
    origin: _Origin | None = None


@dataclass
class _Batch:
    now_ms: int
    #: The batch's state changes (None = deleted), read before the store and written to it
    #: only after the commit: an aborted batch leaves the store as it was.
    states: dict[tuple[int, str], Any] = field(default_factory=dict)
    #: The changes as checkpointed: (partition, run id, state, encoded state), for the store.
    checkpointed: list[tuple[int, str, Any, bytes | None]] = field(default_factory=list)
    starts: list[_Work] = field(default_factory=list)
    delivered: list[_Finished] = field(default_factory=list)
    first_offsets: dict[TP, int] = field(default_factory=dict)
    touched: set[int] = field(default_factory=set)
    #: Each changed state's puts in order: (handler call, state). A checkpoint too large is blamed
    #: on the first put that made the state too large (`ProcessorLoop._blame_state`).
    state_puts: dict[tuple[int, str], list[tuple[_Origin, Any]]] = field(default_factory=dict)
    #: Poison records (`ProcessorLoop._poison`) dead-lettered in this batch: forgotten once it commits.
    poisoned: list[_Origin] = field(default_factory=list)
    #: Reasons of the dead letters produced in this batch: counted (DEAD_LETTERS) once they are in
    #: the log for good, at the commit (or at once without a transaction, which an abort does not
    #: take back), so a replayed batch's aborted attempts do not count them again.
    dead_lettered: list[str] = field(default_factory=list)
    produced: int = 0
    handled: int = 0
    #: Records that reached the decoder (handled, dead-lettered or failed), not just passed over.
    decoded: int = 0
    #: Partitions this batch met a record of that `fail_on_decode_errors` names: (offset, reason,
    #: detail). Blocked (`ProcessorLoop._block`) once the records before it are committed; an
    #: aborted batch forgets them, and its replay meets the record again.
    blocked: dict[TP, tuple[int, str, str]] = field(default_factory=dict)


@dataclass
class _InputMark:
    """The end offsets (high watermarks) of one partition's `tick_after_backlog` inputs, read after
    `taken_at_ms` (the loop's clock). `ends` keeps the topics whose handled offset has not reached
    its end yet; once none is left, every record appended by `taken_at_ms` has been handled, or
    was aborted (`ProcessorLoop._advance_marks`)."""

    taken_at_ms: int
    ends: dict[str, int]


# -- contexts handed to the processor --------------------------------------------------------
class _Ctx:
    def __init__(self, loop: ProcessorLoop, batch: _Batch, unit: _Unit, partition: int, origin: TP | None, origin_offset: int | None) -> None:
        self._loop = loop
        self._batch = batch
        self._unit = unit
        self._partition = partition
        self._origin = origin
        self._origin_offset = origin_offset

    @property
    def now_ms(self) -> int:
        return self._batch.now_ms

    @property
    def partition(self) -> int:
        return self._partition

    def emit(
        self,
        topic: str,
        payload: AvroRecord,
        *,
        run_id: str,
        tenant_id: str,
        event_id: str,
        causation_id: str | None = None,
    ) -> Envelope:
        env = make_envelope(
            payload,
            run_id=run_id,
            tenant_id=tenant_id,
            event_id=event_id,
            producer=self._loop.processor.name,
            recorded_at_ms=self._batch.now_ms,
            causation_id=causation_id,
        )
        self.emit_envelope(topic, env)
        return env

    def emit_envelope(self, topic: str, envelope: Envelope) -> None:
        self._unit.outputs.append(
            (topic, self._partition, envelope.run_id.encode(), self._loop._codec.encode_value(envelope, topic), headers_for(envelope))
        )

    def get_state(self, run_id: str) -> Any | None:
        key = (self._partition, run_id)
        if key in self._unit.states:
            return self._unit.states[key]
        if key in self._batch.states:
            return self._batch.states[key]
        store = self._loop._store
        return None if store is None else store.get(self._partition, run_id)

    def put_state(self, run_id: str, state: Any | None) -> None:
        self._unit.states[(self._partition, run_id)] = state

    def start_work(self, key: str, run_id: str, tenant_id: str, fn: Callable[[], Any]) -> None:
        if key in self._loop._work or any(w.key == key for w in self._unit.starts):
            return
        self._unit.starts.append(
            _Work(key, run_id, tenant_id, self._partition, self._loop._epoch.get(self._partition, 0),
                  self._origin, self._origin_offset, fn)
        )


class _TickCtx(_Ctx):
    def __init__(self, loop: ProcessorLoop, batch: _Batch, unit: _Unit) -> None:
        super().__init__(loop, batch, unit, -1, None, None)

    @property
    def partition(self) -> int:
        raise ContextMisuse("the tick context owns no partition; use for_partition(p)")

    def emit_envelope(self, topic: str, envelope: Envelope) -> None:
        raise ContextMisuse("emit from the tick context via for_partition(p)")

    def get_state(self, run_id: str) -> Any | None:
        raise ContextMisuse("read state from the tick context via for_partition(p)")

    def put_state(self, run_id: str, state: Any | None) -> None:
        raise ContextMisuse("write state from the tick context via for_partition(p)")

    def start_work(self, key: str, run_id: str, tenant_id: str, fn: Callable[[], Any]) -> None:
        raise ContextMisuse("start work from the tick context via for_partition(p)")

    def owned_partitions(self) -> Sequence[int]:
        loop = self._loop
        # Partitions still reading their backlog at assignment (`tick_after_backlog`) do not tick yet.
        return sorted(p for p in loop._owned if p not in loop._to_restore and loop._ticks(p))

    def inputs_read_through_ms(self, partition: int) -> int:
        loop = self._loop
        if not loop._tick_after_backlog:
            raise ContextMisuse("inputs_read_through_ms needs the processor's tick_after_backlog")
        if partition not in loop._owned or partition in loop._to_restore or not loop._ticks(partition):
            raise ContextMisuse(f"partition {partition} does not tick here")
        # Asked: the partition's inputs get a new mark after this batch (unless one is pending), so a
        # later tick sees a later time. Only asked-for partitions cost the end-offset requests.
        loop._marks_wanted.add(partition)
        return loop._read_through[partition]

    def runs_due(self, partition: int) -> Sequence[str]:
        store = self._loop._store
        if store is None:
            return []
        now = self._batch.now_ms
        # The store's index holds committed states; this batch's changes (so far, and this
        # tick's own) override it.
        changed = {run_id: state for (p, run_id), state in [*self._batch.states.items(), *self._unit.states.items()]
                   if p == partition}
        due = [(wake, run_id) for wake, run_id in store.due(partition, now) if run_id not in changed]
        for run_id, state in changed.items():
            wake = None if state is None else store.wake_at(state)
            if wake is not None and wake <= now:
                due.append((wake, run_id))
        return [run_id for _, run_id in sorted(due)]

    def for_partition(self, partition: int) -> _Ctx:
        if partition not in self._loop._owned or partition in self._loop._to_restore:
            raise ContextMisuse(f"partition {partition} is not owned by this instance")
        if not self._loop._ticks(partition):
            raise ContextMisuse(f"partition {partition} does not tick before its backlog is read")
        return _Ctx(self._loop, self._batch, self._unit, partition, None, None)


# -- the loop ------------------------------------------------------------------------------
class ProcessorLoop:
    """Drives one `Processor` against Kafka with exactly-once (or at-least-once) semantics.

    Use: ``ProcessorLoop(processor, config).run(stop_event)``. `run` returns after `stop`
    is set (the current batch is committed and the consumer leaves its group) and raises
    `FatalLoopError` when the process must restart. `ready` turns true once the first
    partition assignment has been restored, and is false while a partition is blocked
    (`LoopConfig.fail_on_decode_errors`).
    """

    def __init__(self, processor: Processor, config: LoopConfig, *, clock_ms: Callable[[], int] | None = None,
                 monotonic: Callable[[], float] | None = None) -> None:
        self.processor = processor
        # How long a batch's transaction has been open is read from `monotonic` (seconds);
        # tests pass a virtual clock that their handlers advance.
        self._monotonic = monotonic or time.monotonic
        # One codec per process. A registry outage raises SchemaRegistryUnavailable, which is
        # not a SerdeError: it stops the loop (and the supervisor restarts it) instead of
        # dead-lettering good records.
        self._codec = envelope_codec(config.schema_registry_url)
        self.config = config
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._name = processor.name
        # The hop histograms' children, bound once: they are observed per record and per work.
        self._input_age = INPUT_AGE_SECONDS.labels(self._name)
        self._handle_seconds = HANDLE_SECONDS.labels(self._name)
        self._work_start = WORK_START_SECONDS.labels(self._name)
        self._work_deliver = WORK_DELIVER_SECONDS.labels(self._name)
        self._group = config.topics.group_id(processor.name)
        self._changelog = config.topics.changelog(processor.name)
        # Event types the processor acts on, per topic (`EventFilter`): others are passed over
        # by their header, undecoded.
        self._wanted: dict[str, frozenset[bytes]] = {
            topic: frozenset(t.encode() for t in types)
            for topic, types in (getattr(processor, "event_types", None) or {}).items()
        }
        self._dead_letters = config.topics.dead_letters
        self._txn = config.transactional
        self._log = log.bind(processor=processor.name, instance=config.instance_id)
        self._ready = threading.Event()
        self._fatal: KafkaError | None = None
        # Committed per-run states of the owned partitions, on local disk with a few decoded
        # in memory, so an idle run costs no memory. None: the processor keeps no state.
        self._store: StateStore | None = None
        if processor.state_codec is not None:
            self._store = StateStore(
                processor.state_codec,
                name=processor.name,
                directory=config.state_dir,
                cache_runs=config.state_cache_runs,
                wake_at=getattr(processor, "wake_at_ms", None),
            )

        # Per partition index (the same index on every input topic: range assignment
        # keeps them together). States are the committed view plus this batch's changes.
        self._owned: dict[int, set[str]] = {}
        self._epoch: dict[int, int] = {}
        self._meta_has_holds: dict[int, bool] = {}
        # Per (topic, partition).
        self._next: dict[TP, int] = {}
        self._holds: dict[TP, dict[int, int]] = {}
        self._committed: dict[TP, int] = {}
        #: When offsets were last committed (monotonic): bounds how long the offsets of batches
        #: that changed nothing may wait (`noop_commit_ms`).
        self._last_commit_at = 0.0
        self._skip: dict[TP, tuple[int, frozenset[int]]] = {}

        self._work: dict[str, _Work] = {}
        self._work_lock = threading.Lock()
        # Set by `_shutdown` when the loop ends on an error: a revoke then only drops.
        self._handover_ok = True
        # An error a rebalance callback could not raise (librdkafka's callbacks surface
        # exceptions badly); raised by `_check_fatal` right after the poll that ran it.
        self._callback_error: FatalLoopError | None = None
        # When the transactional call in progress began (None: none is); read by the watchdog.
        self._txn_call_started: float | None = None
        self._watchdog_stop = threading.Event()
        self._hard_exit: Callable[[int], None] = os._exit  # tests replace it
        self._finished: queue.SimpleQueue[_Finished] = queue.SimpleQueue()
        self._redeliver: list[_Finished] = []
        #: Batches aborted since the last commit (`abort_backoff_ms`).
        self._aborts_in_row = 0
        self._buffer: list[Message] = []
        self._next_tick = 0.0
        self._to_restore: set[int] = set()

        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        #: Which producer is current: a replaced one's fatal error must not end the loop.
        self._producer_generation = 0
        self._restorer: Consumer | None = None
        #: Reads the end offsets of marks (`tick_after_backlog` only): read_uncommitted, see `_note_backlog`.
        self._end_reader: Consumer | None = None
        self._pool: FairWorkQueue[_Work] | None = None
        self._delivery_errors: list[KafkaError] = []
        #: Poison records: handler calls whose outputs or state checkpoint can never be produced
        #: (too large), found by an aborted batch. Its replay dead-letters them instead of handling
        #: them; an entry goes once a batch that did so commits, or with its partition.
        self._poison: dict[_Origin, tuple[str, str]] = {}
        #: Records of the open transaction the broker refused as too large (their delivery
        #: reports): (origin, reason, topic, partition, key, bytes, error). Examined when it aborts.
        self._refused: list[tuple[_Origin, str, str, int, bytes, int, KafkaError]] = []
        #: Topics' `max.message.bytes`, looked up when the broker refused a record as too large.
        self._topic_limits: dict[str, int] = {}
        #: Partitions held (paused) at a record this build cannot decode: (offset, reason). Until
        #: they are dropped (revoked, lost) or the loop ends; `ready` is false meanwhile.
        self._blocked: dict[TP, tuple[int, str]] = {}
        #: Input topics whose backlog at assignment a partition's tick waits for, and whose marks
        #: say how far the tick's view of the input goes (`tether_messaging.processor.BacklogBeforeTick`;
        #: empty: ticks never wait and there are no marks).
        self._tick_after_backlog = frozenset(getattr(processor, "tick_after_backlog", None) or ())
        #: Per partition, the newest mark whose end offsets are reached: every record appended to
        #: its inputs by that clock time has been handled (or was aborted). Absent until the
        #: backlog at assignment is read; the partition does not tick meanwhile.
        self._read_through: dict[int, int] = {}
        #: Per partition, the mark not reached yet (at most one: the first at assignment, later ones
        #: when a tick asks, `TickContext.inputs_read_through_ms`).
        self._marks: dict[int, _InputMark] = {}
        #: Partitions whose tick asked for their read-through time since the last batch ended.
        self._marks_wanted: set[int] = set()
        #: The group's position on each input at assignment (committed offset, else the earliest):
        #: what counts as handled until the consumer returns a record of it (`_handled_offset`).
        self._assigned_at: dict[TP, int] = {}

    # -- public ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once the group has been joined and the first assignment restored, while no
        partition is blocked at a record this build cannot read (`fail_on_decode_errors`)."""
        return self._ready.is_set() and not self._blocked

    @property
    def transactional_id(self) -> str:
        return f"{self.config.topics.prefix}{self._name}-{self.config.instance_id}"

    @property
    def group_instance_id(self) -> str | None:
        """The consumer's static member id (the slot, named like the transactional id), if static."""
        return self.transactional_id if self.config.static_membership else None

    def run(self, stop: threading.Event) -> None:
        """Process until `stop` is set. Raises `FatalLoopError` if the process must restart."""
        cfg = self.config
        self._producer = Producer(self._producer_config())
        self._pool = FairWorkQueue(cfg.tenant_weights)
        for i in range(cfg.work_threads):
            # Not daemons: at exit the interpreter waits for work already running (as it did for
            # the executor's threads), so a graceful stop does not cut a tool call in half.
            # `_shutdown` (below, always) closes the queue, which ends them.
            threading.Thread(target=self._work_thread, name=f"{self._name}-work-{i}").start()
        if self._txn:
            self._start_watchdog()
        try:
            if self._txn:
                # Fences any earlier incarnation of this slot and aborts its open transaction,
                # which also unblocks read_committed readers of its partitions.
                self._call(lambda: self._producer.init_transactions(30))
            self._restorer = Consumer(self._restorer_config())
            if self._tick_after_backlog:
                self._end_reader = Consumer(self._end_reader_config())
            self._consumer = Consumer(self._consumer_config())
            self._consumer.subscribe(
                list(self.processor.inputs),
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self._log.info("loop_started", group=self._group, inputs=list(self.processor.inputs),
                           transactional_id=self.transactional_id if self._txn else None,
                           group_instance_id=self.group_instance_id)
            while not stop.is_set():
                self._check_fatal()
                self._run_batch(stop)
            self._log.info("loop_stopping")
        finally:
            self._shutdown()

    # -- client configs --------------------------------------------------------------------
    def _consumer_config(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "bootstrap.servers": cfg.bootstrap,
            "group.id": self._group,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            # Eager "range" assignment: partition p of every input topic goes to the same
            # member (co-partitioning: a run's records on commands and intake share one
            # state map), and a revoke always happens with no transaction open (callbacks
            # run only while collecting input). Cooperative-sticky would neither guarantee
            # co-partitioning nor make the revoke/transaction interplay as simple.
            "partition.assignment.strategy": "range",
            "session.timeout.ms": cfg.session_timeout_ms,
            "queued.max.messages.kbytes": cfg.consumer_prefetch_kib,
            "heartbeat.interval.ms": max(1000, cfg.session_timeout_ms // 5),
            "error_cb": self._on_client_error,
            **({"group.instance.id": self.group_instance_id} if cfg.static_membership else {}),
            **cfg.consumer_overrides,
        }

    def _producer_config(self) -> dict[str, Any]:
        cfg = self.config
        conf: dict[str, Any] = {
            "bootstrap.servers": cfg.bootstrap,
            "enable.idempotence": True,
            # Outputs name their partition explicitly; the partitioner only matters for a
            # record produced without one, and must then agree with Java clients.
            "partitioner": "murmur2_random",
            # A batch's outputs leave at its commit (commit_transaction and flush send what is
            # queued at once, whatever the linger), not every 5 ms while the batch is handled: a
            # batch that handles for a while sends one produce request per partition instead of
            # dozens, for half the producer's CPU (libs/messaging/bench/linger_probe.py).
            "linger.ms": 1000,
            "error_cb": self._producer_error_cb(),
        }
        if self._txn:
            conf["transactional.id"] = self.transactional_id
            conf["transaction.timeout.ms"] = cfg.transaction_timeout_ms
            # The loop begins a transaction as soon as the last one committed, and the coordinator
            # answers CONCURRENT_TRANSACTIONS until that one's markers are written; librdkafka retries
            # after retry.backoff.ms, 100 ms by default: a hop's p90 was 106-125 ms back to back, 18-23
            # ms with 5 (libs/messaging/bench/hop_latency.py; KAFKA-5477 lowered Java's to 20 ms for
            # the same reason). Later retries of a persistent error still back off exponentially, up
            # to retry.backoff.max.ms (1 s).
            conf["retry.backoff.ms"] = cfg.retry_backoff_ms
            # No KIP-1102 re-bootstrap: when every broker is down (a restart of a one-broker
            # cluster), librdkafka 2.16 re-bootstraps at once and decommissions the brokers it
            # knew, but keeps a decommissioned one cached as the group coordinator, so the
            # TxnOffsetCommit of send_offsets_to_transaction waits for a broker thread that will
            # never connect again, ignoring its timeout (confluentinc/librdkafka#5511, #5456; fix
            # #5512 open). Every broker restart in `make chaos` left some slots inside that call
            # until the watchdog (`txn_call_hang_s`) ended them; libs/messaging/bench/
            # txn_broker_restart.py reproduces it on a private broker. Without re-bootstrap the
            # known brokers stay and reconnect when the broker is back. What that gives up: a
            # cluster whose every broker address changed is not found again in-process (the
            # process then fails and its supervisor restarts it with the bootstrap list).
            conf["metadata.recovery.strategy"] = "none"
        else:
            conf["acks"] = "all"
            conf["on_delivery"] = self._on_delivery
        conf.update(cfg.producer_overrides)  # explicit librdkafka settings win
        return conf

    def _restorer_config(self) -> dict[str, Any]:
        return {
            "bootstrap.servers": self.config.bootstrap,
            "group.id": f"{self._group}.restore",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }

    def _end_reader_config(self) -> dict[str, Any]:
        return {
            "bootstrap.servers": self.config.bootstrap,
            "group.id": f"{self._group}.ends",  # never joins: it only asks for end offsets
            "isolation.level": "read_uncommitted",
            "enable.auto.commit": False,
        }

    def _producer_error_cb(self) -> Callable[[KafkaError], None]:
        generation = self._producer_generation

        def on_error(err: KafkaError) -> None:
            self._on_client_error(err, producer_generation=generation)

        return on_error

    def _on_client_error(self, err: KafkaError, producer_generation: int | None = None) -> None:
        replaced = producer_generation is not None and producer_generation != self._producer_generation
        if err.fatal() and not replaced:
            self._fatal = err
        self._log.warning("kafka_client_error", error=err.str(), code=err.name(), fatal=err.fatal(),
                          **({"replaced_producer": True} if replaced else {}))

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self._delivery_errors.append(err)

    def _on_txn_delivery(self, origin: _Origin, reason: str, err: KafkaError | None, msg: Message) -> None:
        """Delivery report of a handler call's output or checkpoint (transactional): keeps the
        broker's size refusals so an abort can tell which handler call caused them."""
        if err is not None and err.code() in _TOO_LARGE:
            size = len(msg.key() or b"") + len(msg.value() or b"")
            self._refused.append((origin, reason, msg.topic(), msg.partition(), msg.key() or b"", size, err))

    def _check_fatal(self) -> None:
        if self._callback_error is not None:
            raise self._callback_error
        if self._fatal is not None:
            raise FatalLoopError(f"fatal Kafka client error: {self._fatal.str()}")

    # -- rebalance callbacks (run inside consumer.poll/consume, never with a txn open) -------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Restoring takes I/O that may fail transiently; errors raised inside a librdkafka
        # callback surface badly, so the loop thread restores the new partitions
        # (`_restore_pending`) before it handles any record (`_run_batch` holds back a batch
        # collected while an assignment came in). The partitions are not paused meanwhile:
        # pause() right after assign() can leave a partition never fetched, with no error
        # (confluentinc/librdkafka#2190, #5591: the pause's version barrier outdates the
        # assign's fetch start); a tool gateway saw nothing of its run-events for 4 minutes.
        # Records fetched during the restore just wait in the client's queue.
        new = sorted({tp.partition for tp in partitions} - set(self._owned))
        for tp in partitions:
            self._owned.setdefault(tp.partition, set()).add(tp.topic)
        consumer.assign(partitions)
        self._to_restore.update(new)
        self._log.info("partitions_assigned", partitions=sorted(self._owned), to_restore=new)
        if not self._to_restore:
            self._ready.set()

    def _restore_pending(self) -> None:
        partitions = sorted(self._to_restore)
        self._restore(partitions)
        self._note_backlog(partitions)
        self._to_restore.clear()
        self._ready.set()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gone = {tp.partition for tp in partitions}
        # Revoked, not lost: this member still belongs to the generation, so it may commit.
        # (Lost partitions may already be another member's: those are only dropped.)
        if self._handover_ok and self._fatal is None and self._callback_error is None:
            try:
                self._hand_over(gone)
            except FatalLoopError as exc:
                self._callback_error = exc
            except Exception as exc:  # noqa: BLE001 - never out of a librdkafka callback
                self._log.error("handover_failed", error=_describe(exc), traceback=traceback.format_exc())
        self._drop(sorted(gone), "revoked")

    def _hand_over(self, gone: set[int]) -> None:
        """Finish the revoked partitions' running work and commit its outcomes before the drop.

        Without this a rebalance (a member joining, e.g. a restarted slot) threw away work in
        flight, and the partitions' next owner did it again: a model asked twice for one step
        (`make chaos`, duplicate_model_calls). Work queued but not started is cancelled instead
        (the next owner starts it); work still running after `revoke_drain_ms` is given up.
        """
        mine = [w for w in self._work.values() if w.partition in gone]
        redeliver = [f for f in self._redeliver if self._work_partition(f) in gone]
        if not mine and not redeliver:
            return
        with self._work_lock:
            for w in mine:
                if not w.running:
                    w.cancelled = True
            waiting = {w.key for w in mine if w.running} - {f.key for f in redeliver}
        self._redeliver = [f for f in self._redeliver if self._work_partition(f) not in gone]
        finished = redeliver
        others: list[_Finished] = []
        deadline = time.monotonic() + self.config.revoke_drain_ms / 1000
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                f = self._finished.get(timeout=min(remaining, 0.05))
            except queue.Empty:
                continue
            if f.key in waiting and self._is_current(f):
                waiting.discard(f.key)
                finished.append(f)
            else:
                others.append(f)  # another partition's (kept) or stale (filtered when taken)
        self._redeliver = others + self._redeliver
        finished = [f for f in finished if self._is_current(f)]
        self._log.info("handover", partitions=sorted(gone), delivered=len(finished), given_up=len(waiting),
                       not_started=sum(1 for w in mine if w.cancelled))
        if not finished:
            return
        batch = _Batch(now_ms=self._clock_ms())
        try:
            if self._txn:
                self._call(self._producer.begin_transaction)
            for f in finished:
                self._deliver(batch, f)
            self._before_commit()
            self._checkpoint(batch)
            self._commit(batch)
        except _AbortBatch as exc:
            # Nothing of it committed: the partitions' next owner redoes the work (and finds a
            # poison outcome by itself).
            self._log.warning("handover_aborted", error=str(exc))
            if not self._txn:
                self._count_dead_letters(batch)  # produced without a transaction: they stay
            self._abort_transaction()
            self._producer.poll(0)
            self._refused.clear()
            return
        HANDOVERS.labels(self._name).inc(len(finished))
        # Work the outcomes started is not run here: its inputs are held in the committed
        # checkpoint, so the next owner starts it (`_drop` forgets it).

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drop([tp.partition for tp in partitions], "lost")

    def _drop(self, partitions: Sequence[int], why: str) -> None:
        """Forget everything about partitions another instance now owns: it replays from
        the committed offset with the committed states."""
        gone = set(partitions)
        self._to_restore -= gone
        self._buffer = [m for m in self._buffer if m.partition() not in gone]
        self._redeliver = [f for f in self._redeliver if self._work_partition(f) not in gone]
        for p in gone:
            self._owned.pop(p, None)
            self._read_through.pop(p, None)
            self._marks.pop(p, None)
            self._marks_wanted.discard(p)
            if self._store is not None:
                self._store.drop_partition(p)
            self._meta_has_holds.pop(p, None)
            self._epoch[p] = self._epoch.get(p, 0) + 1
        for tp in [tp for tp in self._next if tp[1] in gone]:
            # The new owner exports its own lag for this partition; a frozen series here would
            # be summed with it (the lag alert adds by service) until this process restarts.
            try:
                LAG.remove(self._name, tp[0], str(tp[1]))
            except KeyError:
                pass  # never measured
        self._unblock([tp for tp in self._blocked if tp[1] in gone])
        for d in (self._next, self._holds, self._committed, self._skip, self._assigned_at):
            for tp in [tp for tp in d if tp[1] in gone]:
                del d[tp]
        for key in [k for k, w in self._work.items() if w.partition in gone]:
            del self._work[key]  # its result, when it comes, carries a stale epoch
        for origin in [o for o in self._poison if _origin_partition(o) in gone]:
            del self._poison[origin]  # the next owner finds them poison by itself
        WORK_IN_FLIGHT.labels(self._name).set(len(self._work))
        self._log.info("partitions_dropped", why=why, partitions=sorted(gone))

    def _work_partition(self, f: _Finished) -> int | None:
        w = self._work.get(f.key)
        return w.partition if w else None

    # -- restore ---------------------------------------------------------------------------
    def _restore(self, partitions: Sequence[int]) -> None:
        """Read the changelog partitions from the beginning to their end into the state store."""
        started = time.monotonic()
        restorer = self._restorer
        store = self._store
        pending: set[int] = set()
        assign: list[TopicPartition] = []
        if store is not None:
            store.begin_restore(partitions)
        for p in partitions:
            self._meta_has_holds[p] = False
            low, high = self._watermarks(TopicPartition(self._changelog, p))
            if high > low:
                pending.add(p)
                assign.append(TopicPartition(self._changelog, p, low))
        restorer.assign(assign)
        records = 0
        deadline = time.monotonic() + self.config.restore_timeout_s
        try:
            while pending:
                if time.monotonic() > deadline:
                    raise RestoreTimeout(f"changelog {self._changelog} partitions {sorted(pending)} not read to the end")
                msg = restorer.poll(0.5)
                if msg is None:
                    continue
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                    elif msg.error().fatal():
                        raise FatalLoopError(f"restoring {self._changelog}: {msg.error().str()}")
                    else:  # leader moves and the like: the client retries by itself
                        self._log.info("restore_transient_error", error=msg.error().str())
                    continue
                records += 1
                p, key, value = msg.partition(), msg.key(), msg.value()
                if key == LOOP_META_KEY:
                    self._restore_meta(p, value)
                elif key is not None and store is not None:
                    store.load(p, key.decode(), value)
        finally:
            restorer.unassign()
        runs = 0
        if store is not None:
            store.end_restore(partitions)
            runs = sum(store.count(p) for p in partitions)
        RESTORE_SECONDS.labels(self._name).observe(time.monotonic() - started)
        self._log.info("states_restored", partitions=list(partitions), records=records, runs=runs)

    def _watermarks(self, tp: TopicPartition, reader: Consumer | None = None) -> tuple[int, int]:
        deadline = time.monotonic() + self.config.restore_timeout_s
        while True:
            try:
                return (reader or self._restorer).get_watermark_offsets(tp, timeout=5)
            except KafkaException as exc:
                err = exc.args[0]
                # A just-created topic may not have a leader yet.
                if err.fatal() or time.monotonic() > deadline:
                    raise RestoreTimeout(f"watermarks of {tp.topic}[{tp.partition}]: {err.str()}") from exc
                self._log.info("restore_transient_error", error=err.str())
                time.sleep(0.2)

    def _ticks(self, p: int) -> bool:
        """Whether an owned, restored partition ticks: always, or with `tick_after_backlog` once the
        backlog found at its assignment is handled."""
        return not self._tick_after_backlog or p in self._read_through

    def _note_backlog(self, partitions: Sequence[int]) -> None:
        """Take the first mark of these newly assigned partitions (`tick_after_backlog`): they tick
        once their inputs are handled up to the end offsets read now."""
        if not self._tick_after_backlog:
            return
        tps = [TopicPartition(topic, p) for p in partitions
               for topic in sorted(self._owned.get(p, set()) & self._tick_after_backlog)]
        starts = self._committed_offsets(tps) if tps else {}
        # Read before the end offsets: a record appended by this time is below them.
        taken_at_ms = self._clock_ms()
        ends: dict[int, dict[str, int]] = {p: {} for p in partitions}
        for tp in tps:
            # The high watermark (read_uncommitted), not the last stable offset: a record appended
            # (and acknowledged) behind another producer's open transaction is not readable yet, so
            # the last stable offset would leave it out, and a timer would decide without it. The
            # loop reads read_committed, so it reaches this end once the transactions open now have
            # ended (committed or aborted: the position passes aborted records and markers).
            # Records appended later are not the backlog.
            high = self._watermarks(tp, self._end_reader)[1]
            low = self._watermarks(tp)[0]
            # No committed offset: the consumer starts at the earliest (auto.offset.reset). A
            # position at the end stays invalid (nothing is fetched): `_handled_offset` uses this.
            self._assigned_at[(tp.topic, tp.partition)] = max(starts.get((tp.topic, tp.partition), -1), low)
            ends[tp.partition][tp.topic] = high
        for p in partitions:
            self._marks[p] = _InputMark(taken_at_ms, ends[p])
        self._advance_marks(partitions, log_first=False)
        for p in sorted(set(partitions) & set(self._marks)):
            self._log.info("tick_waits_for_backlog", partition=p, ends=self._marks[p].ends)

    def _committed_offsets(self, tps: list[TopicPartition]) -> dict[TP, int]:
        deadline = time.monotonic() + self.config.restore_timeout_s
        while True:
            try:
                return {(tp.topic, tp.partition): tp.offset for tp in self._consumer.committed(tps, timeout=5)}
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal() or time.monotonic() > deadline:
                    raise RestoreTimeout(f"committed offsets of {self._group}: {err.str()}") from exc
                self._log.info("restore_transient_error", error=err.str())
                time.sleep(0.2)

    def _handled_offset(self, tp: TP) -> int:
        """The offset below which every record of `tp` has been handled or will never be readable
        (aborted) (the caller leaves out records carried to the next batch and blocked partitions).

        The consumer's position is past every record it returned, and past transaction markers and
        aborted records, which it never returns; it stops at the last stable offset while a
        transaction is open (read_committed). It is invalid until the consumer
        returns a record after the assignment or after an abort's seek: then what was handled is
        what this loop handled (`_next`, as of the last committed batch) or the group's position at
        the assignment."""
        [position] = self._consumer.position([TopicPartition(tp[0], tp[1])])
        if position.offset >= 0:
            return position.offset
        return max(self._next.get(tp, -1), self._assigned_at.get(tp, -1))

    def _advance_marks(self, partitions: Sequence[int] | None = None, *, log_first: bool = True) -> None:
        """After a batch: a mark whose end offsets the loop has handled up to becomes its partition's
        read-through time: every record appended by then that is or becomes readable has been handled
        (the first mark, at assignment, lets the partition tick). Only after a
        committed or deferred batch: an aborted one does not get here, its records are handled
        again first. Records returned but carried to the next batch (`_buffer`) do not count, nor
        does a blocked partition (its records are never handled)."""
        unhandled = {(m.topic(), m.partition()) for m in self._buffer}
        for p in list(self._marks) if partitions is None else [p for p in partitions if p in self._marks]:
            mark = self._marks[p]
            for topic, end in list(mark.ends.items()):
                tp = (topic, p)
                if tp not in unhandled and tp not in self._blocked and self._handled_offset(tp) >= end:
                    del mark.ends[topic]
            if mark.ends:
                continue
            del self._marks[p]
            if p not in self._read_through and log_first:
                self._log.info("backlog_read", partition=p)
            self._read_through[p] = mark.taken_at_ms

    def _take_marks(self) -> None:
        """New marks for the partitions whose tick asked for their read-through time and have none
        pending: the clock, then the end offsets (high watermarks, as in `_note_backlog`) of their
        `tick_after_backlog` inputs (one request per input partition, outside any transaction). A
        failed request takes no mark; the next tick asks again, and the read-through time stays where
        it was (late, never wrong)."""
        wanted, self._marks_wanted = self._marks_wanted, set()
        taken: list[int] = []
        for p in sorted(wanted):
            if p not in self._owned or p in self._marks or p not in self._read_through:
                continue
            taken_at_ms = self._clock_ms()  # before the offsets: a record appended by then is below them
            ends: dict[str, int] = {}
            for topic in sorted(self._owned[p] & self._tick_after_backlog):
                try:
                    offsets = self._end_reader.get_watermark_offsets(TopicPartition(topic, p), timeout=2)
                except KafkaException as exc:
                    offsets, error = None, _describe(exc)
                else:
                    error = "no answer within 2 s"
                if offsets is None:
                    self._log.warning("input_mark_failed", topic=topic, partition=p, error=error)
                    break
                ends[topic] = offsets[1]
            else:
                self._marks[p] = _InputMark(taken_at_ms, ends)
                taken.append(p)
        self._advance_marks(taken)

    def _restore_meta(self, p: int, value: bytes | None) -> None:
        meta = json.loads(value) if value else {}
        has_holds = False
        for topic, entry in meta.items():
            held = frozenset(entry["held"])
            has_holds = has_holds or bool(held)
            self._skip[(topic, p)] = (entry["position"], held)
        self._meta_has_holds[p] = has_holds

    # -- one batch -------------------------------------------------------------------------
    def _collect(self, stop: threading.Event) -> list[Message]:
        """Block until there is something to do, then take what is already fetched.

        `_buffer` starts with the records the last batch fetched but left unhandled (its
        transaction's handling time ran out): they come first, so each partition stays in
        order, and the consumer's position is already past them (no seek). A revoke drops
        a revoked partition's records from it (`_drop`); they were not committed, so the
        partition's next owner fetches them again.
        """
        consumer = self._consumer
        cfg = self.config
        if self._aborts_in_row > 1:
            stop.wait(min(cfg.abort_backoff_max_ms, cfg.abort_backoff_ms * 2 ** (self._aborts_in_row - 2)) / 1000)
        while (
            not stop.is_set()
            and not self._buffer
            and not self._redeliver
            and not self._to_restore
            and self._finished.empty()
        ):
            until_tick = self._next_tick - time.monotonic()
            if until_tick <= 0:
                break
            # A worker's finished work cannot interrupt a blocking poll (librdkafka's queue
            # yield / IO-event wake-up is not exposed by confluent-kafka; its maintainers
            # advise a short timeout instead), so while work is in flight the loop polls in
            # short slices and notices a result within `work_poll_ms`. A record arriving
            # ends any poll at once; with no work in flight the loop blocks longer and idles.
            wait_ms = cfg.work_poll_ms if self._work else cfg.idle_poll_ms
            msg = consumer.poll(min(wait_ms / 1000, until_tick))
            self._check_fatal()
            if msg is not None:
                self._buffer.append(msg)
        # Serve the consumer on every batch, also one that only hands in finished work: its
        # callbacks (a rebalance, a fatal error such as FENCED_INSTANCE_ID) run only inside
        # poll/consume. After a broker restart a member's membership can be gone (its session
        # expired, or it was fenced); until the consumer has served that, every commit fails on
        # the offsets (UNKNOWN_MEMBER_ID) and the aborted batch's outcomes come straight back
        # here. Without this a tool-gateway slot aborted 92,000 batches in four minutes in
        # `make chaos` (test_loop_membership_lost.py).
        deadline = time.monotonic() + cfg.batch_max_ms / 1000
        while len(self._buffer) < cfg.batch_max_messages:
            more = consumer.consume(cfg.batch_max_messages - len(self._buffer), timeout=0)
            self._check_fatal()
            self._buffer.extend(more)
            if not more or time.monotonic() >= deadline:
                break
        batch, self._buffer = self._buffer, []
        good = []
        for m in batch:
            err = m.error()
            if err is None:
                good.append(m)
            elif err.fatal() or err.code() == KafkaError._FATAL:
                # A consumer's fatal error (e.g. FENCED_INSTANCE_ID: another member took this
                # static id) comes as an error event with code _FATAL, its fatal() flag unset.
                raise FatalLoopError(f"consumer: {err.str()}")
            else:
                self._log.warning("consume_error", error=err.str())
        return good

    def _observe_arrival(self, msgs: list[Message], finished: list[_Finished]) -> None:
        now_s, now_mono = time.time(), time.monotonic()
        for m in msgs:
            kind, ts_ms = m.timestamp()
            if kind == TIMESTAMP_CREATE_TIME:
                self._input_age.observe(max(0.0, now_s - ts_ms / 1000))
        for f in finished:
            self._work_deliver.observe(now_mono - f.finished_at)

    def _take_finished(self) -> list[_Finished]:
        out, self._redeliver = self._redeliver, []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def _run_batch(self, stop: threading.Event) -> None:
        if self._to_restore:
            self._restore_pending()
        msgs = self._collect(stop)
        if self._to_restore:
            # Partitions were assigned while collecting: nothing is handled before their states
            # are restored (a record of one may already be here). Kept in order for the next batch.
            self._buffer = msgs + self._buffer
            return
        finished = [f for f in self._take_finished() if self._is_current(f)]
        tick_due = time.monotonic() >= self._next_tick and bool(self._owned)
        if not msgs and not finished and not tick_due:
            if time.monotonic() >= self._next_tick:
                self._next_tick = time.monotonic() + self.config.tick_interval_ms / 1000
            return

        batch = _Batch(now_ms=self._clock_ms())
        self._observe_arrival(msgs, finished)
        for m in msgs:
            # Where an abort rewinds to: every fetched record, handled or not, is fetched again.
            batch.first_offsets.setdefault((m.topic(), m.partition()), m.offset())
        snapshot = (
            dict(self._next),
            {tp: dict(h) for tp, h in self._holds.items()},
            dict(self._work),
            dict(self._meta_has_holds),
            dict(self._committed),
        )
        carried: list[Message] = []
        try:
            handling_started = time.monotonic()
            if self._txn:
                self._call(self._producer.begin_transaction)
            handling_ends = self._monotonic() + (
                self.config.transaction_timeout_ms * self.config.transaction_handling_share / 1000
            )

            def out_of_time() -> bool:
                return self._txn and self._monotonic() >= handling_ends

            for i, f in enumerate(finished):
                if i and out_of_time():
                    # Still held and in `_work`: delivered first in the next batch (and
                    # after an abort of this one, behind what this batch delivered).
                    self._redeliver = finished[i:] + self._redeliver
                    break
                self._deliver(batch, f)
            for i, m in enumerate(msgs):
                if (i or finished) and out_of_time():
                    carried = msgs[i:]
                    break
                self._handle_record(batch, m)
            if tick_due and (msgs or finished) and out_of_time():
                tick_due = False  # still due: the next batch runs it
            if tick_due:
                self._tick(batch)
            deferred = self._may_defer_commit(batch, finished)
            if deferred:
                # Nothing changed: the empty transaction ends without a request (librdkafka sends
                # no EndTxn when nothing was registered), and the offsets wait for the next commit.
                if self._txn:
                    self._call(lambda: self._producer.commit_transaction(30))
            else:
                self._before_commit()
                self._checkpoint(batch)
                self._handle_seconds.observe(time.monotonic() - handling_started)
                self._commit(batch)
        except _AbortBatch as exc:
            # Finished work taken for this batch but not reached when it aborted (behind a poison
            # outcome that produce() refused mid-delivery, or a failed begin_transaction) is in
            # neither `batch.delivered` nor `_redeliver`: put it back, or it was lost, its input
            # held and its key in `_work` for good.
            taken = {id(f) for f in batch.delivered} | {id(f) for f in self._redeliver}
            self._redeliver = [f for f in finished if id(f) not in taken] + self._redeliver
            self._abort(batch, snapshot, exc)
            return
        self._aborts_in_row = 0
        for origin in batch.poisoned:
            self._poison.pop(origin, None)  # dead-lettered in a committed batch
        if batch.blocked:
            self._block(batch.blocked)
        if carried:
            # Not committed (the offsets sent stop before them): the next batch handles them.
            self._buffer = carried
            CARRIED.labels(self._name).inc(len(carried))
            self._log.info("batch_cut_short", handled=len(msgs) - len(carried), carried=len(carried),
                           transaction_timeout_ms=self.config.transaction_timeout_ms)
        if self._store is not None and batch.checkpointed:
            self._store.put_many(batch.checkpointed)  # committed: now the store may show them
        if tick_due:
            self._next_tick = time.monotonic() + self.config.tick_interval_ms / 1000
        # Committed: only now may the decided work start (in fair order across tenants).
        committed_at = time.monotonic()
        for w in batch.starts:
            w.committed_at = committed_at
            self._pool.put(w.tenant_id, w)
        WORK_IN_FLIGHT.labels(self._name).set(len(self._work))
        WORK_WAITING.labels(self._name).set(len(self._pool))
        BATCHES.labels(self._name, "deferred" if deferred else "committed").inc()
        if self._marks:
            self._advance_marks()
        if self._marks_wanted:
            self._take_marks()

    def _may_defer_commit(self, batch: _Batch, finished: list[_Finished]) -> bool:
        """Whether this batch may end without committing its offsets (`noop_commit_ms`): nothing
        was produced (outputs, dead letters), put, started or delivered; records that reached a
        handler only on an exactly-once loop without `before_commit`; and the last commit is recent."""
        interval = self.config.noop_commit_ms
        handled_ok = batch.decoded == 0 or (self._txn and getattr(self.processor, "before_commit", None) is None)
        return (
            interval > 0
            and not finished
            and handled_ok
            and batch.produced == 0
            and not batch.states
            and not batch.starts
            and time.monotonic() - self._last_commit_at < interval / 1000
        )

    def _before_commit(self) -> None:
        # Optional hook for at-least-once processors with external effects (the projector's
        # database): flush the batch's effects before its input offsets commit. An exception
        # stops the loop with nothing committed, so the batch is replayed after the restart.
        hook = getattr(self.processor, "before_commit", None)
        if hook is not None:
            hook()

    def _is_current(self, f: _Finished) -> bool:
        w = self._work.get(f.key)
        return w is not None and w.epoch == f.epoch and self._epoch.get(w.partition, 0) == f.epoch

    def _work_thread(self) -> None:
        while (w := self._pool.get()) is not None:
            self._run_work(w)

    def _run_work(self, w: _Work) -> None:
        with self._work_lock:
            # Cancelled by a revoke, or its partition dropped since (lost, aborted restore):
            # the partition's owner now runs it, this instance must not.
            if w.cancelled or self._epoch.get(w.partition, 0) != w.epoch:
                return
            w.running = True
        self._work_start.observe(time.monotonic() - w.committed_at)
        try:
            self._finished.put(_Finished(w.key, w.epoch, result=w.fn()))
        except BaseException as exc:  # the processor decides what a failure means
            self._finished.put(_Finished(w.key, w.epoch, error=exc))

    # -- handling ---------------------------------------------------------------------------
    def _deliver(self, batch: _Batch, f: _Finished) -> None:
        w = self._work.pop(f.key)
        batch.delivered.append(f)
        batch.touched.add(w.partition)
        if w.origin is not None:
            self._release_hold(w.origin, w.origin_offset)
        origin: _Origin = ("work", w.partition, w.key, w.epoch)
        poison = self._poison.get(origin)
        if poison is not None:
            # Its outcome's effects can never be produced (an aborted attempt of this batch found
            # them too large): dead-lettered instead, as if on_work_done had raised.
            self._dead_letter_work(batch, w, *poison)
            batch.poisoned.append(origin)
            WORK_DONE.labels(self._name, "dead_lettered").inc()
            return
        done = WorkDone(w.key, w.run_id, w.tenant_id, w.partition, result=f.result, error=f.error)
        unit = _Unit(origin=origin)
        ctx = _Ctx(self, batch, unit, w.partition, w.origin, w.origin_offset)
        try:
            self.processor.on_work_done(done, ctx)
        except Unprocessable as exc:
            self._dead_letter_work(batch, w, exc.reason, exc.detail)
            WORK_DONE.labels(self._name, "dead_lettered").inc()
            return
        except Exception as exc:
            self._handler_failed(exc, work=w.key)
            self._dead_letter_work(batch, w, "HANDLER_ERROR", _describe(exc))
            WORK_DONE.labels(self._name, "dead_lettered").inc()
            return
        self._apply(batch, unit)
        WORK_DONE.labels(self._name, "error" if f.error is not None else "ok").inc()

    def _handle_record(self, batch: _Batch, m: Message) -> None:
        tp = (m.topic(), m.partition())
        offset = m.offset()
        if m.partition() not in self._owned:
            return  # revoked while collecting
        if tp in self._blocked or tp in batch.blocked:
            return  # behind a record this build cannot read: not consumed (fetched before the pause)
        batch.first_offsets.setdefault(tp, offset)
        batch.touched.add(m.partition())
        self._next[tp] = offset + 1
        skip = self._skip.get(tp)
        if skip is not None:
            position, held = skip
            if offset >= position:
                del self._skip[tp]
            elif offset not in held:
                # Handled in a committed transaction before a failover; only held inputs replay.
                RECORDS.labels(self._name, m.topic(), "skipped_replay").inc()
                return
        wanted = self._wanted.get(m.topic())
        if wanted is not None:
            event_type = header_event_type(m.headers())
            if event_type is not None and event_type not in wanted:
                RECORDS.labels(self._name, m.topic(), "passed_over").inc()
                return
        batch.decoded += 1
        origin: _Origin = ("record", m.topic(), m.partition(), offset)
        poison = self._poison.get(origin)
        if poison is not None:
            # Its outputs or state can never be produced (an aborted attempt of this batch found
            # them too large): dead-lettered instead of handled, as if its handler had raised.
            self._dead_letter(batch, m, *poison)
            batch.poisoned.append(origin)
            return
        try:
            envelope = self._codec.decode_value(m.value() or b"")
            payload = open_payload(envelope)
        except SerdeError as exc:
            if exc.reason in self.config.fail_on_decode_errors:
                # Not consumed: the offsets this batch commits stop before it.
                self._next[tp] = offset
                batch.blocked[tp] = (offset, exc.reason, exc.detail)
                return
            self._dead_letter(batch, m, exc.reason, exc.detail)
            return
        unit = _Unit(origin=origin)
        ctx = _Ctx(self, batch, unit, m.partition(), tp, offset)
        try:
            self.processor.handle(Inbound(m.topic(), m.partition(), offset, envelope, payload), ctx)
        except Unprocessable as exc:
            self._dead_letter(batch, m, exc.reason, exc.detail)
            return
        except Exception as exc:
            self._handler_failed(exc, topic=m.topic(), partition=m.partition(), offset=offset)
            self._dead_letter(batch, m, "HANDLER_ERROR", _describe(exc))
            return
        self._apply(batch, unit)
        batch.handled += 1
        RECORDS.labels(self._name, m.topic(), "handled").inc()

    def _tick(self, batch: _Batch) -> None:
        origin: _Origin = ("tick",)
        poison = self._poison.get(origin)
        if poison is not None:
            # Its effects can never be produced (too large) and there is no record to dead-letter:
            # dropped, as when on_tick raises; the next tick runs again.
            self._log.error("tick_dropped", reason=poison[0], detail=poison[1][:500])
            batch.poisoned.append(origin)
            return
        unit = _Unit(origin=origin)
        try:
            self.processor.on_tick(_TickCtx(self, batch, unit))
        except Exception as exc:
            # A tick has no record to dead-letter; drop its effects, the next tick retries.
            self._handler_failed(exc, tick=True)
            return
        self._apply(batch, unit)
        self._update_lag()

    def _handler_failed(self, exc: Exception, **where: Any) -> None:
        self._log.error("handler_failed", error=_describe(exc), traceback=traceback.format_exc(), **where)
        if self.config.handler_errors == "fail":
            raise FatalLoopError(f"handler failed: {_describe(exc)}") from exc

    def _apply(self, batch: _Batch, unit: _Unit) -> None:
        for topic, partition, key, value, headers in unit.outputs:
            self._produce(topic, partition, key, value, headers, origin=unit.origin, reason="OUTPUT_TOO_LARGE")
            batch.produced += 1
        for (p, run_id), state in unit.states.items():
            batch.states[(p, run_id)] = state
            batch.touched.add(p)
            if unit.origin is not None:
                batch.state_puts.setdefault((p, run_id), []).append((unit.origin, state))
        for w in unit.starts:
            if w.key in self._work:
                continue
            self._work[w.key] = w
            batch.starts.append(w)
            if w.origin is not None:
                holds = self._holds.setdefault(w.origin, {})
                holds[w.origin_offset] = holds.get(w.origin_offset, 0) + 1

    def _release_hold(self, tp: TP, offset: int | None) -> None:
        holds = self._holds.get(tp)
        if not holds or offset not in holds:
            return
        holds[offset] -= 1
        if holds[offset] <= 0:
            del holds[offset]

    # -- dead letters -----------------------------------------------------------------------
    def _dead_letter(self, batch: _Batch, m: Message, reason: str, detail: str) -> None:
        detail = _redacted(detail)
        headers = list(m.headers() or []) + [
            (DLQ_REASON, reason.encode()),
            (DLQ_DETAIL, detail[:2000].encode()),
            (DLQ_SERVICE, self._name.encode()),
            (DLQ_TOPIC, m.topic().encode()),
            (DLQ_PARTITION, str(m.partition()).encode()),
            (DLQ_OFFSET, str(m.offset()).encode()),
        ]
        self._produce_dead_letter(m.partition(), m.key(), m.value(), headers)
        batch.produced += 1
        batch.dead_lettered.append(reason)
        RECORDS.labels(self._name, m.topic(), "dead_lettered").inc()
        self._log.warning("dead_lettered", reason=reason, detail=detail[:500], topic=m.topic(),
                          partition=m.partition(), offset=m.offset())

    def _dead_letter_work(self, batch: _Batch, w: _Work, reason: str, detail: str) -> None:
        detail = _redacted(detail)
        headers = [
            (DLQ_REASON, reason.encode()),
            (DLQ_DETAIL, detail[:2000].encode()),
            (DLQ_SERVICE, self._name.encode()),
            (DLQ_WORK_KEY, w.key.encode()),
            ("tether-tenant", w.tenant_id.encode()),
            ("tether-run", w.run_id.encode()),
        ]
        self._produce_dead_letter(w.partition, w.run_id.encode(), None, headers)
        batch.produced += 1
        batch.dead_lettered.append(reason)
        self._log.warning("work_dead_lettered", reason=reason, detail=detail[:500], key=w.key)

    def _produce_dead_letter(self, partition: int, key: bytes | None, value: bytes | None,
                             headers: list[tuple[str, bytes]]) -> None:
        try:
            self._produce(self._dead_letters, partition, key, value, headers)
        except _PoisonBatch:
            # An input just under its topic's limit plus the dead-letter headers can be over the
            # producer's: the dead letter goes without the value (its topic, partition and offset
            # still name the original) instead of failing the batch over and over.
            omitted = (DLQ_VALUE_OMITTED, str(len(value or b"")).encode())
            self._produce(self._dead_letters, partition, key, None, [*headers, omitted])

    # -- commit -----------------------------------------------------------------------------
    def _checkpoint(self, batch: _Batch) -> None:
        """Produce the batch's state changes and the loop's replay bookkeeping to the changelog."""
        codec = self.processor.state_codec
        for (p, run_id), state in batch.states.items():
            if p not in self._owned:
                continue
            if state is not None and codec is None:
                raise FatalLoopError(f"{self._name} put state but has no state_codec")
            value = None if state is None else codec.encode(state)
            puts = batch.state_puts.get((p, run_id))
            try:
                self._produce(self._changelog, p, run_id.encode(), value, None,
                              origin=puts[-1][0] if puts else None, reason="STATE_TOO_LARGE")
            except _PoisonBatch as exc:
                if exc.origin is not None:
                    exc.origin = self._blame_state(batch, p, run_id, self._producer_max_message_bytes(), 0)
                raise
            batch.checkpointed.append((p, run_id, state, value))
        for p in sorted(batch.touched):
            if p not in self._owned:
                continue
            meta = {}
            for topic in self._owned[p]:
                entry = self._meta_entry((topic, p))
                if entry is not None:
                    meta[topic] = entry
            has_holds = any(entry["held"] for entry in meta.values())
            if has_holds or self._meta_has_holds.get(p, False):
                self._produce(self._changelog, p, LOOP_META_KEY, json.dumps(meta).encode(), None)
                self._meta_has_holds[p] = has_holds

    def _meta_entry(self, tp: TP) -> dict[str, Any] | None:
        """Which inputs of `tp` at or above the committed offset a failover must replay."""
        nxt = self._next.get(tp)
        holds = set(self._holds.get(tp, {}))
        skip = self._skip.get(tp)
        if skip is not None:
            # Still replaying after a restore: keep the restored knowledge of what lies ahead.
            position, held = skip
            ahead = {o for o in held if nxt is None or o >= nxt}
            return {"position": max(position, nxt or 0), "held": sorted(holds | ahead)}
        if nxt is None:
            return None
        return {"position": nxt, "held": sorted(holds)}

    def _offsets_to_commit(self) -> list[TopicPartition]:
        out = []
        for tp, nxt in self._next.items():
            holds = self._holds.get(tp)
            offset = min(holds) if holds else nxt
            if self._committed.get(tp) != offset:
                out.append(TopicPartition(tp[0], tp[1], offset))
        return out

    def _commit(self, batch: _Batch) -> None:
        offsets = self._offsets_to_commit()
        started = time.monotonic()
        if self._txn:
            if offsets:
                meta = self._consumer.consumer_group_metadata()
                self._call(lambda: self._producer.send_offsets_to_transaction(offsets, meta, 30))
            self._call(lambda: self._producer.commit_transaction(30))
            self._producer.poll(0)  # serve delivery reports so they never pile up
        else:
            remaining = self._producer.flush(30)
            if remaining or self._delivery_errors:
                errs = [e.str() for e in self._delivery_errors]
                raise FatalLoopError(f"at-least-once delivery failed ({remaining} unsent): {errs[:3]}")
            if offsets:
                # Flushed already, so committing the same offsets again is safe. A broker restart
                # answers COORDINATOR_LOAD_IN_PROGRESS for a while: in `make chaos` the projector
                # exited on it (and replayed its batch after the restart) instead of waiting.
                self._retry_while_broker_away(
                    "offset_commit", lambda: self._consumer.commit(offsets=offsets, asynchronous=False),
                    retriable=lambda err: err.retriable() or err.code() in _COMMIT_RETRIABLE)
        COMMIT_SECONDS.labels(self._name).observe(time.monotonic() - started)
        self._count_dead_letters(batch)
        self._last_commit_at = time.monotonic()
        for tp in offsets:
            self._committed[(tp.topic, tp.partition)] = tp.offset

    def _count_dead_letters(self, batch: _Batch) -> None:
        for reason in batch.dead_lettered:
            DEAD_LETTERS.labels(self._name, reason).inc()
        batch.dead_lettered.clear()

    def _abort(self, batch: _Batch, snapshot: tuple, exc: _AbortBatch) -> None:
        poison_found = isinstance(exc, _PoisonBatch) and exc.origin is not None
        if not self._txn:
            self._count_dead_letters(batch)  # produced without a transaction: they stay in the log
        if not self._txn and not poison_found:
            raise FatalLoopError(f"at-least-once batch failed: {exc}") from exc
        self._log.warning("batch_aborted", error=str(exc))
        BATCHES.labels(self._name, "aborted").inc()
        self._aborts_in_row += 1
        if self._txn:
            generation = self._producer_generation
            self._abort_transaction()
            # The delivery reports of what the abort purged or the broker refused (`_refused`).
            self._producer.poll(0)
            refused = bool(self._refused) or (exc.kafka_error is not None and exc.kafka_error.code() in _TOO_LARGE)
            if refused and self._producer_generation == generation:
                # The records the broker refused took sequence numbers it never wrote, and librdkafka
                # aborts a refusal without bumping the epoch, so it keeps counting from them: the
                # replay's first produce to each refused partition is out of sequence ("skipped
                # sequence numbers", OUT_OF_ORDER_SEQUENCE_NUMBER). When that hits a transaction
                # already failing (a second refused partition), librdkafka holds the records back for
                # an epoch bump and commit_transaction waits for them until message.timeout.ms (=
                # transaction.timeout.ms): the coordinator's own timeout of that transaction, if it
                # comes first, fences the producer (a fatal `_FENCED`, which failed a CI run of
                # test_loop_poison_records.py). A new producer's init_transactions bumps the epoch and
                # starts every partition's sequence afresh: the replay commits at once.
                self._replace_producer(why="the broker refused records as too large: their sequence numbers are spent")
        # At least once, a poison record's batch is replayed without a transaction to abort: what
        # it produced before stays, and is produced again (duplicates, which at least once allows).
        self._poison.update(self._find_poison(batch, exc))
        # The batch's state changes never reached the store; forget the decoded states too, in
        # case a handler changed one in place, so the replay reads the committed bytes.
        if self._store is not None:
            self._store.forget_decoded()
        self._next, self._holds, self._work, self._meta_has_holds, self._committed = snapshot
        self._redeliver = batch.delivered + self._redeliver
        for (topic, partition), offset in batch.first_offsets.items():
            if partition in self._owned and (topic, partition) not in self._blocked:
                self._consumer.seek(TopicPartition(topic, partition, offset))

    def _find_poison(self, batch: _Batch, exc: _AbortBatch) -> dict[_Origin, tuple[str, str]]:
        """The handler calls whose outputs or checkpoint can never be produced, with the reason
        and detail of their dead letters: the one whose record produce() refused (`exc`) and
        those whose records the broker refused as too large for their topic. A broker refusal
        covers every record of the request, so only a record larger than the topic's
        `max.message.bytes` even alone is blamed; if none is (a batch of records together over
        it), nothing is, and the batch is replayed as after any abort."""
        found: dict[_Origin, tuple[str, str]] = {}
        if isinstance(exc, _PoisonBatch) and exc.origin is not None:
            found[exc.origin] = (exc.reason, exc.detail)
        refused, self._refused = self._refused, []
        limits: dict[str, int | None] = {}
        for origin, reason, topic, partition, key, size, err in refused:
            if topic not in limits:
                limits[topic] = self._topic_max_message_bytes(topic)
            limit = limits[topic]
            if limit is None or size + _BATCH_OVERHEAD <= limit:
                continue
            if reason == "STATE_TOO_LARGE" and (partition, key.decode()) in batch.state_puts:
                origin = self._blame_state(batch, partition, key.decode(), limit, _BATCH_OVERHEAD)
            if origin in found:
                continue
            found[origin] = (reason, f"{_WHAT_TOO_LARGE.get(reason, 'record')} of {size} bytes to {topic}[{partition}] "
                                     f"refused by the broker: {err.str()} ({err.name()}; the topic's "
                                     f"max.message.bytes is {limit})")
        if refused and not found:
            self._log.error("records_refused_too_large_unattributed", topics=sorted(limits), limits=limits,
                            records=len(refused),
                            hint="no record alone exceeds its topic's max.message.bytes: the producer's "
                                 "message.max.bytes / batch.size should not exceed it")
        for origin, (reason, detail) in found.items():
            self._log.warning("poison_record_found", origin=list(origin), reason=reason, detail=detail[:500])
        return found

    def _blame_state(self, batch: _Batch, p: int, run_id: str, limit: int | None, overhead: int) -> _Origin:
        """The handler call whose put made run `run_id`'s state too large to checkpoint: the
        batch's first put of an encoded state over `limit` (later puts carried it on; without
        that call they start from the state before it). The last put if none can be told."""
        puts = batch.state_puts[(p, run_id)]
        codec = self.processor.state_codec
        if limit is not None and codec is not None:
            for origin, state in puts:
                if state is not None and len(run_id) + len(codec.encode(state)) + overhead > limit:
                    return origin
        return puts[-1][0]

    def _producer_max_message_bytes(self) -> int:
        return int(self.config.producer_overrides.get("message.max.bytes", 1_000_000))

    def _topic_max_message_bytes(self, topic: str) -> int | None:
        """The broker's limit for one record batch of `topic` (asked each time: rare, and an
        operator may raise it); None if it cannot be read now."""
        overrides = self.config.producer_overrides
        conf = {"bootstrap.servers": self.config.bootstrap,
                **{k: v for k, v in overrides.items() if k.startswith(("security.", "sasl.", "ssl."))}}
        try:
            admin = AdminClient(conf)  # referenced until the answer is in: its futures die with it
            resource = ConfigResource(ResourceType.TOPIC, topic)
            future = admin.describe_configs([resource], request_timeout=10)[resource]
            return int(future.result(timeout=15)["max.message.bytes"].value)
        except Exception as exc:  # noqa: BLE001 - unknown limit: blame nothing, replay as after any abort
            self._log.warning("topic_limit_unknown", topic=topic, error=_describe(exc))
            return None

    def _abort_transaction(self) -> None:
        """Abort the open transaction, retrying while the broker is away (a restart): an abort
        that times out may be called again (librdkafka), and exiting on the first timeout made
        services crash-loop through every broker restart in `make chaos`."""
        def abort() -> None:
            try:
                with self._watched():
                    self._producer.abort_transaction(30)
            except KafkaException as exc:
                err = exc.args[0]
                if not (err.fatal() and err.code() == KafkaError.INVALID_TXN_STATE):
                    raise
                # librdkafka can fail an abort with a fatal INVALID_TXN_STATE although nothing
                # else holds this transactional id (confluentinc/librdkafka#4849, open; CI hit it
                # once in this loop's abort test). The producer is then unusable, but the
                # transaction needs no more than what a restart would do: a new producer's
                # init_transactions bumps the epoch and aborts it. Doing that here keeps the
                # slot's partitions, states and queued work instead of exiting. A fenced producer
                # (a newer instance of the slot) fails with other codes and still exits.
                self._replace_producer(why=err.str())

        self._retry_while_broker_away("abort_transaction", abort, retriable=lambda err: err.retriable())

    def _replace_producer(self, why: str) -> None:
        """Swap the current transactional producer (fatally failed, or with sequence numbers the
        broker never saw) for a new one with the same transactional id, whose init_transactions
        fences the old one, aborts its open transaction, if any, and starts every partition's
        sequence at 0. Raises FatalLoopError if that fails (fenced by a newer instance: exit)."""
        old = self._producer
        self._producer_generation += 1
        if self._fatal is not None and self._fatal.code() == KafkaError.INVALID_TXN_STATE:
            # The replaced producer's own report of the failure being handled (only a
            # transactional producer reports this code, never a consumer).
            self._fatal = None
        self._log.warning("producer_replacing", why=why, transactional_id=self.transactional_id)
        try:
            # Whatever the old one still queues belongs to the aborted transaction.
            old.purge(in_queue=True, in_flight=True, blocking=False)
        except (KafkaException, RuntimeError) as exc:
            self._log.info("replaced_producer_purge_failed", error=_describe(exc))
        self._producer = Producer(self._producer_config())
        self._call(lambda: self._producer.init_transactions(30))
        PRODUCERS_REPLACED.labels(self._name).inc()
        self._log.warning("producer_replaced", transactional_id=self.transactional_id)

    def _retry_while_broker_away(self, what: str, fn: Callable[[], Any],
                                 retriable: Callable[[KafkaError], bool]) -> None:
        """Call `fn` until it succeeds, retrying errors `retriable` accepts for up to
        `abort_retry_s` (a broker restart); a fatal or other error, or one past the deadline,
        ends the loop (FatalLoopError: the supervisor restarts the process)."""
        deadline = time.monotonic() + self.config.abort_retry_s
        attempt = 0
        while True:
            attempt += 1
            try:
                fn()
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal() or not retriable(err) or time.monotonic() > deadline:
                    raise FatalLoopError(f"{what} failed: {err.str()}") from exc
                self._log.info(f"{what}_retry", error=err.str(), attempt=attempt)
                time.sleep(min(0.1 * 2**attempt, 2))

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run a transactional producer call: retry retriable errors, abort the batch on
        abortable ones, exit on fatal ones (fenced by a newer instance of this slot)."""
        for attempt in range(1, 11):
            try:
                with self._watched():
                    return fn()
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal():
                    raise FatalLoopError(f"fatal transaction error: {err.str()}") from exc
                if err.txn_requires_abort():
                    raise _AbortBatch(err.str(), err) from exc
                if err.retriable() and attempt < 10:
                    self._log.info("txn_retry", error=err.str(), attempt=attempt)
                    time.sleep(min(0.05 * 2**attempt, 2))
                    continue
                raise FatalLoopError(f"transaction error: {err.str()}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    @contextmanager
    def _watched(self) -> Iterator[None]:
        """Mark a transactional call in progress for the watchdog."""
        self._txn_call_started = time.monotonic()
        try:
            yield
        finally:
            self._txn_call_started = None

    def _start_watchdog(self) -> None:
        def watch() -> None:
            limit = self.config.txn_call_hang_s
            while not self._watchdog_stop.wait(min(1.0, limit / 4)):
                started = self._txn_call_started
                if started is not None and time.monotonic() - started > limit:
                    # The call is stuck inside librdkafka, holding the loop thread: no exception
                    # can reach it. Exiting is what a SIGKILL does, which the loop recovers from.
                    self._log.critical("transactional_call_hung", seconds=round(time.monotonic() - started, 1),
                                       limit_s=limit, transactional_id=self.transactional_id)
                    self._hard_exit(1)
                    return

        threading.Thread(target=watch, name=f"{self._name}-txn-watchdog", daemon=True).start()

    def _produce(self, topic: str, partition: int, key: bytes | None, value: bytes | None,
                 headers: list[tuple[str, bytes]] | None, *, origin: _Origin | None = None,
                 reason: str = "RECORD_TOO_LARGE") -> None:
        """Produce one record. `origin`: the handler call whose effect it is, blamed (`reason`)
        if the record is too large ever to be produced: a refusal here raises `_PoisonBatch`,
        one by the broker is seen in the delivery report (`_on_txn_delivery`)."""
        kwargs: dict[str, Any] = {}
        if origin is not None and self._txn:
            kwargs["on_delivery"] = partial(self._on_txn_delivery, origin, reason)
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, partition=partition, headers=headers, **kwargs)
                return
            except BufferError:
                self._producer.poll(0.05)  # the local queue is full: let deliveries drain
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal():
                    raise FatalLoopError(f"produce: {err.str()}") from exc
                if err.code() in _TOO_LARGE:
                    # Deterministic: the same record is refused however often it is produced.
                    size = len(key or b"") + len(value or b"") + sum(len(k) + len(v or b"") for k, v in headers or ())
                    detail = (f"{_WHAT_TOO_LARGE.get(reason, 'record')} of {size} bytes to {topic}[{partition}] "
                              f"refused by the producer: {err.str()} ({err.name()})")
                    raise _PoisonBatch(origin, reason, detail) from exc
                raise _AbortBatch(f"produce: {err.str()}") from exc

    def _block(self, blocked: Mapping[TP, tuple[int, str, str]]) -> None:
        """Hold partitions at a record this build cannot decode, the records before it committed.

        The loop goes on with its other partitions and keeps the process (its metrics, /healthz)
        up, instead of exiting on it: an exit took the record's lag and every other series with
        it, and a restart (or the replica the partition moved to) met the record again and exited
        again, a crash loop nothing alerted on. Only a build that reads it resumes the partition.
        """
        for tp, (offset, reason, detail) in blocked.items():
            if tp[1] not in self._owned or tp in self._blocked:
                continue
            self._blocked[tp] = (offset, reason)
            try:
                self._consumer.pause([TopicPartition(tp[0], tp[1])])
            except KafkaException as exc:  # unassigned meanwhile: its records are skipped anyway
                self._log.warning("pause_failed", topic=tp[0], partition=tp[1], error=_describe(exc))
            BLOCKED.labels(self._name, tp[0], str(tp[1]), reason).set(1)
            self._log.error("partition_blocked", reason=reason, topic=tp[0], partition=tp[1], offset=offset,
                            detail=_redacted(detail)[:500],
                            action="the record and the rest of its partition are not consumed until a build that "
                                   "can decode it runs (upgrade, then restart); nothing was dead-lettered")
        self._update_lag()

    def _unblock(self, tps: Sequence[TP]) -> None:
        """Forget blocked partitions this loop no longer owns: their next owner meets the record
        itself (and exports its own series); a later assignment here fetches from the committed offset."""
        for tp in tps:
            _offset, reason = self._blocked.pop(tp)
            try:
                BLOCKED.remove(self._name, tp[0], str(tp[1]), reason)
            except KeyError:
                pass
            if self._consumer is not None:
                try:
                    # librdkafka keeps an application's pause across the revoke and a later assignment
                    # of the partition to this member, which would then never fetch it (test_loop_fail_on_decode_errors).
                    self._consumer.resume([TopicPartition(tp[0], tp[1])])
                except KafkaException:
                    pass  # already unassigned

    def _update_lag(self) -> None:
        for tp, nxt in list(self._next.items()):
            try:
                if tp in self._blocked:
                    # Paused: nothing is fetched, so the cached high watermark would stay where it was
                    # at the pause while the partition's backlog grows. One request per tick.
                    _low, high = self._consumer.get_watermark_offsets(TopicPartition(*tp), timeout=1)
                else:
                    _low, high = self._consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
            except KafkaException:
                continue
            if high is not None and high >= 0:
                LAG.labels(self._name, tp[0], str(tp[1])).set(max(0, high - nxt))

    def _shutdown(self) -> None:
        # Runs in a finally: nothing here may replace the error that ended the loop.
        # Closing the consumer revokes its partitions: after a graceful stop the revoke hands
        # running work over (bounded by revoke_drain_ms); after an error it only drops.
        self._handover_ok = sys.exc_info()[1] is None
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self._consumer is not None:
            # A dynamic member leaves the group: its partitions move now, not after the session
            # timeout. A static member stays (KIP-345): the same slot, restarted within the
            # session timeout, takes its partitions back without a rebalance.
            steps.append(("consumer_close", self._consumer.close))
        if self._restorer is not None:
            steps.append(("restorer_close", self._restorer.close))
        if self._end_reader is not None:
            steps.append(("end_reader_close", self._end_reader.close))
        if self._producer is not None:
            steps.append(("producer_flush", lambda: self._producer.flush(10)))
        if self._pool is not None:
            # Unfinished work is not waited for: its inputs are held, so the next owner replays them.
            # Closing the fair queue drops what waits and lets the worker threads end.
            steps.append(("pool_shutdown", self._pool.close))
        if self._store is not None:
            steps.append(("state_store_close", self._store.close))
        for what, step in steps:
            try:
                step()
            except Exception as exc:
                self._log.warning("shutdown_step_failed", step=what, error=_describe(exc))
        for tp, (_offset, reason) in self._blocked.items():
            try:
                BLOCKED.remove(self._name, tp[0], str(tp[1]), reason)
            except KeyError:
                pass
        self._watchdog_stop.set()
        self._log.info("loop_stopped")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _redacted(detail: str) -> str:
    """A dead letter's detail as the log line shows it: an exception's message may hold a secret.

    Redacted whole, before any cut, so a secret at a cut point cannot leave its first part behind.
    """
    return log_redactor().redact(detail)


def _origin_partition(origin: _Origin) -> int | None:
    """The partition a handler call belonged to (None for the tick)."""
    if origin[0] == "record":
        return origin[2]
    if origin[0] == "work":
        return origin[1]
    return None


def serve_processor(
    processor: Processor,
    settings: LoopServiceSettings,
    *,
    stop: threading.Event | None = None,
    start_up: Callable[[threading.Event], None] | None = None,
    **config_overrides: Any,
) -> int:
    """A processor service's whole main: logging, metrics/health server, signals, the loop.

    `start_up(stop)`, if given, runs once the health server is up and before the loop: the
    service's own start-up I/O (e.g. its database schema), which may wait for a dependency
    (`tether_runtime.startup.wait_for_dependency`) while /readyz says not ready.

    Returns the exit code (0 after SIGTERM/SIGINT, 1 when the loop or the start-up failed);
    use as ``raise SystemExit(serve_processor(MyProcessor(...), MySettings()))``.
    """
    from tether_runtime import logging as runtime_logging
    from tether_runtime.http import HealthServer
    from tether_runtime.service import run
    from tether_runtime.startup import StartupInterrupted

    runtime_logging.configure(processor.name, settings.log_level, instance=settings.instance_id)
    loop = ProcessorLoop(processor, LoopConfig.from_settings(settings, **config_overrides))
    health = HealthServer(host=settings.http_host, port=settings.metrics_port, ready=lambda: loop.ready)

    def main(stop_event: threading.Event) -> int:
        health.start()
        try:
            if start_up is not None:
                try:
                    start_up(stop_event)
                except StartupInterrupted:
                    return 0
            loop.run(stop_event)
        finally:
            health.stop()
        return 0

    return run(main, stop=stop)
