"""Poison effects that come from finished work (`on_work_done`) or from a tick (`on_tick`), on the
real broker: the work is dead-lettered and the tick dropped, with their effects discarded, while
every input and every other piece of work stays exactly once and the loop goes on.

test_loop_poison_records.py covers the record origin; these are the other two origins `_deliver`
and `_tick` blame (("work", partition, key, epoch) and ("tick",)).
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict

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
from tether_testing.kafka import committed_records, latest_values, set_topic_configs
from tether_testing.loops import LoopThread

PARTITIONS = 2
RUNS = 4
INPUTS_PER_RUN = 8
#: (run, input number) whose work's result handling emits an output too large to produce / puts a
#: state too large to checkpoint (besides its normal output, produced before the big one is refused).
BIG_OUTPUT = ("run-0", 3)
BIG_STATE = ("run-1", 4)
POISON = {BIG_OUTPUT: "OUTPUT_TOO_LARGE", BIG_STATE: "STATE_TOO_LARGE"}
#: Work whose result lands in the same batch as `BIG_OUTPUT`'s, right behind it: both wait until the
#: loop is held in the on_work_done of `SLOW_RESULT` (of the next round, so both have started by
#: then), then `BIG_OUTPUT`'s finishes, and `BEHIND_BIG`'s 100 ms later.
SLOW_RESULT = ("run-2", 4)
BEHIND_BIG = ("run-3", 3)
#: The on_tick call (counted by the processor, not derived from the state, so a later call does
#: not repeat it) that emits an output too large to produce besides its normal effects.
POISON_TICK = 3
#: The broker-side limit the "broker-refuses" cases set on the output and changelog topics.
TOPIC_LIMIT = 100_000
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)

LIMITS = pytest.mark.parametrize("refused_by", ["producer", "broker"], ids=["producer-refuses", "broker-refuses"])


class Counted(BaseModel):
    inputs: int = 0
    works: int = 0
    ticks: int = 0
    blob: str = ""


class PoisonWork:
    """Each input gets one output numbered by the run's input counter and starts one piece of work
    (returning the input's number); each result gets one output numbered by the run's work counter.
    Two results also produce something too large (`BIG_OUTPUT`, `BIG_STATE`) of `big_bytes`; the
    big state is carried on by whatever the run handles next in the batch."""

    state_codec = PydanticStateCodec(Counted)

    def __init__(self, name: str, topics: Topics, big_bytes: int) -> None:
        self.name = name
        self.inputs = [topics.commands]
        self.output = topics.run_events
        self.big_bytes = big_bytes
        self.results: defaultdict[tuple[str, int], int] = defaultdict(int)
        self.loop_held = threading.Event()

    def _work(self, run_id: str, n: int) -> int:
        if (run_id, n) in (BIG_OUTPUT, BEHIND_BIG):
            self.loop_held.wait(10)
        if (run_id, n) == BEHIND_BIG:
            time.sleep(0.1)
        return n

    def handle(self, msg: Inbound, ctx: Context) -> None:
        run_id, n = msg.envelope.run_id, msg.payload.step
        state = ctx.get_state(run_id) or Counted()
        state = state.model_copy(update={"inputs": state.inputs + 1})
        ctx.emit(self.output, StepGranted(step=state.inputs, remaining=REMAINING), run_id=run_id,
                 tenant_id=msg.envelope.tenant_id, event_id=f"in-out:{run_id}:{n}", causation_id=msg.envelope.event_id)
        ctx.put_state(run_id, state)
        ctx.start_work(f"w:{run_id}:{n}", run_id, msg.envelope.tenant_id, lambda: self._work(run_id, n))

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        run_id, n = done.run_id, done.result
        self.results[(run_id, n)] += 1
        if (run_id, n) == SLOW_RESULT:
            self.loop_held.set()
            time.sleep(0.5)
        state = ctx.get_state(run_id) or Counted()
        state = state.model_copy(update={"works": state.works + 1})
        ctx.emit(self.output, StepGranted(step=state.works, remaining=REMAINING), run_id=run_id,
                 tenant_id=done.tenant_id, event_id=f"done:{run_id}:{n}")
        if (run_id, n) == BIG_OUTPUT:
            ctx.emit(self.output, RunRejected(request_id="x", reason_code="BIG", detail="x" * self.big_bytes),
                     run_id=run_id, tenant_id=done.tenant_id, event_id=f"big:{run_id}:{n}")
        if (run_id, n) == BIG_STATE:
            state = state.model_copy(update={"blob": "y" * self.big_bytes})
        ctx.put_state(run_id, state)

    def on_tick(self, ctx: TickContext) -> None:
        pass


class PoisonTick:
    """Each input gets one output numbered by the run's input counter; each tick gives each owned
    partition's `ticker-<p>` run one output numbered by its tick counter. The `POISON_TICK`th call
    (of those that own partitions) also emits an output too large to produce."""

    state_codec = PydanticStateCodec(Counted)

    def __init__(self, name: str, topics: Topics, big_bytes: int) -> None:
        self.name = name
        self.inputs = [topics.commands]
        self.output = topics.run_events
        self.big_bytes = big_bytes
        self.tick_calls = 0

    def handle(self, msg: Inbound, ctx: Context) -> None:
        run_id, n = msg.envelope.run_id, msg.payload.step
        state = ctx.get_state(run_id) or Counted()
        state = state.model_copy(update={"inputs": state.inputs + 1})
        ctx.emit(self.output, StepGranted(step=state.inputs, remaining=REMAINING), run_id=run_id,
                 tenant_id=msg.envelope.tenant_id, event_id=f"in-out:{run_id}:{n}", causation_id=msg.envelope.event_id)
        ctx.put_state(run_id, state)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def on_tick(self, ctx: TickContext) -> None:
        owned = ctx.owned_partitions()
        if not owned:
            return  # a tick of the batch that took the assignment, before the partitions are restored
        self.tick_calls += 1
        for p in owned:
            pctx = ctx.for_partition(p)
            run_id = f"ticker-{p}"
            state = pctx.get_state(run_id) or Counted()
            state = state.model_copy(update={"ticks": state.ticks + 1})
            pctx.emit(self.output, StepGranted(step=state.ticks, remaining=REMAINING), run_id=run_id,
                      tenant_id="t", event_id=f"tick:{p}:{state.ticks}")
            pctx.put_state(run_id, state)
            if self.tick_calls == POISON_TICK:
                pctx.emit(self.output, RunRejected(request_id="x", reason_code="BIG", detail="x" * self.big_bytes),
                          run_id=run_id, tenant_id="t", event_id=f"big:tick:{p}")


def _big_bytes(bootstrap: str, topics: Topics, name: str, refused_by: str) -> int:
    if refused_by == "producer":
        # Over the producer's message.max.bytes (1,000,000): produce() itself raises MSG_SIZE_TOO_LARGE.
        return 1_200_000
    # Under the producer's limit, over the topics': the broker refuses the request and the
    # transaction fails at its commit (MSG_SIZE_TOO_LARGE in the delivery reports).
    set_topic_configs(bootstrap, [topics.run_events, topics.changelog(name)], {"max.message.bytes": str(TOPIC_LIMIT)})
    return 2 * TOPIC_LIMIT


def _start(loop: ProcessorLoop) -> LoopThread:
    running = LoopThread(loop).start()
    deadline = time.monotonic() + 30
    while not loop.ready and time.monotonic() < deadline and not running.errors:
        time.sleep(0.05)
    assert loop.ready, running.errors
    return running


def _produce_inputs_while_running(bootstrap: str, topics: Topics) -> None:
    """Input n of every run, one round every 100 ms: inputs keep arriving after the poison work."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for n in range(1, INPUTS_PER_RUN + 1):
        for r in range(RUNS):
            env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"run-{r}", tenant_id="t",
                                event_id=f"in:run-{r}:{n}", producer="test", recorded_at_ms=0)
            producer.produce(topics.commands, encode(env), f"run-{r}".encode(), partition=r % PARTITIONS)
        assert producer.flush(30) == 0
        time.sleep(0.1)


