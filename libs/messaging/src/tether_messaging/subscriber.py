"""Follow Tether's topics from another team's service: a consumer group, committed records only, decoded events.

The services use the exactly-once loop (`tether_messaging.loop`); a team that only *reads* the
run event log (a dashboard, a billing feed, a search index) needs much less, and this is it
(docs/subscribing.md):

- one **consumer group** per subscribing application: start more instances with the same group
  id and Kafka shares the partitions among them (up to the partition count), moving them on a
  crash or a scale-in;
- `isolation.level=read_committed`: a record of an aborted or still open transaction is never
  delivered (the services write in transactions);
- **at-least-once**: a partition's committed offset moves past an event only once it was handled
  (in `run`, once `handler(event)` returned; with `poll()`, once `commit()` was called or the next
  `poll()` began), so a crash, a handler's exception or a rebalance redelivers at most the events
  not yet handled. A commit that meets a rebalance (the group's generation moving on) is not an
  error: the positions stay known handled and go with the next commit (or the revoke callback's),
  and a partition that moved meanwhile is read by its new owner from its last committed offset —
  events delivered again, never lost. An event is identified by (`run_id`, `seq`) on the run event
  log (by `event_id` on the other topics): store it with your effect, and a redelivery is harmless;
- events filtered by type using the `tether-event-type` header, without decoding the rest;
- **forward compatible**: an event whose payload schema this build does not know (a producer
  upgraded before you) is delivered with `payload=None` and its envelope (type, run, seq), not
  dropped and not fatal; a record that is not an envelope at all (or whose payload is not the
  event type its envelope names) raises `UndecodableRecord` naming where it is, or is skipped and
  counted with `skip_undecodable=True`. A schema registry outage is not such a record: it raises
  `SchemaRegistryUnavailable` and the subscriber stays where it is;
- a **client error** the consumer hands over in place of a record: a non-fatal one (a broker down,
  a partition leader moving; librdkafka retries it itself) is logged and counted in
  `consume_errors` and the records around it are delivered; a fatal one raises `KafkaException`,
  after moving the consumer back to the first record of each partition not handed over, so
  nothing `poll()` had collected is passed by.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from tether_contracts.base import AvroRecord
from tether_contracts.records import Envelope
from tether_messaging.envelopes import header_event_type
from tether_messaging.registry import RegistryCodec, SchemaRegistryUnavailable, envelope_codec
from tether_messaging.serde import EnvelopeCodec, SerdeError, UnknownFingerprint, open_payload

log = structlog.get_logger("tether_messaging.subscriber")

TETHER_NAMESPACE = "tether.v1"


class UndecodableRecord(Exception):
    """A record whose value is not a Tether envelope (or whose payload is corrupt)."""

    def __init__(self, topic: str, partition: int, offset: int, reason: str) -> None:
        super().__init__(f"{topic}[{partition}]@{offset} does not decode: {reason}")
        self.topic, self.partition, self.offset, self.reason = topic, partition, offset, reason


@dataclass(frozen=True)
class SubscribedEvent:
    """One committed record, decoded. `payload` is None when its schema is newer than this build."""

    topic: str
    partition: int
    offset: int
    envelope: Envelope
    payload: AvroRecord | None

    @property
    def event_type(self) -> str:
        return self.envelope.event_type


#: Offset-commit errors of a group rebalance (librdkafka does not retry them and a synchronous commit
#: returns them): REBALANCE_IN_PROGRESS while the group rebalances, ILLEGAL_GENERATION /
#: UNKNOWN_MEMBER_ID once its generation moved on without this member's commit. Nothing is wrong:
#: the positions stay in `_handled` for the next commit (or the revoke callback's), and a partition
#: that moved is read again by its new owner from its last committed offset (at-least-once).
_COMMIT_DEFERRED = frozenset({
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
})

#: Records taken from the client at a time (librdkafka's own limit is 1,000,000): poll() checks its
#: deadline between chunks, so decoding one chunk is all it can run over its timeout.
CONSUME_CHUNK = 1000


class Subscriber:
    """A consumer group member that yields decoded events and commits what was handled.

    Use `run(handler)`, or `poll()` / `commit()` yourself: call `poll()` again only once the
    events it returned were handled, since a rebalance inside `poll()` commits the positions of
    everything earlier `poll()` calls returned (so the next owner of a partition does not see it
    again); the events of a partition taken away during `poll()` are not returned (its next owner
    gets them). Leaving a `with` block on an exception commits only what is known handled. A commit
    that meets a rebalance is put off, not raised (logged, counted in `commits_deferred`): any other
    commit error raises.
    """

    def __init__(
        self,
        bootstrap: str,
        group_id: str,
        topics: Sequence[str],
        *,
        event_types: Collection[str] | None = None,
        from_beginning: bool = True,
        schema_registry_url: str | None = None,
        codec: EnvelopeCodec | None = None,
        skip_undecodable: bool = False,
        consumer_config: Mapping[str, Any] | None = None,
    ) -> None:
        if not topics:
            raise ValueError("subscribe to at least one topic")
        # Avro full names as the envelope carries them; a bare name means Tether's namespace.
        self._types = None if event_types is None else frozenset(
            t if "." in t else f"{TETHER_NAMESPACE}.{t}" for t in event_types)
        self._type_headers = None if self._types is None else frozenset(t.encode() for t in self._types)
        self._owned_codec = codec is None
        self._codec = codec or envelope_codec(schema_registry_url)
        self._skip_undecodable = skip_undecodable
        #: Next offset per (topic, partition) past every record poll() returned or passed over.
        self._returned: dict[tuple[str, int], int] = {}
        #: Next offset per (topic, partition) past every record known handled: what may be committed
        #: while an event could still be in a handler's hands (a rebalance, an exception).
        self._handled: dict[tuple[str, int], int] = {}
        #: Partitions taken away during the poll() in progress and not assigned again: their records
        #: are not handed over.
        self._revoked_in_poll: set[tuple[str, int]] = set()
        #: Partitions taken away since poll() last looked (even if assigned again since): the events of
        #: theirs it collected before are dropped (their next owner, maybe this one, reads them again).
        self._taken_away: set[tuple[str, int]] = set()
        self.skipped_undecodable = 0
        #: Non-fatal errors the client handed to consume() (a broker down, a partition leader moving):
        #: logged and counted, the client retries them itself; the records around them are delivered.
        self.consume_errors = 0
        self.passed_over = 0
        #: Commits put off by a rebalance (`_COMMIT_DEFERRED`): their positions go with a later commit,
        #: or a partition that moved is read again by its next owner.
        self.commits_deferred = 0
        config: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "group.id": group_id,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            # Cooperative: a member joining or leaving moves only the partitions that change hands.
            "partition.assignment.strategy": "cooperative-sticky",
            # What a slow subscriber holds fetched ahead (librdkafka's default is 64 MiB).
            "queued.max.messages.kbytes": 2048,
        }
        config.update(consumer_config or {})
        self._consumer = Consumer(config)
        self._consumer.subscribe(list(topics), on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)

    # -- the group -------------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Ours again (maybe within the poll() that took them away): the client reads them from their
        # committed offsets, so what it fetches from now on is handed over.
        assigned = {(tp.topic, tp.partition) for tp in partitions}
        self._revoked_in_poll -= assigned
        self._forget(assigned)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Hand over cleanly, but only what was handled: this runs inside poll(), while events of
        # these partitions may sit in the batch being collected, handed to nobody yet.
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        self._revoked_in_poll |= revoked
        self._taken_away |= revoked
        self._commit_positions(self._handled, revoked)
        self._forget(revoked)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The session expired: another member may own them already; committing could go backwards.
        lost = {(tp.topic, tp.partition) for tp in partitions}
        self._revoked_in_poll |= lost
        self._taken_away |= lost
        self._forget(lost)

    def _forget(self, keys: Collection[tuple[str, int]]) -> None:
        for key in keys:
            self._returned.pop(key, None)
            self._handled.pop(key, None)

    def assignment(self) -> list[tuple[str, int]]:
        return sorted((tp.topic, tp.partition) for tp in self._consumer.assignment())

    # -- reading ---------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 1.0, *, max_events: int = 500) -> list[SubscribedEvent]:
        """Up to `max_events` committed events (fewer when `timeout_s` passes first; [] when none).

        Calling it declares the events earlier calls returned handled (see the class docstring)."""
        self._handled.update(self._returned)
        self._revoked_in_poll = set()
        self._taken_away = set()
        out: list[SubscribedEvent] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < max_events:
            left = deadline - time.monotonic()
            # Wait until there are events; then take only what is already fetched.
            want = min(max_events - len(out), CONSUME_CHUNK)
            msgs = self._consumer.consume(want, timeout=max(left, 0) if not out else 0)
            if self._taken_away:
                # A rebalance inside consume() took partitions away: their next owner reads them
                # from what was committed, so nothing collected of theirs is handed over here. One
                # assigned again meanwhile is read again from its committed offset.
                gone, self._taken_away = self._taken_away, set()
                out = [e for e in out if (e.topic, e.partition) not in gone]
            if self._revoked_in_poll:
                msgs = [m for m in msgs if m.error() or (m.topic(), m.partition()) not in self._revoked_in_poll]
            if not msgs:
                break
            for i, m in enumerate(msgs):
                try:
                    event = self._take(m)
                except (UndecodableRecord, SchemaRegistryUnavailable):
                    # Read again from this record (and whatever came after it in this fetch), so
                    # nothing is passed by: hand over what decoded before it, then stop at it.
                    self._rewind([], msgs[i:])
                    if out:
                        return out
                    raise
                except KafkaException:
                    # A fatal client error: nothing collected is handed over, so a retry (a new
                    # subscriber of the group, or this one) must meet all of it again.
                    self._rewind(out, msgs[i:])
                    raise
                if event is not None:
                    out.append(event)
            if time.monotonic() >= deadline:
                break
        return out

    def _rewind(self, dropped: Sequence[SubscribedEvent], msgs: Sequence[Any]) -> None:
        # Back to the first record of each partition not handed over: the events collected but
        # dropped, then the records not looked at yet (both in offset order per partition).
        first: dict[tuple[str, int], int] = {}
        for e in dropped:
            first.setdefault((e.topic, e.partition), e.offset)
        for m in msgs:
            if not m.error():
                first.setdefault((m.topic(), m.partition()), m.offset())
        for (topic, partition), offset in first.items():
            if (topic, partition) in self._revoked_in_poll:
                continue  # not ours: its next owner reads it from its committed offset
            self._returned[(topic, partition)] = min(offset, self._returned.get((topic, partition), offset))
            self._consumer.seek(TopicPartition(topic, partition, offset))

    def _take(self, m: Any) -> SubscribedEvent | None:
        if m.error():
            error = m.error()
            if error.code() == KafkaError._PARTITION_EOF:
                return None
            if error.fatal():
                raise KafkaException(error)
            # librdkafka hands non-fatal errors (a broker down, a leader moving) to consume() when
            # no error_cb is set, and retries them itself: the records around them are still good.
            self.consume_errors += 1
            log.warning("subscriber_consume_error", error=error.str(), code=error.name(),
                        topic=m.topic(), partition=m.partition())
            return None
        topic, partition, offset = m.topic(), m.partition(), m.offset()
        key = (topic, partition)
        # Not past it until it is returned or passed over: a restart meets it again.
        self._returned[key] = offset
        if self._type_headers is not None:
            event_type = header_event_type(m.headers())
            if event_type is not None and event_type not in self._type_headers:
                return self._pass_over(key, offset)
        try:
            envelope = self._codec.decode_value(m.value() or b"")
        except SchemaRegistryUnavailable:
            # The one transient error (docs/serde.md): the record is fine, the registry is not.
            log.warning("subscriber_schema_registry_unavailable", topic=topic, partition=partition, offset=offset)
            raise
        except SerdeError as err:
            return self._undecodable(topic, partition, offset, str(err))
        if self._types is not None and envelope.event_type not in self._types:
            return self._pass_over(key, offset)  # a record without the header, filtered after decoding
        try:
            payload: AvroRecord | None = open_payload(envelope)
        except UnknownFingerprint:
            payload = None  # a newer event type or version: deliver what the envelope says
        except SerdeError as err:
            return self._undecodable(topic, partition, offset, f"payload: {err}")
        if payload is not None and payload.AVRO_NAME != envelope.event_type:
            return self._undecodable(
                topic, partition, offset, f"the envelope says {envelope.event_type}, the payload is {payload.AVRO_NAME}")
        self._returned[key] = offset + 1
        return SubscribedEvent(topic, partition, offset, envelope, payload)

    def _pass_over(self, key: tuple[str, int], offset: int) -> None:
        self.passed_over += 1
        self._returned[key] = offset + 1

    def _undecodable(self, topic: str, partition: int, offset: int, reason: str) -> None:
        if not self._skip_undecodable:
            raise UndecodableRecord(topic, partition, offset, reason)
        self._returned[(topic, partition)] = offset + 1
        self.skipped_undecodable += 1
        log.warning("subscriber_skipped_undecodable", topic=topic, partition=partition, offset=offset, reason=reason)
        return None

    # -- committing ------------------------------------------------------------------------------
    def commit(self) -> None:
        """Declare everything `poll()` returned handled and commit past it (synchronously).

        A commit that meets a group rebalance (`_COMMIT_DEFERRED`) returns without committing: the
        positions stay known handled and go with the next commit, or with the revoke callback's if
        the rebalance takes partitions away. Any other commit error raises `KafkaException`."""
        self._handled.update(self._returned)
        self._commit_positions(self._handled)

    def _commit_positions(self, positions: Mapping[tuple[str, int], int],
                          only: Collection[tuple[str, int]] | None = None) -> None:
        # Clears nothing: what is not committed here stays in `positions` (`_handled`) for later.
        offsets = [TopicPartition(t, p, o) for (t, p), o in sorted(positions.items()) if only is None or (t, p) in only]
        if offsets:
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as err:
                error = err.args[0]
                if error.code() == KafkaError._NO_OFFSET:
                    return
                if error.code() not in _COMMIT_DEFERRED:
                    raise
                self.commits_deferred += 1
                log.warning("subscriber_commit_deferred", error=error.name(), partitions=len(offsets),
                            reason="group rebalance: committed with the next commit or the revoke")

    def run(
        self,
        handler: Callable[[SubscribedEvent], None],
        *,
        stop: threading.Event | None = None,
        max_events: int | None = None,
        idle_exit_s: float | None = None,
    ) -> int:
        """Hand every event to `handler`, committing after each batch, until `stop` is set,
        `max_events` were handled or nothing came for `idle_exit_s`. Returns how many were handled.
        An exception from the handler propagates; the event it failed on and those after it are
        not committed, and the next `poll()` or `run()` delivers them again. A commit that meets a
        group rebalance does not stop it: what was handled is committed with the next batch's
        commit (see `commit`); any other commit error propagates."""
        handled = 0
        idle_since = time.monotonic()
        while not (stop is not None and stop.is_set()):
            want = 500 if max_events is None else min(500, max_events - handled)
            events = self.poll(0.5, max_events=want)
            for i, event in enumerate(events):
                try:
                    handler(event)
                except BaseException:
                    self._give_back(events[i:])
                    raise
                self._handled[(event.topic, event.partition)] = event.offset + 1
                handled += 1
            self.commit()  # the whole batch was handled, records passed over after its last event too
            if events:
                idle_since = time.monotonic()
            elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                break
            if max_events is not None and handled >= max_events:
                break
        return handled

    def _give_back(self, unhandled: Sequence[SubscribedEvent]) -> None:
        # Not past the first unhandled event of each partition, and read from it again.
        first: dict[tuple[str, int], int] = {}
        for event in unhandled:
            first.setdefault((event.topic, event.partition), event.offset)
        for (topic, partition), offset in first.items():
            self._returned[(topic, partition)] = offset
            self._consumer.seek(TopicPartition(topic, partition, offset))

    def close(self) -> None:
        """Commit what was handed over (everything `poll()` returned) and leave the group (its
        partitions move at once)."""
        self._close(self._returned)

    def _close(self, positions: Mapping[tuple[str, int], int]) -> None:
        try:
            self._handled.update(positions)
            self._commit_positions(self._handled)
        finally:
            self._consumer.close()
            if self._owned_codec and isinstance(self._codec, RegistryCodec):
                self._codec.client.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an exception: what the last poll() returned may not have been handled.
        self._close(self._returned if exc_type is None else self._handled)


# -- a command line: print events as JSON lines ----------------------------------------------------
def event_json(event: SubscribedEvent) -> dict[str, Any]:
    """One event as a JSON-ready dict: where it is, its envelope fields, and its payload (or null)."""
    env = event.envelope
    return {
        "topic": event.topic, "partition": event.partition, "offset": event.offset,
        "tenant_id": env.tenant_id, "run_id": env.run_id, "seq": env.seq, "event_type": env.event_type,
        "event_id": env.event_id, "recorded_at_ms": env.recorded_at_ms, "producer": env.producer,
        "payload": None if event.payload is None else event.payload.model_dump(mode="json"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tether_messaging.subscriber",
        description="Follow Tether topics as a consumer group member; print each committed event as a JSON line.")
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    parser.add_argument("--group", required=True, help="consumer group id (one per subscribing application)")
    parser.add_argument("--topic", action="append", default=None,
                        help="topic to follow (repeat); default tether.run-events.v1")
    parser.add_argument("--type", action="append", default=None, dest="types",
                        help="only these event types, e.g. ToolCallCompleted or tether.v1.ToolCallCompleted (repeat)")
    parser.add_argument("--latest", action="store_true", help="a new group starts at the end, not the beginning")
    parser.add_argument("--schema-registry-url", default=None)
    parser.add_argument("--max-events", type=int, default=None, help="stop after this many")
    parser.add_argument("--idle-exit-s", type=float, default=None, help="stop when nothing came for this long")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def emit(event: SubscribedEvent) -> None:
        sys.stdout.write(json.dumps(event_json(event), sort_keys=True) + "\n")
        sys.stdout.flush()

    with Subscriber(args.bootstrap, args.group, args.topic or ["tether.run-events.v1"], event_types=args.types,
                    from_beginning=not args.latest, schema_registry_url=args.schema_registry_url) as sub:
        sub.run(emit, stop=stop, max_events=args.max_events, idle_exit_s=args.idle_exit_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
