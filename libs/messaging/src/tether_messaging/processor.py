"""The port between a service's handlers and the exactly-once loop that drives them.

A service implements `Processor`; `tether_messaging.loop` (Kafka, transactional) and
`tether_messaging.testing` (in memory, for unit tests) both drive it through `Context`.
Everything a handler does goes through the context, so the loop can commit it atomically:
emitted records, per-run state checkpoints, and the input offsets.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel

from tether_contracts.base import AvroRecord
from tether_contracts.records import Envelope

S = TypeVar("S", bound=BaseModel)


@dataclass(frozen=True)
class Inbound:
    """One decoded input record and where it came from."""

    topic: str
    partition: int
    offset: int
    envelope: Envelope
    payload: AvroRecord


@dataclass(frozen=True)
class WorkDone:
    """The outcome of slow work started with `Context.start_work`, delivered back to the loop.

    Exactly one of `result` / `error` is set. `key` is the key the work was started with.
    """

    key: str
    run_id: str
    tenant_id: str
    partition: int
    result: Any = None
    error: BaseException | None = None


class Context(Protocol):
    """What a handler may do. All of it is committed in one transaction, or none of it."""

    @property
    def now_ms(self) -> int:
        """The loop's clock for this batch, to be *recorded* in events (decisions use recorded values)."""
        ...

    @property
    def partition(self) -> int:
        """Partition of the record (or finished work) being handled; outputs go to the same partition."""
        ...

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
        """Produce `payload` wrapped in a fresh (unsequenced) envelope to `topic`, same partition."""
        ...

    def emit_envelope(self, topic: str, envelope: Envelope) -> None:
        """Produce a ready-made envelope (the sequencer uses this for sealed log events)."""
        ...

    def get_state(self, run_id: str) -> Any | None:
        """The run's state as last put (or restored from the changelog), or None."""
        ...

    def put_state(self, run_id: str, state: Any | None) -> None:
        """Replace the run's state; None deletes it (tombstone). Checkpointed with the outputs."""
        ...

    def start_work(self, key: str, run_id: str, tenant_id: str, fn: Callable[[], Any]) -> None:
        """Run `fn` off the loop thread (model call, tool execution). Idempotent on `key`:
        starting a key that is already running is ignored. The input being handled is not
        committed past until the work is done and `Processor.on_work_done` has handled it."""
        ...


class StateCodec(Protocol, Generic[S]):
    """How a service's per-run state is written to and read from its changelog topic."""

    def encode(self, state: S) -> bytes: ...

    def decode(self, data: bytes) -> S: ...


class PydanticStateCodec(Generic[S]):
    """Changelog codec for a pydantic state model (JSON; the changelog is private to its service)."""

    def __init__(self, model: type[S]) -> None:
        self.model = model

    def encode(self, state: S) -> bytes:
        return state.model_dump_json().encode()

    def decode(self, data: bytes) -> S:
        return self.model.model_validate_json(data)


class Processor(Protocol):
    """A service's stream processor."""

    #: Service name: consumer group id, transactional id prefix, changelog topic name.
    name: str
    #: Topics consumed.
    inputs: Sequence[str]
    #: Codec for per-run state, or None if the service keeps no per-run state.
    state_codec: StateCodec[Any] | None

    def handle(self, msg: Inbound, ctx: Context) -> None:
        """Handle one input record. Raise `tether_messaging.errors.Unprocessable` for a record
        that can never be handled (it goes to the dead-letter topic with the reason)."""
        ...

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        """Handle the outcome of work started with `Context.start_work`."""
        ...

    def on_tick(self, ctx: TickContext) -> None:
        """Called periodically (about once a second) for timers such as approval expiry."""
        ...


