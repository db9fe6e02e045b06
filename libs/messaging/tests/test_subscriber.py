"""The subscriber internal teams follow the event log with, against the real broker: committed records only, a
consumer group that shares and hands over partitions, at-least-once with resumable offsets, type filtering,
forward compatibility with event types this build does not know, and a loud stop at a record that is not an
envelope."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from tether_contracts.records import Envelope, Remaining, RunCompleted, StepGranted, Usage
from tether_messaging.chain import GENESIS_HASH, seal
from tether_messaging.envelopes import headers_for, make_envelope
from tether_messaging.registry import SchemaRegistryUnavailable, envelope_codec
from tether_messaging.serde import encode
from tether_messaging.subscriber import SubscribedEvent, Subscriber, UndecodableRecord
from tether_testing import unique_name

pytestmark = pytest.mark.integration


def sealed(run: str, seq: int, payload, prev: str = GENESIS_HASH) -> Envelope:
    env = make_envelope(payload, run_id=run, tenant_id="t1", event_id=f"{run}-{seq}", producer="budget",
                        recorded_at_ms=1_700_000_000_000 + seq)
    return seal(env, seq, prev)


def produce(bootstrap: str, topic: str, envelopes: list[Envelope], *, partition_of=lambda env: 0,
            transactional: bool = False, abort: bool = False) -> None:
    config = {"bootstrap.servers": bootstrap}
    if transactional:
        config["transactional.id"] = unique_name("sub-test-tx")
    producer = Producer(config)
    if transactional:
        producer.init_transactions(30)
        producer.begin_transaction()
    for env in envelopes:
        producer.produce(topic, key=env.run_id.encode(), value=encode(env), headers=headers_for(env),
                         partition=partition_of(env))
    if transactional:
        (producer.abort_transaction if abort else producer.commit_transaction)(30)
    producer.flush(30)


def events_of(n_runs: int, steps: int) -> list[Envelope]:
    out = []
    for r in range(n_runs):
        prev = GENESIS_HASH
        for s in range(1, steps + 1):
            env = sealed(f"run-{r}", s, _granted(s), prev)
            prev = env.hash
            out.append(env)
    return out


def _granted(step: int) -> StepGranted:
    return StepGranted(step=step, remaining=Remaining(steps=10, tokens=100, cost_usd_micros=100, wall_clock_ms=1000))


def _completed(answer: str) -> RunCompleted:
    return RunCompleted(step=1, answer=answer, usage=Usage(input_tokens=1, output_tokens=1, cost_usd_micros=1))


def committed(bootstrap: str, group: str, topic: str, partitions: int = 1) -> list[int | None]:
    """The group's committed offset of each partition (None: nothing committed)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
    finally:
        consumer.close()
    return [tp.offset if tp.offset >= 0 else None for tp in tps]


