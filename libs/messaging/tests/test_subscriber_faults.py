"""Subscriber faults without a broker: client errors inside a fetch and a partition moving back within one poll()."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

import tether_messaging.subscriber as subscriber_module
from tether_contracts.records import Remaining, StepGranted
from tether_messaging.chain import GENESIS_HASH, seal
from tether_messaging.envelopes import make_envelope
from tether_messaging.serde import encode
from tether_messaging.subscriber import Subscriber

TOPIC = "tether.run-events.v1"


def _value(offset: int) -> bytes:
    payload = StepGranted(step=offset + 1, remaining=Remaining(steps=10, tokens=100, cost_usd_micros=100,
                                                                wall_clock_ms=1000))
    env = make_envelope(payload, run_id="run-0", tenant_id="t1", event_id=f"e-{offset}", producer="budget",
                        recorded_at_ms=1_700_000_000_000 + offset)
    return encode(seal(env, offset + 1, GENESIS_HASH))


class Record:
    """What `Consumer.consume` returns: a record, or an error in its place."""

    def __init__(self, partition: int, offset: int, error: KafkaError | None = None) -> None:
        self._partition, self._offset, self._error = partition, offset, error

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return _value(self._offset)

    def headers(self) -> list[Any]:
        return []


def error(code: int, *, fatal: bool = False) -> Record:
    return Record(-1, -1, KafkaError(code, fatal=fatal))


class FakeConsumer:
    """A consumer that reads partitions like librdkafka: from a position per partition, which
    `seek` moves and an assignment sets to the committed offset; `script` injects what a call returns
    instead (errors, rebalance callbacks)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.log: dict[int, int] = {}  # partition -> records in it
        self.position: dict[int, int] = {}
        self.committed: dict[int, int] = {}
        self.script: list[list[Record] | Callable[[FakeConsumer], list[Record]]] = []

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks

    def assign_back(self, partitions: list[int]) -> None:
        for p in partitions:
            self.position[p] = self.committed.get(p, 0)
        if on_assign := self.callbacks.get("on_assign"):
            on_assign(self, [TopicPartition(TOPIC, p) for p in partitions])

    def revoke(self, partitions: list[int]) -> None:
        self.callbacks["on_revoke"](self, [TopicPartition(TOPIC, p) for p in partitions])
        for p in partitions:
            self.position.pop(p, None)

    def consume(self, n: int, timeout: float = 0) -> list[Record]:
        if self.script:
            step = self.script.pop(0)
            return step(self) if callable(step) else step
        out = []
        for p, pos in sorted(self.position.items()):
            for o in range(pos, self.log.get(p, 0)):
                if len(out) < n:
                    out.append(Record(p, o))
                    self.position[p] = o + 1
        return out

    def fetched(self, partition: int, offsets: range) -> list[Record]:
        """Records the client hands over, moving its position past them."""
        self.position[partition] = offsets[-1] + 1
        return [Record(partition, o) for o in offsets]

    def seek(self, tp: TopicPartition) -> None:
        self.position[tp.partition] = tp.offset

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        for tp in offsets:
            self.committed[tp.partition] = tp.offset

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(TOPIC, p) for p in self.position]

    def close(self) -> None:
        pass


@pytest.fixture
def sub(monkeypatch: pytest.MonkeyPatch) -> Subscriber:
    monkeypatch.setattr(subscriber_module, "Consumer", FakeConsumer)
    s = Subscriber("fake:9092", "g", [TOPIC])
    s._consumer.position = {0: 0}
    return s


def drain(sub: Subscriber) -> list[tuple[int, int]]:
    got = []
    while events := sub.poll(0.05):
        got += [(e.partition, e.offset) for e in events]
    return got


def test_a_transient_client_error_is_counted_and_the_records_around_it_are_delivered(sub):
    fake: FakeConsumer = sub._consumer
    fake.log = {0: 6}
    fake.script = [lambda c: c.fetched(0, range(0, 2)) + [error(KafkaError._TRANSPORT)] + c.fetched(0, range(2, 4))]
    assert drain(sub) == [(0, o) for o in range(6)]
    sub.commit()
    assert fake.committed == {0: 6}
    assert sub.consume_errors == 1


def test_a_fatal_client_error_raises_and_a_retry_delivers_every_record(sub):
    fake: FakeConsumer = sub._consumer
    fake.log = {0: 6, 1: 2}
    fake.position = {0: 0, 1: 0}
    fake.script = [lambda c: c.fetched(0, range(0, 2)) + c.fetched(1, range(0, 1)),
                   lambda c: c.fetched(0, range(2, 3)) + [error(KafkaError._FATAL, fatal=True)]
                   + c.fetched(0, range(3, 5))]
    with pytest.raises(KafkaException):
        sub.poll(0.05)
    sub.commit()  # nothing of that poll() was handed over, so nothing of it is committed
    assert set(fake.committed.values()) <= {0}
    assert sorted(drain(sub)) == [(0, o) for o in range(6)] + [(1, 0), (1, 1)]


def test_a_partition_taken_away_and_given_back_within_one_poll_is_read_again_from_its_committed_offset(sub):
    fake: FakeConsumer = sub._consumer
    fake.log = {0: 5, 1: 1}
    fake.script = [lambda c: c.fetched(0, range(0, 2))]
    assert [e.offset for e in sub.poll(0.05, max_events=2)] == [0, 1]

    def rebalance(c: FakeConsumer) -> list[Record]:
        c.fetched(0, range(2, 3))  # fetched, then dropped by the revoke
        c.revoke([0])  # commits 2: 0 and 1 were handled
        c.assign_back([0, 1])  # from the committed offset again, and another partition
        return c.fetched(1, range(0, 1))

    fake.script = [rebalance]
    assert sorted(drain(sub)) == [(0, o) for o in range(2, 5)] + [(1, 0)]
    sub.commit()
    assert fake.committed == {0: 5, 1: 1}
