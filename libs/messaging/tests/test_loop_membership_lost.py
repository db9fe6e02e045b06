"""A loop whose group membership is gone while it hands in finished work serves its consumer: it does not spin.

Found by a 20-minute `make chaos`: after a broker restart, both tool-gateway slots had finished
work to hand in when their consumers' membership was gone (UNKNOWN_MEMBER_ID, FENCED_INSTANCE_ID).
Every commit failed on the offsets, the batch aborted, and its outcomes were handed in again at
once from memory, without a consumer poll in between, so the consumer never served the rebalance
(or the fatal error) that would have ended it: one slot aborted 92,000 batches in four minutes,
writing an aborted transaction into its changelog partitions every few milliseconds, until a
SIGKILL; the slot that took its partitions over could not read one of them to its end and exited.

Here the member is fenced by a consumer joining with its static instance id while its work runs
(what the coordinator's view after the restart amounted to). Fenced is fatal for a static member:
the loop must end (its supervisor restarts it) after a few aborted batches, not spin.
"""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, Producer
from prometheus_client import REGISTRY

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import make_envelope
from tether_messaging.loop import FatalLoopError, LoopConfig, ProcessorLoop
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_messaging.serde import encode
from tether_messaging.topics import Topics
from tether_testing.loops import LoopThread

REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)
NAME = "member"


class HeldWork:
    """Each input starts work that runs until the test releases it; its outcome is the output."""

    state_codec = None

    def __init__(self, topics: Topics) -> None:
        self.name = NAME
        self.inputs = [topics.commands]
        self.output = topics.run_events
        self.started = threading.Event()
        self.release = threading.Event()

    def handle(self, msg: Inbound, ctx: Context) -> None:
        env = msg.envelope

        def work() -> str:
            self.started.set()
            self.release.wait(60)
            return env.event_id

        ctx.start_work(f"w:{env.event_id}", env.run_id, env.tenant_id, work)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        ctx.emit(self.output, StepGranted(step=1, remaining=REMAINING), run_id=done.run_id, tenant_id=done.tenant_id,
                 event_id=f"out:{done.result}", causation_id=done.result)

    def on_tick(self, ctx: TickContext) -> None:
        return


def _aborted() -> float:
    return REGISTRY.get_sample_value("tether_loop_batches_total", {"service": NAME, "outcome": "aborted"}) or 0.0


def _wait(what: str, cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.integration
def test_a_fenced_static_member_with_work_to_hand_in_ends_instead_of_aborting_forever(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    topics = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, 1, [NAME], prefix=topic_prefix)
    processor = HeldWork(topics)
    loop = ProcessorLoop(processor, LoopConfig(bootstrap=kafka_bootstrap, topics=topics, static_membership=True,
                                               instance_id=0, session_timeout_ms=10_000))
    running = LoopThread(loop).start()
    intruder: Consumer | None = None
    aborted_before = _aborted()
    try:
        _wait("the loop to be ready", lambda: loop.ready or bool(running.errors), 60)
        assert not running.errors, running.errors
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        env = make_envelope(StepGranted(step=1, remaining=REMAINING), run_id="run-1", tenant_id="t",
                            event_id="in:1", producer="test", recorded_at_ms=0)
        producer.produce(topics.commands, encode(env), env.run_id.encode(), partition=0)
        assert producer.flush(30) == 0
        _wait("the work to start", processor.started.is_set, 30)

        # Another member joins with the loop's static instance id: the coordinator fences the loop's.
        assigned = threading.Event()
        intruder = Consumer({
            "bootstrap.servers": kafka_bootstrap, "group.id": topics.group_id(NAME),
            "group.instance.id": loop.group_instance_id, "session.timeout.ms": 10_000,
            "partition.assignment.strategy": "range", "enable.auto.commit": False,
        })
        intruder.subscribe([topics.commands], on_assign=lambda c, parts: assigned.set())

        def joined() -> bool:
            intruder.poll(0.1)
            return assigned.is_set()

        _wait("the intruder's assignment", joined, 60)
        processor.release.set()  # the outcome is handed in by a member that is no longer one

        def ended() -> bool:
            intruder.poll(0)
            return not running.is_alive()

        _wait("the loop to end", ended, 60)
    finally:
        processor.release.set()
        running.stop()
        if intruder is not None:
            intruder.close()
    assert len(running.errors) == 1 and isinstance(running.errors[0], FatalLoopError), running.errors
    assert "fenced" in str(running.errors[0]).lower(), running.errors[0]
    # A few aborted batches at most (each a transaction with a checkpoint and an abort marker),
    # not one every few milliseconds until a SIGKILL.
    assert _aborted() - aborted_before <= 20, _aborted() - aborted_before
