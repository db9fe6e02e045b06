"""Parked runs cost no loop memory: thousands of idle runs, a bounded number of decoded states, identical reloads.

One processor parks RUNS runs (one input each), every tenth with a timer. The loop keeps at most
`state_cache_runs` decoded states while it handles them; the tick is shown only the runs whose
timer is due; a second input per run reads its state back after eviction and must find it equal;
a new instance restores the states from the changelog and reads them back equal too.
"""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from pydantic import BaseModel

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, PydanticStateCodec, TickContext, WorkDone
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics

PARTITIONS = 3
RUNS = 3_000
CACHE_RUNS = 64
PARK, CHECK, TIMER_FIRED = 1, 2, 3
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Parked(BaseModel):
    tenant_id: str
    note: str
    timer: bool


def expected(run: int) -> Parked:
    return Parked(tenant_id=f"t{run % 7}", note=f"run {run} " * 40, timer=run % 10 == 0)


class CountingCodec(PydanticStateCodec[Parked]):
    def __init__(self) -> None:
        super().__init__(Parked)
        self.decodes = 0

    def decode(self, data: bytes) -> Parked:
        self.decodes += 1
        return super().decode(data)


class Parker:
    """PARK stores the run's state; CHECK answers whether the state read back equals the one
    parked; the tick fires each run's timer once (the state then has none)."""

    def __init__(self, topics: Topics) -> None:
        self.name = "parker"
        self.inputs = [topics.commands]
        self.output = topics.run_events
        self.state_codec = CountingCodec()
        self.shown_without_timer: list[str] = []

    def handle(self, msg: Inbound, ctx: Context) -> None:
        run_id = msg.envelope.run_id
        run = int(run_id.removeprefix("run-"))
        if msg.payload.step == PARK:
            ctx.put_state(run_id, expected(run))
            answer = PARK
        else:
            state = ctx.get_state(run_id)
            answer = CHECK if state == expected(run).model_copy(update={"timer": False}) else -run
        self._emit(ctx, run_id, answer, msg.envelope.event_id)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work is started")

    def wake_at_ms(self, state: Parked) -> int | None:
        return 0 if state.timer else None

    def on_tick(self, ctx: TickContext) -> None:
        for p in ctx.owned_partitions():
            pctx = ctx.for_partition(p)
            for run_id in ctx.runs_due(p):
                state = pctx.get_state(run_id)
                if not state.timer:
                    self.shown_without_timer.append(run_id)
                    continue
                pctx.put_state(run_id, state.model_copy(update={"timer": False}))
                self._emit(pctx, run_id, TIMER_FIRED, f"timer:{run_id}")

    def _emit(self, ctx: Context, run_id: str, answer: int, cause: str) -> None:
        ctx.emit(self.output, StepGranted(step=answer, remaining=REMAINING), run_id=run_id, tenant_id="t",
                 event_id=f"out:{cause}", causation_id=cause)


class Instance:
    """One loop on a thread, with the most decoded states it was seen holding."""

    def __init__(self, processor: Parker, config: LoopConfig) -> None:
        self.loop = ProcessorLoop(processor, config)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.most_decoded = 0
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run(self.stop)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def observe(self) -> None:
        self.most_decoded = max(self.most_decoded, self.loop._store.decoded_count)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.errors, self.errors


def _produce(bootstrap: str, topic: str, step: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for run in range(RUNS):
        env = make_envelope(StepGranted(step=step, remaining=REMAINING), run_id=f"run-{run}", tenant_id="t",
                            event_id=f"in:{step}:{run}", producer="test", recorded_at_ms=0)
        producer.produce(topic, encode(env), env.run_id.encode(), partition=run % PARTITIONS)
        producer.poll(0)
    assert producer.flush(30) == 0


def _read_until(reader: Consumer, answers: dict[int, int], want: dict[int, int], instance: Instance) -> None:
    deadline = time.monotonic() + 90
    while any(answers.get(k, 0) < n for k, n in want.items()):
        assert time.monotonic() < deadline, f"outputs so far {answers}, want {want}"
        assert not instance.errors, instance.errors
        instance.observe()
        for msg in reader.consume(500, 0.2):
            if not msg.error():
                answer = open_payload(decode_envelope(msg.value())).step
                answers[answer] = answers.get(answer, 0) + 1
    instance.observe()


@pytest.mark.integration
def test_parked_runs_stay_on_disk_and_read_back_equal(kafka_bootstrap: str, topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["parker"], prefix=topic_prefix)
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, tick_interval_ms=200, state_cache_runs=CACHE_RUNS)
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
    answers: dict[int, int] = {}
    timers = RUNS // 10
    try:
        # Park every run; the tick fires each timer once.
        _produce(kafka_bootstrap, topics.commands, PARK)
        first_processor = Parker(topics)
        first = Instance(first_processor, config)
        try:
            _read_until(reader, answers, {PARK: RUNS, TIMER_FIRED: timers}, first)
            assert first.most_decoded <= CACHE_RUNS
            # Read every run back after the cache has long evicted it.
            decodes_before = first_processor.state_codec.decodes
            _produce(kafka_bootstrap, topics.commands, CHECK)
            _read_until(reader, answers, {CHECK: RUNS}, first)
            assert first.most_decoded <= CACHE_RUNS
            assert first_processor.state_codec.decodes - decodes_before >= RUNS - CACHE_RUNS
        finally:
            first.close()

        # A new instance restores the states from the changelog and reads them back.
        _produce(kafka_bootstrap, topics.commands, CHECK)
        second_processor = Parker(topics)
        second = Instance(second_processor, config)
        try:
            _read_until(reader, answers, {CHECK: 2 * RUNS}, second)
            assert second.most_decoded <= CACHE_RUNS
        finally:
            second.close()
    finally:
        reader.close()

    assert answers == {PARK: RUNS, TIMER_FIRED: timers, CHECK: 2 * RUNS}  # no -run: every state read back equal
    assert first_processor.shown_without_timer == [] and second_processor.shown_without_timer == []