def _wait_for(bootstrap: str, topic: str, done: object, running: LoopThread, timeout_s: float) -> None:
    """Read `topic` (read_committed) until `done(records)` or the loop fails or the time is up."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}.wait",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    seen: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not running.errors and not done(seen):  # type: ignore[operator]
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                seen.append(msg)
    finally:
        reader.close()


#: Aborts allowed beyond the ones the poison records cause: on a loaded machine an unrelated
#: abort (a transaction timing out, librdkafka's INVALID_TXN_STATE, confluentinc/librdkafka#4849,
#: which CI hit in test_loop_abort.py) must not fail these tests; an endless replay, what they
#: guard against, aborts dozens of times in their time.
SPARE_ABORTS = 2


def _read_all(bootstrap: str, topic: str) -> list:
    """Every committed record of `topic`, in partition and offset order."""
    return committed_records(bootstrap, topic, PARTITIONS)


def _outputs_by_run(records: list) -> dict[str, list[tuple[str, int]]]:
    """Per run, its outputs' (event id, step) in log order."""
    per_run: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for m in records:
        env = decode_envelope(m.value())
        assert not env.event_id.startswith("big:"), f"an oversized output was committed: {env.event_id}"
        per_run[env.run_id].append((env.event_id, open_payload(env).step))
    return per_run


