"""A record whose outputs or state checkpoint can never be produced (too large) is a poison record:
dead-lettered with its effects discarded, while the rest of its batch and partition carry on.

Before, the loop aborted the batch on the producer's MSG_SIZE_TOO_LARGE, replayed the same record,
which produced the same oversized record again: forever, the partition stuck behind it.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from confluent_kafka import Consumer, Producer, TopicPartition
from pydantic import BaseModel

from tether_contracts.records import Remaining, RunRejected, StepGranted
from tether_messaging import loop as loop_mod
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, PydanticStateCodec, TickContext, WorkDone
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics
from tether_testing.kafka import latest_values, set_topic_configs
from tether_testing.loops import LoopThread

NAME = "oversized"
PARTITIONS = 2
RUNS = 4
INPUTS_PER_RUN = 12
#: (run, input number) whose handling emits an output too large to produce / puts a state too
#: large to checkpoint (besides a normal output, already produced when the big one is refused).
BIG_OUTPUT = ("run-0", 5)
BIG_STATE = ("run-1", 9)
POISON = {BIG_OUTPUT: "OUTPUT_TOO_LARGE", BIG_STATE: "STATE_TOO_LARGE"}
#: The broker-side limit the "broker-refuses" case sets on the output and changelog topics.
TOPIC_LIMIT = 100_000
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Counted(BaseModel):
    counter: int = 0
    blob: str = ""


class Oversized:
    """One output per input, numbered by a per-run counter in the state; two inputs also produce
    something too large (`BIG_OUTPUT`, `BIG_STATE`) of `big_bytes`. The big state is carried on by
    the run's later inputs, so it is what the batch checkpoints whatever inputs follow it there."""

    state_codec = PydanticStateCodec(Counted)

    def __init__(self, topics: Topics, big_bytes: int) -> None:
        self.name = NAME
        self.inputs = [topics.commands]
        self.output = topics.run_events
        self.big_bytes = big_bytes
        self.handled: defaultdict[tuple[str, int], int] = defaultdict(int)

    def handle(self, msg: Inbound, ctx: Context) -> None:
        run_id, n = msg.envelope.run_id, msg.payload.step
        self.handled[(run_id, n)] += 1
        state = ctx.get_state(run_id) or Counted()
        counter = state.counter + 1
        ctx.emit(self.output, StepGranted(step=counter, remaining=REMAINING), run_id=run_id,
                 tenant_id=msg.envelope.tenant_id, event_id=f"out:{run_id}:{n}", causation_id=msg.envelope.event_id)
        blob = state.blob
        if (run_id, n) == BIG_OUTPUT:
            ctx.emit(self.output, RunRejected(request_id="x", reason_code="BIG", detail="x" * self.big_bytes),
                     run_id=run_id, tenant_id=msg.envelope.tenant_id, event_id=f"big:{run_id}:{n}")
        if (run_id, n) == BIG_STATE:
            blob = "y" * self.big_bytes
        ctx.put_state(run_id, Counted(counter=counter, blob=blob))

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def on_tick(self, ctx: TickContext) -> None:
        pass


def _input(run: int, n: int) -> bytes:
    env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"run-{run}", tenant_id="t",
                        event_id=f"in:run-{run}:{n}", producer="test", recorded_at_ms=0)
    return encode(env)


def _limit_topics(bootstrap: str, topics: list[str], limit: int) -> None:
    set_topic_configs(bootstrap, topics, {"max.message.bytes": str(limit)})


