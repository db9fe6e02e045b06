"""Work outcomes (results and failures) come back through on_work_done; ticks see the owned runs that are due."""

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
from tether_testing.kafka import latest_values

PARTITIONS = 3
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class Pending(BaseModel):
    tenant_id: str
    outcome: int | None = None


class WorkThenExpire:
    """Input n starts work (odd n fails); the outcome is recorded; the next tick emits it and drops the state."""

    state_codec = PydanticStateCodec(Pending)

    def __init__(self, topics: Topics) -> None:
        self.name = "expire"
        self.inputs = [topics.commands]
        self.output = topics.run_events
        self.due_without_outcome: list[str] = []

    def handle(self, msg: Inbound, ctx: Context) -> None:
        n = msg.payload.step
        ctx.put_state(msg.envelope.run_id, Pending(tenant_id=msg.envelope.tenant_id))

        def work() -> int:
            if n % 2:
                raise ValueError(f"odd {n}")
            return n * 10

        ctx.start_work(f"w:{msg.envelope.run_id}", msg.envelope.run_id, msg.envelope.tenant_id, work)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        outcome = -1 if isinstance(done.error, ValueError) else done.result
        ctx.put_state(done.run_id, Pending(tenant_id=done.tenant_id, outcome=outcome))

    def wake_at_ms(self, state: Pending) -> int | None:
        return None if state.outcome is None else 0

    def on_tick(self, ctx: TickContext) -> None:
        for p in ctx.owned_partitions():
            pctx = ctx.for_partition(p)
            for run_id in ctx.runs_due(p):
                state = pctx.get_state(run_id)
                if state.outcome is None:
                    self.due_without_outcome.append(run_id)
                else:
                    pctx.emit(self.output, StepGranted(step=state.outcome, remaining=REMAINING), run_id=run_id,
                              tenant_id=state.tenant_id, event_id=f"out:{run_id}")
                    pctx.put_state(run_id, None)


@pytest.mark.integration
def test_work_results_and_failures_are_delivered_and_ticks_expire_runs(kafka_bootstrap: str, topic_prefix: str) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["expire"], prefix=topic_prefix)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for n in range(1, 13):
        env = make_envelope(StepGranted(step=n, remaining=REMAINING), run_id=f"run-{n}", tenant_id="t",
                            event_id=f"in:{n}", producer="test", recorded_at_ms=0)
        producer.produce(topics.commands, encode(env), env.run_id.encode(), partition=n % PARTITIONS)
    assert producer.flush(30) == 0

    processor = WorkThenExpire(topics)
    loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics, tick_interval_ms=200))
    stop = threading.Event()
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run(loop, stop, errors))
    thread.start()
    outputs: dict[str, tuple[int, int]] = {}
    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topics.run_events, p, 0) for p in range(PARTITIONS)])
    try:
        deadline = time.monotonic() + 90
        while len(outputs) < 12 and time.monotonic() < deadline and not errors:
            msg = reader.poll(0.2)
            if msg is not None and not msg.error():
                env = decode_envelope(msg.value())
                assert env.run_id not in outputs, f"{env.run_id} emitted twice"
                outputs[env.run_id] = (open_payload(env).step, msg.partition())
    finally:
        stop.set()
        thread.join(60)
        reader.close()
    assert not errors, errors
    assert processor.due_without_outcome == []  # the due index held back runs still waiting for work
    assert outputs == {f"run-{n}": (-1 if n % 2 else n * 10, n % PARTITIONS) for n in range(1, 13)}

    # The tick's tombstones reached the changelog: a restore finds no runs left.
    latest = latest_values(kafka_bootstrap, topics.changelog("expire"), PARTITIONS)
    runs = {k: v for k, v in latest.items() if k.startswith(b"run-")}
    assert len(runs) == 12 and all(v is None for v in runs.values())


def _run(loop: ProcessorLoop, stop: threading.Event, errors: list[BaseException]) -> None:
    try:
        loop.run(stop)
    except BaseException as exc:  # reported by the test
        errors.append(exc)