class Reads:
    """A member's consumer whose reads are batched as a busy topic would batch them: `consume(n,
    timeout)` calls go to `script` (the call's number, n, timeout) — everything else to the real one."""

    def __init__(self, consumer: Consumer, script: Callable[[int, int, float], list[Any]]) -> None:
        self.real, self.script, self.calls = consumer, script, 0

    def consume(self, n: int, timeout: float) -> list[Any]:
        self.calls += 1
        return self.script(self.calls, n, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class CommitFails:
    """A member's consumer whose first offset commits raise `errors` (as librdkafka's synchronous commit
    does when it meets a group rebalance) — later commits and everything else go to the real one."""

    def __init__(self, consumer: Consumer, errors: list[KafkaError]) -> None:
        self.real, self.errors = consumer, list(errors)
        self.commits: list[list[TopicPartition]] = []

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        self.commits.append(kwargs.get("offsets"))
        if self.errors:
            raise KafkaException(self.errors.pop(0))
        return self.real.commit(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def in_twos(sub: Subscriber, errors: list[KafkaError]) -> CommitFails:
    """Make `sub` read at most two records per poll() (so run() commits after every two) and fail its
    first commits with `errors`."""
    real = sub._consumer

    def two_per_poll(call: int, n: int, timeout: float) -> list[Any]:
        # poll() waits only on its first read (timeout > 0); an empty follow-up read ends it.
        return real.consume(min(n, 2), timeout) if timeout > 0 else []

    commits = CommitFails(real, errors)
    sub._consumer = Reads(commits, two_per_poll)  # type: ignore[assignment, arg-type]
    return commits


def drain(sub: Subscriber, want: int, *, timeout_s: float = 60.0) -> list[SubscribedEvent]:
    got: list[SubscribedEvent] = []
    drain_into(sub, got, want, timeout_s=timeout_s)
    return got


def drain_into(sub: Subscriber, got: list[SubscribedEvent], want: int | None = None, *,
               timeout_s: float = 60.0) -> None:
    """run() into `got` until `want` events (None: until stopped) or `timeout_s`."""
    stop = threading.Event()
    timer = threading.Timer(timeout_s, stop.set)
    timer.start()
    try:
        sub.run(got.append, stop=stop, max_events=want)
    finally:
        timer.cancel()


def test_only_committed_records_are_delivered_decoded_and_resumed_after_a_restart(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-log", partitions=2)
    group = unique_name("sub-group")
    first = events_of(2, 3)
    produce(kafka_bootstrap, topic, first[:3], transactional=True, abort=True)  # never visible
    produce(kafka_bootstrap, topic, first, transactional=True, partition_of=lambda e: int(e.run_id[-1]))
    with Subscriber(kafka_bootstrap, group, [topic]) as sub:
        got = drain(sub, 6)
    assert sorted((e.envelope.run_id, e.envelope.seq) for e in got) == [(f"run-{r}", s) for r in (0, 1)
                                                                         for s in (1, 2, 3)]
    assert all(isinstance(e.payload, StepGranted) and e.payload.step == e.envelope.seq for e in got)
    # Per partition in order, the chain intact as written.
    for run in ("run-0", "run-1"):
        seqs = [e.envelope.seq for e in got if e.envelope.run_id == run]
        assert seqs == [1, 2, 3]
    # The group's offsets were committed: a new member of the same group sees only what came later.
    later = [sealed("run-0", 4, _granted(4), got[-1].envelope.hash)]
    produce(kafka_bootstrap, topic, later)
    with Subscriber(kafka_bootstrap, group, [topic]) as sub:
        again = drain(sub, 1)
        assert sub.poll(1.0) == []
    assert [(e.envelope.run_id, e.envelope.seq) for e in again] == [("run-0", 4)]


def test_a_group_shares_the_partitions_and_a_member_leaving_hands_its_partitions_over(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-group", partitions=4)
    group = unique_name("sub-group")
    envelopes = [sealed(f"run-{p}-{i}", 1, _granted(1)) for p in range(4) for i in range(5)]
    a = Subscriber(kafka_bootstrap, group, [topic])
    b = Subscriber(kafka_bootstrap, group, [topic])
    seen: list[tuple[str, SubscribedEvent]] = []
    try:
        # Both poll until the group settles on sharing the four partitions.
        deadline_rounds = 120
        while deadline_rounds and not (a.assignment() and b.assignment()
                                       and len(a.assignment()) + len(b.assignment()) == 4):
            seen += [("a", e) for e in a.poll(0.25)]
            seen += [("b", e) for e in b.poll(0.25)]
            deadline_rounds -= 1
        assert a.assignment() and b.assignment(), (a.assignment(), b.assignment())
        assert not set(a.assignment()) & set(b.assignment())
        # Produced only now: produced before, a (first to join) could read all of them before b
        # joined, and b had none (seen once in ten runs).
        produce(kafka_bootstrap, topic, envelopes, partition_of=lambda e: int(e.run_id.split("-")[1]))
        # Until the first 20 records have arrived, each member having had some (bounded, not a
        # fixed 20 rounds: on a loaded machine b's first fetch took longer and it had none).
        for _ in range(120):
            seen += [("a", e) for e in a.poll(0.25)]
            seen += [("b", e) for e in b.poll(0.25)]
            if len(seen) == len(envelopes) and {who for who, _ in seen} == {"a", "b"}:
                break
        a.commit()
        b.commit()
        b.close()  # leaves the group: its partitions move to a, past what b committed
        more = [sealed(f"run-{p}-late", 1, _granted(1)) for p in range(4)]
        produce(kafka_bootstrap, topic, more, partition_of=lambda e: int(e.run_id.split("-")[1]))
        for _ in range(80):
            seen += [("a", e) for e in a.poll(0.25)]
            if len(a.assignment()) == 4 and sum(1 for _, e in seen if e.envelope.run_id.endswith("late")) == 4:
                break
        assert len(a.assignment()) == 4
    finally:
        a.close()
    runs = [e.envelope.run_id for _, e in seen]
    # Every record once: b's committed records were not delivered to a again.
    assert sorted(runs) == sorted(e.run_id for e in envelopes + more)
    assert {who for who, _ in seen} == {"a", "b"}


def test_types_are_filtered_and_an_unknown_event_type_is_delivered_without_its_payload(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-types")
    granted = sealed("run-1", 1, _granted(1))
    completed = sealed("run-1", 2, _completed("done"), granted.hash)
    # A producer upgraded before this consumer: an event type whose schema this build does not have.
    newer = sealed("run-1", 3, _completed("x"), completed.hash).model_copy(update={
        "event_type": "tether.v1.ToolCallTeleported",
        "payload": b"\xc3\x01" + bytes(8) + b"\x02",  # single-object encoding, a fingerprint nobody knows
    })
    produce(kafka_bootstrap, topic, [granted, completed, newer])
    with Subscriber(kafka_bootstrap, unique_name("sub-g"), [topic], event_types={"RunCompleted"}) as sub:
        only = drain(sub, 1)
        assert sub.poll(1.0) == [] and sub.passed_over == 2
    assert [e.event_type for e in only] == ["tether.v1.RunCompleted"] and only[0].payload.answer == "done"
    with Subscriber(kafka_bootstrap, unique_name("sub-g"), [topic]) as sub:
        every = drain(sub, 3)
    assert [(e.event_type, e.payload is None) for e in every] == [
        ("tether.v1.StepGranted", False), ("tether.v1.RunCompleted", False), ("tether.v1.ToolCallTeleported", True)]
    assert every[2].envelope.seq == 3 and every[2].envelope.run_id == "run-1"


def test_a_record_that_is_not_an_envelope_stops_the_subscriber_where_it_is_unless_told_to_skip(
        kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-bad")
    good = sealed("run-1", 1, _granted(1))
    produce(kafka_bootstrap, topic, [good])
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, key=b"run-1", value=b"{not an envelope}", partition=0)
    p.flush(30)
    produce(kafka_bootstrap, topic, [sealed("run-1", 2, _granted(2), good.hash)])
    group = unique_name("sub-g")
    with Subscriber(kafka_bootstrap, group, [topic]) as sub:
        got: list[SubscribedEvent] = []
        with pytest.raises(UndecodableRecord) as caught:
            sub.run(got.append, max_events=3, idle_exit_s=60)
        assert (caught.value.partition, caught.value.offset) == (0, 1)
        # Polling on does not pass it by: the subscriber stays at the bad record.
        with pytest.raises(UndecodableRecord) as again:
            sub.poll(10.0)
        assert again.value.offset == 1
    assert [e.envelope.seq for e in got] == [1]
    # The group's position stays at the bad record: a restart meets it again, nothing after it is lost.
    with Subscriber(kafka_bootstrap, group, [topic], skip_undecodable=True) as sub:
        rest = drain(sub, 1)
        assert sub.skipped_undecodable == 1
    assert [e.envelope.seq for e in rest] == [2]


def test_an_event_the_handler_failed_on_is_not_committed_and_is_delivered_again(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-raise")
    produce(kafka_bootstrap, topic, events_of(1, 6))
    group = unique_name("sub-g")
    handled: list[int] = []

    def fail_at_3(event: SubscribedEvent) -> None:
        if event.envelope.seq == 3:
            raise RuntimeError("the handler's store is down")
        handled.append(event.envelope.seq)

    with pytest.raises(RuntimeError), Subscriber(kafka_bootstrap, group, [topic]) as sub:
        sub.run(fail_at_3, idle_exit_s=60)
    # Handled 1 and 2 only: the group's offset stops at 3 (it was 6, the whole batch).
    assert handled == [1, 2] and committed(kafka_bootstrap, group, topic) == [2]
    with Subscriber(kafka_bootstrap, group, [topic]) as sub:
        with pytest.raises(RuntimeError):
            sub.run(fail_at_3, idle_exit_s=60)  # a restart meets 3 again
        # The same member, going on, is handed the event it failed on and the rest again.
        again = drain(sub, 4, timeout_s=15)
    assert [e.envelope.seq for e in again] == [3, 4, 5, 6] and committed(kafka_bootstrap, group, topic) == [6]
    # With poll(): leaving the block on an exception commits nothing of the batch in hand.
    other = unique_name("sub-g")
    with pytest.raises(RuntimeError), Subscriber(kafka_bootstrap, other, [topic]) as sub:
        assert drain_poll(sub)
        raise RuntimeError("the handler's store is down")
    assert committed(kafka_bootstrap, other, topic) == [None]


def drain_poll(sub: Subscriber) -> list[SubscribedEvent]:
    for _ in range(60):
        if events := sub.poll(0.5):
            return events
    return []


def test_a_rebalance_inside_poll_commits_and_hands_over_only_what_was_handled(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-rebalance", partitions=2)
    group = unique_name("sub-g")
    produce(kafka_bootstrap, topic, events_of(2, 5), partition_of=lambda e: int(e.run_id[-1]))
    b_got: list[SubscribedEvent] = []
    b_stop = threading.Event()

    def b_member() -> None:  # a second member of the group (constructing it is joining)
        with Subscriber(kafka_bootstrap, group, [topic]) as b:
            while not b_stop.is_set():
                b_got.extend(b.poll(0.25))

    b_thread = threading.Thread(target=b_member)

    def script(call: int, n: int, timeout: float) -> list[Any]:
        if call == 1:  # the ten records, both partitions: they are in poll()'s batch, handed to nobody yet
            return real.consume(min(n, 10), timeout)
        if call == 2:  # a second member joins; this read lasts until a partition was taken away
            b_thread.start()
            got: list[Any] = []
            for _ in range(240):
                got += real.consume(n, 0.25)
                if len(real.assignment()) < 2:
                    break
            return got
        return real.consume(n, timeout)

    a = Subscriber(kafka_bootstrap, group, [topic])
    real = a._consumer
    a._consumer = Reads(real, script)  # type: ignore[assignment]
    try:
        events = a.poll(60.0, max_events=1000)
        kept = a.assignment()
        assert len(kept) == 1, kept
        (_, mine), gone = kept[0], 1 - kept[0][1]
        # Nothing of the partition that moved is handed over here, and none of it was committed.
        assert {e.partition for e in events} == {mine} and len(events) == 5
        assert committed(kafka_bootstrap, group, topic, 2) == [None, None]
        for _ in range(120):  # the member going on (its next rebalance completes inside poll())
            if len(b_got) == 5:
                break
            assert a.poll(0.25) == []
        # Its next owner reads it from the start.
        assert [(e.partition, e.offset) for e in b_got] == [(gone, o) for o in range(5)]
        a.commit()
        assert committed(kafka_bootstrap, group, topic, 2)[mine] == 5
    finally:
        b_stop.set()
        if b_thread.is_alive():
            b_thread.join(30)
        a.close()


@pytest.mark.parametrize("code", [KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
                                  KafkaError.UNKNOWN_MEMBER_ID])
def test_a_commit_that_meets_a_rebalance_is_put_off_and_run_goes_on(kafka_bootstrap, kafka_topics, code):
    topic = kafka_topics.create("sub-commit-rebalance")
    produce(kafka_bootstrap, topic, events_of(1, 6))
    group = unique_name("sub-g")
    with Subscriber(kafka_bootstrap, group, [topic]) as sub:
        commits = in_twos(sub, [KafkaError(code)])
        with structlog.testing.capture_logs() as logs:
            got = drain(sub, 6)  # was: the KafkaException out of run() after its first batch
        # Every event handled once, and run()'s own later commits took the put-off positions with them
        # (checked before leaving the block, whose close() would commit anyway).
        assert [e.envelope.seq for e in got] == [1, 2, 3, 4, 5, 6]
        assert len(commits.commits) >= 2 and not commits.errors
        assert committed(kafka_bootstrap, group, topic) == [6]
        assert sub.commits_deferred == 1
    deferred = [entry for entry in logs if entry["event"] == "subscriber_commit_deferred"]
    assert [(e["log_level"], e["error"]) for e in deferred] == [("warning", KafkaError(code).name())]


@pytest.mark.parametrize("code", [KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError._FATAL])
def test_any_other_commit_error_still_raises(kafka_bootstrap, kafka_topics, code):
    topic = kafka_topics.create("sub-commit-fails")
    produce(kafka_bootstrap, topic, events_of(1, 6))
    group = unique_name("sub-g")
    got: list[SubscribedEvent] = []
    with pytest.raises(KafkaException) as caught, Subscriber(kafka_bootstrap, group, [topic]) as sub:
        in_twos(sub, [KafkaError(code)])
        drain_into(sub, got)
    assert caught.value.args[0].code() == code and sub.commits_deferred == 0
    # Raised at the first batch's commit: run() went no further; leaving the block committed what it handled.
    assert 0 < len(got) <= 2 and committed(kafka_bootstrap, group, topic) == [len(got)]


def test_poll_ends_at_its_timeout_and_takes_any_max_events(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-trickle")
    produce(kafka_bootstrap, topic, events_of(1, 20))
    with Subscriber(kafka_bootstrap, unique_name("sub-g"), [topic]) as sub:
        real = sub._consumer

        def trickle(call: int, n: int, timeout: float) -> list[Any]:
            time.sleep(0.2)  # a slow fetch: one record at a time, 0.2 s each
            return real.consume(1, 30)  # the first also joins the group: slow on a loaded machine

        sub._consumer = Reads(real, trickle)  # type: ignore[assignment]
        first = sub.poll(1.0, max_events=1000)
        assert 0 < len(first) < 20  # it read on for 4 s (the whole topic) past a 1 s timeout
        sub._consumer = real
        rest: list[SubscribedEvent] = []
        for _ in range(40):
            if len(first) + len(rest) == 20:
                break
            rest += sub.poll(0.5, max_events=2_000_000)  # above librdkafka's 1,000,000: ValueError
    assert [e.envelope.seq for e in first + rest] == list(range(1, 21))


def test_a_schema_registry_outage_is_not_an_undecodable_record(kafka_bootstrap, kafka_topics, schema_registry):
    url, registry = schema_registry
    topic = kafka_topics.create("sub-registry")
    codec = envelope_codec(url)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for env in events_of(1, 3):
        p.produce(topic, key=b"run-0", value=codec.encode_value(env, topic), headers=headers_for(env), partition=0)
    p.flush(30)
    codec.client.close()  # type: ignore[attr-defined]
    group = unique_name("sub-g")
    registry.fail_with = 503
    got: list[SubscribedEvent] = []
    with Subscriber(kafka_bootstrap, group, [topic], schema_registry_url=url, skip_undecodable=True) as sub:
        with pytest.raises(SchemaRegistryUnavailable):
            sub.run(got.append, idle_exit_s=60)
        assert got == [] and sub.skipped_undecodable == 0  # were: 3 skipped, the offset committed past them
    assert committed(kafka_bootstrap, group, topic) == [0]  # at the first record, not past it
    registry.fail_with = None
    with Subscriber(kafka_bootstrap, group, [topic], schema_registry_url=url, skip_undecodable=True) as sub:
        got = drain(sub, 3)
        assert sub.skipped_undecodable == 0
    assert [e.envelope.seq for e in got] == [1, 2, 3]


def test_an_envelope_whose_payload_is_another_event_type_does_not_decode(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-mislabelled")
    granted = sealed("run-1", 1, _granted(1))
    mislabelled = granted.model_copy(update={"event_type": "tether.v1.RunCompleted"})  # its payload: StepGranted
    produce(kafka_bootstrap, topic, [mislabelled, sealed("run-1", 2, _completed("done"), granted.hash)])
    group = unique_name("sub-g")
    with Subscriber(kafka_bootstrap, group, [topic], event_types={"RunCompleted"}) as sub:
        with pytest.raises(UndecodableRecord) as caught:
            sub.run(lambda e: None, idle_exit_s=60)
    assert caught.value.offset == 0 and "StepGranted" in caught.value.reason
    with Subscriber(kafka_bootstrap, group, [topic], event_types={"RunCompleted"}, skip_undecodable=True) as sub:
        got = drain(sub, 1)
        assert sub.skipped_undecodable == 1
    assert [(e.envelope.seq, e.payload.answer) for e in got] == [(2, "done")]


def test_the_command_line_prints_json_lines(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("sub-cli")
    granted = sealed("run-9", 1, _granted(1))
    produce(kafka_bootstrap, topic, [granted, sealed("run-9", 2, _completed("ok"), granted.hash)])
    out = subprocess.run(
        [sys.executable, "-m", "tether_messaging.subscriber", "--bootstrap", kafka_bootstrap, "--group",
         unique_name("sub-cli"), "--topic", topic, "--type", "RunCompleted", "--max-events", "1",
         "--idle-exit-s", "30"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.splitlines()
    assert len(out) == 1
    line = json.loads(out[0])
    assert (line["run_id"], line["seq"], line["event_type"], line["payload"]["answer"]) == (
        "run-9", 2, "tether.v1.RunCompleted", "ok")