class EventFilter(Protocol):
    """What a processor that acts on a few event types adds to `Processor` (optional).

    The run event log carries every service's events; decoding the ones a service ignores cost
    the approval service ≈ 40% of its CPU in the bench. With `event_types` the loop reads a
    record's `tether-event-type` header and passes over (without decoding, dead-lettering or
    calling `handle`) the records of a listed topic whose type is not in the topic's set; a
    record without the header (another writer's) is decoded and handled as before. Offsets and
    replay bookkeeping are unchanged: a passed-over record counts as handled.
    """

    #: Topic → the Avro names (`AVRO_NAME`) of the payloads `handle` acts on. Topics not listed
    #: are handled in full.
    event_types: Mapping[str, frozenset[str]]


class RunTimers(Protocol):
    """What a processor with per-run timers adds to `Processor` (optional: the loop looks for it).

    The loop keeps each run's wake time in an index beside its stored state, so a tick visits
    only the runs whose timer is due (`TickContext.runs_due`), not every run it holds: a run
    parked for days costs nothing per tick. A processor without `wake_at_ms` has every run due
    on every tick.
    """

    def wake_at_ms(self, state: Any) -> int | None:
        """The earliest clock value (ms) at which `on_tick` may have something to do for a run in
        `state`, or None if nothing until the state changes. A pure function of the state: the
        loop calls it when a state is put and again when it restores states from the changelog.

        Early is harmless (the tick checks and finds nothing); late delays the timer. A run
        stays due on every tick until a put gives it a later wake time (or None), so the tick
        should put the state of each due run it acts on, and "always due" (e.g. 0) suits only
        states that are not idle (work in flight)."""
        ...


class BacklogBeforeTick(Protocol):
    """What a processor whose timers must not act on input they have not read adds (optional: the
    loop looks for it; only the approval service sets it).

    A timer that decides "nothing came in time" (an approval's expiry) must not decide against a
    record that did come in time and waits unread: after a restart or rebalance (the loop ticks as
    soon as it has restored the states, before it has read the input that piled up meanwhile), and
    while a running loop is behind its input (slow, or its fetches delayed). With
    `tick_after_backlog` the loop takes *marks* of those topics' partitions: the loop's clock, then
    their end offsets (high watermarks: a record appended behind another producer's open transaction
    counts, and is waited for until that transaction ends). The first, when it is assigned a
    partition, leaves the partition out of `TickContext.owned_partitions` until its input is
    handled up to it; later ones, taken when a tick asks, move
    `TickContext.inputs_read_through_ms` once the input is handled up to them.
    """

    #: Input topics (of `inputs`) whose backlog at assignment the tick of a partition waits for,
    #: and whose read-through time `TickContext.inputs_read_through_ms` gives.
    tick_after_backlog: Collection[str]


class TickContext(Context, Protocol):
    """Context for `on_tick`: the partitions this instance owns and the runs due in them."""

    def owned_partitions(self) -> Sequence[int]:
        """The partitions this instance owns and has restored; for a processor with
        `BacklogBeforeTick`, only those whose backlog at assignment it has handled."""
        ...

    def inputs_read_through_ms(self, partition: int) -> int:
        """For a processor with `BacklogBeforeTick`, of a partition `owned_partitions` shows: a clock
        time T (the loop's, as `now_ms`) such that every record appended to the partition's
        `tick_after_backlog` inputs by T has been handled (its effects are in the states this tick
        sees), or was aborted. T ≤ `now_ms`; it lags while the loop is behind its input (and while a
        transaction open at T has not ended), and never passes the append of a record not handled.

        Asking moves it: after the batch the loop takes a new mark of the partition (unless one is
        pending: at most one request per input partition per tick that asks), so a caught-up
        partition's T is about a tick old. A processor asks only for partitions whose timers are due."""
        ...

    def runs_due(self, partition: int) -> Sequence[str]:
        """Runs of the partition whose wake time (`RunTimers.wake_at_ms`) is at or before
        `now_ms`, earliest first; every run with state if the processor has no `wake_at_ms`."""
        ...

    def for_partition(self, partition: int) -> Context: ...
