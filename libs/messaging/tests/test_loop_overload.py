"""An overloaded batch commits part of its records before the transaction times out, and the rest follow in order."""

from __future__ import annotations

import importlib.util
import itertools
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from tether_contracts.records import Remaining, StepGranted
from tether_messaging import loop as loop_mod
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics

# The exactly-once checker of the kill tests (a sibling file, run there as a process).
_spec = importlib.util.spec_from_file_location("eos_processor", Path(__file__).with_name("eos_processor.py"))
eos_processor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eos_processor)

PARTITIONS = 2
RUNS = 4
INPUTS_PER_RUN = 15
TOTAL = RUNS * INPUTS_PER_RUN
TRANSACTION_TIMEOUT_MS = 2_000
#: Virtual time each record's handler takes: the 1 s handling share of the 2 s timeout fits four.
HANDLER_S = 0.3
MAX_PER_BATCH = 4


class VirtualClock:
    """Real monotonic time plus what the handlers pretended to spend."""

    def __init__(self) -> None:
        self.spent = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.spent


class SlowEos(eos_processor.EosProcessor):
    """The exactly-once checker of the kill tests whose every record takes HANDLER_S (virtual) to handle.

    Records which batch handled each record: the loop reads `clock_ms` once per batch, so a
    counting clock numbers the batches and `ctx.now_ms` is the batch's number.
    """

    def __init__(self, topics: Topics, clock: VirtualClock) -> None:
        super().__init__(topics, work_sleep_ms=20)
        self.clock = clock
        self.batch_of: list[int] = []

    def handle(self, msg: Inbound, ctx: Context) -> None:
        super().handle(msg, ctx)
        self.clock.spent += HANDLER_S
        self.batch_of.append(ctx.now_ms)


def _produce_inputs(bootstrap: str, topic: str) -> dict[str, list[str]]:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50})
    expected: dict[str, list[str]] = defaultdict(list)
    for n in range(1, INPUTS_PER_RUN + 1):
        for r in range(RUNS):
            run = f"run-{r}"
            env = make_envelope(StepGranted(step=n, remaining=Remaining(steps=0, tokens=0, cost_usd_micros=0,
                                                                        wall_clock_ms=0)),
                                run_id=run, tenant_id="t", event_id=f"in:{run}:{n}", producer="test", recorded_at_ms=0)
            producer.produce(topic, encode(env), run.encode(), partition=r % PARTITIONS)
            expected[run].append(env.event_id)
    assert producer.flush(30) == 0
    return expected


@pytest.mark.integration
def test_a_slow_batch_commits_what_it_handled_in_time_and_the_rest_follows_exactly_once_in_order(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["eos"], prefix=topic_prefix)
    # Every input is fetched before the loop starts, so without a cap one batch would take them all.
    expected = _produce_inputs(kafka_bootstrap, topics.commands)
    clock = VirtualClock()
    processor = SlowEos(topics, clock)
    batches = itertools.count(1)
    loop = ProcessorLoop(
        processor,
        LoopConfig(bootstrap=kafka_bootstrap, topics=topics, transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
                   batch_max_ms=500),
        clock_ms=lambda: next(batches),
        monotonic=clock,
    )
    carried_before = loop_mod.CARRIED.labels("eos")._value.get()
    aborted_before = loop_mod.BATCHES.labels("eos", "aborted")._value.get()
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # surfaced below (a fenced producer would end up here)
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
    outputs: list[tuple[int, int, object]] = []
    try:
        deadline = time.monotonic() + 90
        while len(outputs) < TOTAL and time.monotonic() < deadline and not errors:
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                outputs.append((msg.partition(), msg.offset(), decode_envelope(msg.value())))
        end = time.monotonic() + 1  # anything beyond TOTAL would be a duplicate
        while time.monotonic() < end:
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                outputs.append((msg.partition(), msg.offset(), decode_envelope(msg.value())))
    finally:
        stop.set()
        thread.join(60)
        reader.close()
    assert not errors, errors

    per_batch = defaultdict(int)
    for batch in processor.batch_of:
        per_batch[batch] += 1
    assert max(per_batch.values()) <= MAX_PER_BATCH, dict(per_batch)
    assert loop_mod.CARRIED.labels("eos")._value.get() > carried_before

    per_run: dict[str, list[tuple[int, str | None]]] = defaultdict(list)
    for _p, _o, env in sorted(outputs, key=lambda o: (o[0], o[1])):
        per_run[env.run_id].append((open_payload(env).step, env.causation_id))
    assert len(outputs) == TOTAL
    for run, outs in per_run.items():
        assert [step for step, _ in outs] == list(range(1, INPUTS_PER_RUN + 1)), f"{run}: counters {outs}"
        assert [cause for _, cause in outs] == expected[run], f"{run}: not one output per input in order"
    # Each input handled once, but for replays: an unrelated abort (a transaction the broker timed
    # out on a loaded machine, librdkafka's INVALID_TXN_STATE, confluentinc/librdkafka#4849)
    # replays its batch, at most MAX_PER_BATCH records; the outputs above stay exactly once.
    aborted = loop_mod.BATCHES.labels("eos", "aborted")._value.get() - aborted_before
    assert TOTAL <= len(processor.batch_of) <= TOTAL + MAX_PER_BATCH * aborted, (len(processor.batch_of), aborted)
