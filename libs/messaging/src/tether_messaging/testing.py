"""An in-memory driver for a `Processor`, for unit tests: no sockets, deterministic clock and work.

It follows the loop's rules (outputs go to the input's partition, state per run, work keyed
and delivered back through `on_work_done`), but runs work synchronously when asked to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether_contracts.base import AvroRecord
from tether_contracts.records import Envelope
from tether_messaging.envelopes import make_envelope
from tether_messaging.processor import Inbound, Processor, WorkDone
from tether_messaging.serde import decode, encode
from tether_messaging.statestore import ALWAYS_DUE


@dataclass
class Emitted:
    topic: str
    partition: int
    envelope: Envelope

    @property
    def payload(self) -> AvroRecord:
        return decode(self.envelope.payload)


@dataclass
class _PendingWork:
    key: str
    run_id: str
    tenant_id: str
    partition: int
    fn: Callable[[], Any]


@dataclass
class InMemoryDriver:
    """Feeds records to a processor and collects what it emits.

    `now_ms` is the clock handlers see; tests move it explicitly.
    """

    processor: Processor
    producer_name: str = "test"
    now_ms: int = 1_700_000_000_000
    emitted: list[Emitted] = field(default_factory=list)
    states: dict[str, Any] = field(default_factory=dict)
    pending: dict[str, _PendingWork] = field(default_factory=dict)
    #: Run ids in the order handlers put their state: each put is a changelog write in the loop.
    puts: list[str] = field(default_factory=list)
    #: What ticks get from `TickContext.inputs_read_through_ms`. None: `now_ms` (everything fed has
    #: been handled); a test sets an earlier time to stand for a loop behind its input.
    inputs_read_through_ms: int | None = None
    _offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    # -- feeding -------------------------------------------------------------------------
    def feed(self, topic: str, envelope: Envelope, partition: int = 0) -> list[Emitted]:
        """Handle one envelope as if consumed from topic/partition; returns what it emitted."""
        offset = self._offsets.get((topic, partition), 0)
        self._offsets[(topic, partition)] = offset + 1
        msg = Inbound(topic, partition, offset, envelope, decode(envelope.payload))
        before = len(self.emitted)
        self.processor.handle(msg, _Ctx(self, partition))
        self._roundtrip_states()
        return self.emitted[before:]

    def feed_payload(
        self,
        topic: str,
        payload: AvroRecord,
        *,
        run_id: str,
        tenant_id: str = "t1",
        event_id: str | None = None,
        producer: str = "test",
        partition: int = 0,
    ) -> list[Emitted]:
        env = make_envelope(
            payload,
            run_id=run_id,
            tenant_id=tenant_id,
            event_id=event_id or f"{producer}:{run_id}:{len(self.emitted)}:{self._offsets.get((topic, partition), 0)}",
            producer=producer,
            recorded_at_ms=self.now_ms,
        )
        return self.feed(topic, env, partition)

    def run_work(self, key: str | None = None) -> list[Emitted]:
        """Run pending work (one key, or all) synchronously and deliver the outcomes."""
        before = len(self.emitted)
        keys = [key] if key is not None else list(self.pending)
        for k in keys:
            work = self.pending.pop(k)
            try:
                done = WorkDone(k, work.run_id, work.tenant_id, work.partition, result=work.fn())
            except Exception as exc:  # the loop delivers failures too
                done = WorkDone(k, work.run_id, work.tenant_id, work.partition, error=exc)
            self.processor.on_work_done(done, _Ctx(self, work.partition))
            self._roundtrip_states()
        return self.emitted[before:]

    def tick(self) -> list[Emitted]:
        before = len(self.emitted)
        self.processor.on_tick(_TickCtx(self, 0))
        self._roundtrip_states()
        return self.emitted[before:]

    def payloads(self, topic: str | None = None) -> list[AvroRecord]:
        return [e.payload for e in self.emitted if topic is None or e.topic == topic]

    def _roundtrip_states(self) -> None:
        # Every checkpoint must survive the changelog codec, as it must in production.
        codec = self.processor.state_codec
        if codec is None:
            return
        for run_id, state in list(self.states.items()):
            if state is not None:
                self.states[run_id] = codec.decode(codec.encode(state))


class _Ctx:
    def __init__(self, driver: InMemoryDriver, partition: int) -> None:
        self._d = driver
        self._partition = partition

    @property
    def now_ms(self) -> int:
        return self._d.now_ms

    @property
    def partition(self) -> int:
        return self._partition

    def emit(self, topic, payload, *, run_id, tenant_id, event_id, causation_id=None) -> Envelope:
        env = make_envelope(
            payload,
            run_id=run_id,
            tenant_id=tenant_id,
            event_id=event_id,
            producer=self._d.producer_name,
            recorded_at_ms=self._d.now_ms,
            causation_id=causation_id,
        )
        self.emit_envelope(topic, env)
        return env

    def emit_envelope(self, topic: str, envelope: Envelope) -> None:
        encode(envelope)  # fail fast on a record that would not serialise
        self._d.emitted.append(Emitted(topic, self._partition, envelope))

    def get_state(self, run_id: str) -> Any | None:
        return self._d.states.get(run_id)

    def put_state(self, run_id: str, state: Any | None) -> None:
        self._d.puts.append(run_id)
        if state is None:
            self._d.states.pop(run_id, None)
        else:
            self._d.states[run_id] = state

    def start_work(self, key: str, run_id: str, tenant_id: str, fn: Callable[[], Any]) -> None:
        if key not in self._d.pending:
            self._d.pending[key] = _PendingWork(key, run_id, tenant_id, self._partition, fn)


class _TickCtx(_Ctx):
    def owned_partitions(self) -> Sequence[int]:
        return [0]

    def runs_due(self, partition: int) -> Sequence[str]:
        # The loop's rule (a state's wake time from the processor's `wake_at_ms`, every run
        # without one), computed here from the states themselves.
        wake_at = getattr(self._d.processor, "wake_at_ms", None)
        due = []
        for run_id, state in self._d.states.items():
            wake = ALWAYS_DUE if wake_at is None else wake_at(state)
            if wake is not None and wake <= self._d.now_ms:
                due.append((wake, run_id))
        return [run_id for _, run_id in sorted(due)]

    def inputs_read_through_ms(self, partition: int) -> int:
        read_through = self._d.inputs_read_through_ms
        return self._d.now_ms if read_through is None else min(read_through, self._d.now_ms)

    def for_partition(self, partition: int) -> _Ctx:
        return _Ctx(self._d, partition)