def _states(bootstrap: str, changelog: str) -> dict[str, dict]:
    latest = latest_values(bootstrap, changelog, PARTITIONS)
    return {k.decode(): json.loads(v) for k, v in latest.items() if not k.startswith(b"__") and v is not None}


def _aborted(name: str) -> float:
    return loop_mod.BATCHES.labels(name, "aborted")._value.get()


def _out_of_sequence_aborts(logs: list[dict]) -> list[str]:
    """Aborts on "skipped sequence numbers" (OUT_OF_ORDER_SEQUENCE_NUMBER): what a replay met after a
    broker refusal before the loop replaced its producer there; its commit could stall for the
    transaction timeout and the producer be fenced by the coordinator's timeout of it."""
    return [e["error"] for e in logs if e["event"] == "batch_aborted" and "sequence" in e["error"]]


@pytest.mark.integration
@LIMITS
def test_work_whose_outcome_is_too_large_is_dead_lettered_and_everything_else_stays_exactly_once(
    kafka_bootstrap: str, topic_prefix: str, refused_by: str
) -> None:
    name = f"poison-work-{refused_by}"
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, [name], prefix=topic_prefix)
    processor = PoisonWork(name, topics, _big_bytes(kafka_bootstrap, topics, name, refused_by))
    dead_before = {reason: loop_mod.DEAD_LETTERS.labels(name, reason)._value.get() for reason in POISON.values()}
    aborted_before = _aborted(name)
    expected_outputs = 2 * RUNS * INPUTS_PER_RUN - len(POISON)
    with structlog.testing.capture_logs() as logs:
        # Bound inside the capture: the loop binds its logger when it is built.
        loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics, batch_max_ms=20))
        running = _start(loop)
        try:
            _produce_inputs_while_running(kafka_bootstrap, topics)
            # Without the dead letter the loop replays the poison work's batch forever: bounded here.
            _wait_for(kafka_bootstrap, topics.run_events, lambda seen: len(seen) >= expected_outputs, running, 40)
            _wait_for(kafka_bootstrap, topics.dead_letters, lambda seen: len(seen) >= len(POISON), running, 20)
            assert running.is_alive() and not running.errors, running.errors
        finally:
            running.stop()
    assert not running.errors, running.errors
    assert not running.is_alive()
    assert not _out_of_sequence_aborts(logs), _out_of_sequence_aborts(logs)

    # Each poison work was dead-lettered once, naming its run, work key, reason and the topic and
    # size of what could not be produced (not its content).
    dead = _read_all(kafka_bootstrap, topics.dead_letters)
    by_work = {dict(m.headers())["tether-dlq-work-key"].decode(): m for m in dead}
    assert len(dead) == len(POISON), [dict(m.headers()) for m in dead]
    assert set(by_work) == {f"w:{run}:{n}" for run, n in POISON}
    too_large_topic = {BIG_OUTPUT: topics.run_events, BIG_STATE: topics.changelog(name)}
    for (run, n), reason in POISON.items():
        m = by_work[f"w:{run}:{n}"]
        headers = dict(m.headers())
        assert headers["tether-dlq-reason"].decode() == reason
        detail = headers["tether-dlq-detail"].decode()
        assert too_large_topic[(run, n)] in detail and "bytes" in detail and "MSG_SIZE_TOO_LARGE" in detail, detail
        assert "xxxx" not in detail and "yyyy" not in detail
        assert headers["tether-dlq-service"].decode() == name
        assert headers["tether-run"].decode() == run
        assert m.key() == run.encode() and m.value() is None
        assert m.partition() == int(run[-1]) % PARTITIONS
    # The metric counts committed dead letters: not again for the aborted attempts (see below).
    for reason in POISON.values():
        assert loop_mod.DEAD_LETTERS.labels(name, reason)._value.get() == dead_before[reason] + 1

    # Every input has its one output, in order, numbered by the committed input counter; every
    # result but the poison ones has its one output, numbered by the committed work counter
    # without gaps: nothing of a poison outcome (its big effect, its normal output, its counter
    # increment) and nothing of an aborted attempt is visible.
    outputs = _read_all(kafka_bootstrap, topics.run_events)
    expected_ids = {f"{kind}:run-{r}:{n}" for kind in ("in-out", "done") for r in range(RUNS)
                    for n in range(1, INPUTS_PER_RUN + 1)} - {f"done:{run}:{n}" for run, n in POISON}
    ids = [decode_envelope(m.value()).event_id for m in outputs]
    assert len(ids) == len(set(ids)) == expected_outputs, ("missing", expected_ids - set(ids))
    per_run = _outputs_by_run(outputs)
    assert set(per_run) == {f"run-{r}" for r in range(RUNS)}
    for r in range(RUNS):
        run_id = f"run-{r}"
        ins = [(eid, step) for eid, step in per_run[run_id] if eid.startswith("in-out:")]
        assert ins == [(f"in-out:{run_id}:{n}", n) for n in range(1, INPUTS_PER_RUN + 1)], ins
        dones = [(eid, step) for eid, step in per_run[run_id] if eid.startswith("done:")]
        kept = {f"done:{run_id}:{n}" for n in range(1, INPUTS_PER_RUN + 1) if (run_id, n) not in POISON}
        assert sorted(eid for eid, _ in dones) == sorted(kept), dones
        assert [step for _, step in dones] == list(range(1, len(kept) + 1)), dones

    # The committed states counted every input and every result but the poison ones; no oversized
    # state survives.
    states = _states(kafka_bootstrap, topics.changelog(name))
    assert {run: (s["inputs"], s["works"]) for run, s in states.items()} == {
        f"run-{r}": (INPUTS_PER_RUN, INPUTS_PER_RUN - sum(1 for run, _ in POISON if run == f"run-{r}"))
        for r in range(RUNS)}
    assert all(s["blob"] == "" for s in states.values())

    # Every input is committed (the held ones released by their work, dead-lettered or not).
    check = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id(name)})
    committed = check.committed([TopicPartition(topics.commands, p) for p in range(PARTITIONS)], timeout=10)
    check.close()
    assert [tp.offset for tp in committed] == [INPUTS_PER_RUN * RUNS // PARTITIONS] * PARTITIONS
    # One abort found each poison outcome; no endless replay, and no further abort after a broker
    # refusal (the loop replaces its producer there: above). SPARE_ABORTS: see its definition.
    aborted = _aborted(name) - aborted_before
    assert 1 <= aborted <= len(POISON) + SPARE_ABORTS
    # Once found, a poison outcome never reaches on_work_done again: replays dead-letter it. Before
    # that, every call of it ended in an abort (its batch can never commit) — its own, or one found
    # for something else first: BIG_STATE, delivered in the same batch before BIG_OUTPUT whose
    # produce() refusal ends the batch, is handled again in the replay (CI saw 2). So at most one
    # call per abort, never one per replay without end.
    for poison in POISON:
        assert 1 <= processor.results[poison] <= aborted, (poison, processor.results[poison], aborted)
    assert not loop._poison, loop._poison


@pytest.mark.integration
@LIMITS
def test_a_tick_whose_output_is_too_large_is_dropped_and_later_ticks_and_inputs_go_on(
    kafka_bootstrap: str, topic_prefix: str, refused_by: str
) -> None:
    name = f"poison-tick-{refused_by}"
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, [name], prefix=topic_prefix)
    processor = PoisonTick(name, topics, _big_bytes(kafka_bootstrap, topics, name, refused_by))
    aborted_before = _aborted(name)
    later_ticks = POISON_TICK + 3
    with structlog.testing.capture_logs() as logs:
        # Bound inside the capture: the loop binds its logger when it is built.
        loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics, batch_max_ms=20,
                                                   tick_interval_ms=100))
        running = _start(loop)
        try:
            _produce_inputs_while_running(kafka_bootstrap, topics)

            def done(seen: list) -> bool:
                ins = sum(1 for m in seen if m.key().startswith(b"run-"))
                ticks = [m for m in seen if m.key().startswith(b"ticker-")]
                return ins >= RUNS * INPUTS_PER_RUN and len(ticks) >= PARTITIONS * later_ticks

            _wait_for(kafka_bootstrap, topics.run_events, done, running, 40)
            assert running.is_alive() and not running.errors, running.errors
        finally:
            running.stop()
    assert not running.errors, running.errors
    assert not running.is_alive()
    assert not _out_of_sequence_aborts(logs), _out_of_sequence_aborts(logs)

    # The poison tick was dropped, once, with its reason; nothing of it reached the dead letters.
    dropped = [e for e in logs if e["event"] == "tick_dropped"]
    assert len(dropped) == 1, dropped
    assert dropped[0]["reason"] == "OUTPUT_TOO_LARGE"
    assert topics.run_events in dropped[0]["detail"] and "MSG_SIZE_TOO_LARGE" in dropped[0]["detail"]
    assert _read_all(kafka_bootstrap, topics.dead_letters) == []

    # Each input has its one output, in order; each partition's committed ticks are numbered
    # without gaps or repeats (the dropped tick's normal output and counter increment are gone
    # too), and ticks went on after the dropped one.
    per_run = _outputs_by_run(_read_all(kafka_bootstrap, topics.run_events))
    for r in range(RUNS):
        run_id = f"run-{r}"
        assert per_run[run_id] == [(f"in-out:{run_id}:{n}", n) for n in range(1, INPUTS_PER_RUN + 1)], per_run[run_id]
    states = _states(kafka_bootstrap, topics.changelog(name))
    for p in range(PARTITIONS):
        ticks = per_run[f"ticker-{p}"]
        assert len(ticks) >= later_ticks, ticks
        assert ticks == [(f"tick:{p}:{k}", k) for k in range(1, len(ticks) + 1)], ticks
        assert states[f"ticker-{p}"]["ticks"] == len(ticks)
    assert {run: s["inputs"] for run, s in states.items() if run.startswith("run-")} == {
        f"run-{r}": INPUTS_PER_RUN for r in range(RUNS)}
    # One abort found the poison tick (and none follows a broker refusal: above). on_tick ran once
    # more than the ticks committed for the dropped call and for each tick of a batch aborted after it.
    aborted = _aborted(name) - aborted_before
    assert 1 <= aborted <= 1 + SPARE_ABORTS
    assert 1 <= processor.tick_calls - len(per_run["ticker-0"]) <= aborted
    assert not loop._poison, loop._poison