def _read(bootstrap: str, topic: str, expect: int, stop_early: list, timeout_s: float,
          identity: Callable[[Any], Any] = lambda m: (m.partition(), m.offset())) -> list:
    """The records of `topic` until `expect` distinct ones (by `identity`; None: not counted) are
    in, then 1 s more. At least once, outputs are counted by event id, leaving out the poison
    inputs' normal outputs: the replays' duplicates and those must not end the wait before the
    last expected outputs are in."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}.reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    out: list = []
    distinct: set = set()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not stop_early:
            if len(distinct) >= expect:
                deadline = min(deadline, time.monotonic() + 1.0)  # a duplicate would show up by then
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                out.append(msg)
                if (seen := identity(msg)) is not None:
                    distinct.add(seen)
    finally:
        reader.close()
    return out


def _expected_output_id(m: Any) -> str | None:
    event_id = decode_envelope(m.value()).event_id
    return None if event_id in {f"out:{run}:{n}" for run, n in POISON} else event_id


def _latest_changelog(bootstrap: str, topic: str) -> dict[bytes, bytes | None]:
    return latest_values(bootstrap, topic, PARTITIONS)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("refused_by", "transactional"),
    [("producer", True), ("broker", True), ("producer", False)],
    ids=["exactly-once-producer-refuses", "exactly-once-broker-refuses", "at-least-once-producer-refuses"],
)
def test_an_output_or_checkpoint_too_large_dead_letters_its_input_and_the_partition_goes_on(
    kafka_bootstrap: str, topic_prefix: str, refused_by: str, transactional: bool
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, [NAME], prefix=topic_prefix)
    if refused_by == "producer":
        # Over the producer's message.max.bytes (1,000,000): produce() itself raises MSG_SIZE_TOO_LARGE.
        big_bytes = 1_200_000
    else:
        # Under the producer's limit, over the topics': the broker refuses the request, and the
        # transaction fails at its commit (MSG_SIZE_TOO_LARGE in the delivery reports).
        big_bytes = 2 * TOPIC_LIMIT
        _limit_topics(kafka_bootstrap, [topics.run_events, topics.changelog(NAME)], TOPIC_LIMIT)

    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 50})
    inputs: dict[tuple[str, int], bytes] = {}
    for n in range(1, INPUTS_PER_RUN + 1):
        for r in range(RUNS):
            inputs[(f"run-{r}", n)] = value = _input(r, n)
            producer.produce(topics.commands, value, f"run-{r}".encode(), partition=r % PARTITIONS)
    assert producer.flush(30) == 0

    processor = Oversized(topics, big_bytes)
    dead_before = {reason: loop_mod.DEAD_LETTERS.labels(NAME, reason)._value.get() for reason in POISON.values()}
    expected_outputs = RUNS * INPUTS_PER_RUN - len(POISON)
    with structlog.testing.capture_logs() as logs:
        # Bound inside the capture: the loop binds its logger when it is built.
        loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics,
                                                   transactional=transactional, batch_max_ms=20))
        running = LoopThread(loop)
        running.start()
        try:
            # Without the fix the loop replays the poison records' batches forever: bounded here.
            outputs = _read(kafka_bootstrap, topics.run_events, expected_outputs, running.errors, timeout_s=60,
                            identity=_expected_output_id)
            dead = _read(kafka_bootstrap, topics.dead_letters, len(POISON), running.errors, timeout_s=30,
                         identity=lambda m: (m.key(), m.value()))
        finally:
            running.stop()
    assert not running.errors, running.errors
    assert not running.is_alive()
    # A broker refusal's abort leaves the replay nothing out of sequence: before the loop replaced
    # its producer there, the replay failed on "skipped sequence numbers" (OUT_OF_ORDER_SEQUENCE_NUMBER)
    # and, with both poison records' partitions in it, its commit stalled for the transaction
    # timeout, racing the coordinator's timeout of the transaction, which fenced the producer.
    out_of_sequence = [e["error"] for e in logs if e["event"] == "batch_aborted" and "sequence" in e["error"]]
    assert not out_of_sequence, out_of_sequence

    # Each poison input was dead-lettered once (at least once where the loop is not transactional:
    # a batch that produced one dead letter and then found the other poison record is produced
    # again when replayed — seen), with its reason, naming the topic and size of what could not be
    # produced (not its content), and its original value, key and partition.
    by_input = {(m.key().decode(), open_payload(decode_envelope(m.value())).step): m for m in dead}
    if transactional:
        assert len(dead) == len(POISON), [dict(m.headers()) for m in dead]
    assert set(by_input) == set(POISON)
    too_large_topic = {BIG_OUTPUT: topics.run_events, BIG_STATE: topics.changelog(NAME)}
    for key, m in by_input.items():
        headers = dict(m.headers())
        assert headers["tether-dlq-reason"].decode() == POISON[key]
        detail = headers["tether-dlq-detail"].decode()
        assert too_large_topic[key] in detail and "bytes" in detail and "MSG_SIZE_TOO_LARGE" in detail, detail
        assert "xxxx" not in detail and "yyyy" not in detail
        assert m.value() == inputs[key]
        assert m.partition() == int(key[0][-1]) % PARTITIONS
        assert headers["tether-dlq-topic"].decode() == topics.commands
        assert headers["tether-dlq-service"].decode() == NAME
    # The metric counts what is in the log: exactly once, once each (not the aborted attempts); at
    # least once, each time produced (what was read above, or more produced after the read ended).
    for reason in POISON.values():
        counted = loop_mod.DEAD_LETTERS.labels(NAME, reason)._value.get() - dead_before[reason]
        in_log = sum(1 for m in dead if dict(m.headers())["tether-dlq-reason"].decode() == reason)
        if transactional:
            assert counted == in_log == 1, (reason, counted, in_log)
        else:
            assert counted >= in_log >= 1, (reason, counted, in_log)

    # Every other input has its output, in order, numbered by the committed counter without gaps:
    # nothing of a poison record (its big output, its normal output, its counter increment) and
    # nothing of an aborted attempt is visible. Exactly once where the loop is transactional.
    assert not [m for m in outputs if decode_envelope(m.value()).event_id.startswith("big:")]
    per_run: dict[str, list[tuple[int, str | None]]] = defaultdict(list)
    seen: set[str] = set()
    for m in sorted(outputs, key=lambda m: (m.partition(), m.offset())):
        env = decode_envelope(m.value())
        if not transactional and env.event_id in seen:
            continue  # at least once: a poison record's batch is produced again when replayed
        seen.add(env.event_id)
        per_run[env.run_id].append((open_payload(env).step, env.causation_id))
    for r in range(RUNS):
        run_id = f"run-{r}"
        kept = [f"in:{run_id}:{n}" for n in range(1, INPUTS_PER_RUN + 1) if (run_id, n) not in POISON]
        if transactional:
            assert per_run[run_id] == list(zip(range(1, len(kept) + 1), kept, strict=True)), per_run[run_id]
        else:
            # At least once nothing is rolled back: the normal output a poison record's handler
            # emitted before its big one was refused may be out (and again on the replay).
            poison_ids = {f"in:{run}:{n}" for run, n in POISON}
            assert [cause for _, cause in per_run[run_id] if cause not in poison_ids] == kept, per_run[run_id]
    if transactional:
        assert len(outputs) == expected_outputs

    # The committed states counted every input but the poison ones; no oversized state survives.
    latest = _latest_changelog(kafka_bootstrap, topics.changelog(NAME))
    states = {k.decode(): json.loads(v) for k, v in latest.items() if k.startswith(b"run-") and v is not None}
    if transactional:
        assert {run: s["counter"] for run, s in states.items()} == {
            f"run-{r}": INPUTS_PER_RUN - sum(1 for run, _ in POISON if run == f"run-{r}") for r in range(RUNS)}
    assert all(s["blob"] == "" for s in states.values())

    # Every input is committed: a restart would not meet the poison records again.
    check = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id(NAME)})
    committed = check.committed([TopicPartition(topics.commands, p) for p in range(PARTITIONS)], timeout=10)
    check.close()
    assert [tp.offset for tp in committed] == [INPUTS_PER_RUN * RUNS // PARTITIONS] * PARTITIONS
    # The poison records' effects were discarded after one attempt each; the others' replays
    # are the aborted batches' (each input reached its handler at most a few times).
    assert processor.handled[BIG_OUTPUT] >= 1 and processor.handled[BIG_STATE] >= 1
    assert not loop._poison, loop._poison
