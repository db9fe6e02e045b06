"""Expiry waits for the decisions recorded in time: a restart past an approval's expiry reads them before it
expires anything, and so does a running service that is behind on its commands when the expiry passes (the
approval processor on the real loop and broker, its clock injected)."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from tether_approval.bootstrap import build_deps
from tether_approval.entrypoint import ApprovalProcessor
from tether_approval.handlers import decided_event_id
from tether_approval.settings import ApprovalSettings
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalOutcome,
    ApprovalRequested,
    CancelRun,
    Caps,
    DecideApproval,
    ModelRef,
    RiskClass,
    RunAccepted,
    ToolSpec,
)
from tether_messaging.admin import declare_topics
from tether_messaging.envelopes import derived_id, headers_for, make_envelope
from tether_messaging.loop import LoopConfig, ProcessorLoop
from tether_messaging.partitioner import partition_for
from tether_messaging.processor import Context, Inbound
from tether_messaging.serde import decode_envelope, encode, open_payload
from tether_messaging.topics import Topics
from tether_testing.kafka import committed_records, latest_values

PARTITIONS = 2
TENANT, RUN = "tenant-a", "run-a1"
T0 = 1_700_000_000_000
EXPIRES_AT = T0 + 60_000
ARGS_JSON = '{"to":"ceo@example.com"}'
ARGS_HASH = hashlib.sha256(ARGS_JSON.encode()).hexdigest()


class Clock:
    """The loop's clock (`ProcessorLoop(clock_ms=...)`): the test moves it."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


class Sender:
    """Writes records as budget (run events) and run-api (commands) do, on the run's partition."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.partition = partition_for(TENANT, RUN, PARTITIONS)

    def send(self, topic: str, payload: AvroRecord, *what: object, producer: str, recorded_at_ms: int,
             run_id: str = RUN) -> None:
        env = make_envelope(payload, run_id=run_id, tenant_id=TENANT, event_id=derived_id(run_id, *what),
                            producer=producer, recorded_at_ms=recorded_at_ms)
        self.producer.produce(topic, encode(env), run_id.encode(), partition=self.partition, headers=headers_for(env))
        if self.producer.flush(30):
            raise RuntimeError("record not delivered")


def accepted_run() -> RunAccepted:
    caps = Caps(max_steps=5, max_wall_clock_ms=600_000, max_tokens=10_000, max_cost_usd_micros=10_000)
    tools = [ToolSpec(name="send_email", version=1, description="s", args_schema_json="{}",
                      risk_class=RiskClass.IRREVERSIBLE, idempotent=False, untrusted_source=False,
                      executor_kind="builtin")]
    return RunAccepted(
        principal_id="alice", request_id="q1", goal="g", tools=tools, caps=caps, deadline_ms=0,
        agent=AgentSpec(agent_id="a", version=1, name="a", instructions="i",
                        model=ModelRef(provider="openai", name="m"), tool_allowlist=["send_email"], caps=caps),
    )


def request(approval_id: str, call_id: str) -> ApprovalRequested:
    return ApprovalRequested(
        approval_id=approval_id, step=1, call_id=call_id, idem_key=f"idem-{call_id}", tool_name="send_email",
        args_json=ARGS_JSON, args_hash=ARGS_HASH, risk_class=RiskClass.IRREVERSIBLE, reasons=["RISK_CLASS"],
        expires_at_ms=EXPIRES_AT, policy_version="p1", inputs_hash="0" * 64,
    )


def decision(approval_id: str, call_id: str) -> DecideApproval:
    return DecideApproval(approval_id=approval_id, call_id=call_id, args_hash=ARGS_HASH, approver_id="bob",
                          approver_roles=["approver"], approve=True)


@contextmanager
def running(processor: ApprovalProcessor, config: LoopConfig, clock: Clock) -> Iterator[ProcessorLoop]:
    """The approval processor on the real loop in a thread; a graceful stop (commit, leave the group) at exit."""
    loop = ProcessorLoop(processor, config, clock_ms=clock)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, name="approval-loop")
    thread.start()
    try:
        yield loop
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "the loop did not stop"
    assert not errors, errors


def wait_until(what: str, done, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.1)


def decisions(bootstrap: str, topic: str) -> list[ApprovalDecided]:
    """Every ApprovalDecided committed to the run intake so far."""
    out = []
    for msg in committed_records(bootstrap, topic, PARTITIONS):
        payload = open_payload(decode_envelope(msg.value()))
        if isinstance(payload, ApprovalDecided):
            out.append(payload)
    return out


@pytest.mark.integration
def park_two_approvals(send: Sender, topics: Topics, kafka_bootstrap: str) -> None:
    """Accept RUN, request apr_1 and apr_2 in it, and wait until the running service has checkpointed both."""
    send.send(topics.run_events, accepted_run(), "RunAccepted", producer="budget", recorded_at_ms=T0)
    send.send(topics.run_events, request("apr_1", "1.0"), "ApprovalRequested", 1, producer="budget",
              recorded_at_ms=T0)
    send.send(topics.run_events, request("apr_2", "1.1"), "ApprovalRequested", 2, producer="budget",
              recorded_at_ms=T0)

    def both_pending() -> bool:
        state = latest_values(kafka_bootstrap, topics.changelog("approval"), PARTITIONS).get(RUN.encode())
        return state is not None and b'"apr_1"' in state and b'"apr_2"' in state

    wait_until("the approvals are parked (checkpointed)", both_pending)


def test_a_restart_past_the_expiry_applies_the_decisions_recorded_in_time_before_expiring(kafka_bootstrap: str) -> None:
    # Two approvals of one run, pending, both expiring at EXPIRES_AT. The service stops; run-api records
    # bob's APPROVE of apr_1 in time (1 s before the expiry) and bob's APPROVE of apr_2 too late (1 ms
    # after), behind other commands; the service comes back with its clock past the expiry and the grace.
    # Before, its first tick after the restore ran before it had read that backlog: apr_1 expired, and
    # the approval a human gave in time was refused DECISION_AFTER_EXPIRY.
    prefix = f"test-approval-restart-{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["approval"], prefix=prefix)
    settings = ApprovalSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=prefix, partitions=PARTITIONS)
    # A tick due at every batch and small batches: the restarted loop would tick while most of the
    # commands backlog is still unread, as a real one behind a large backlog does.
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, tick_interval_ms=1, batch_max_messages=5)
    clock = Clock(T0)
    send = Sender(kafka_bootstrap)

    with running(ApprovalProcessor(build_deps(settings, registry=CollectorRegistry())), config, clock):
        park_two_approvals(send, topics, kafka_bootstrap)

    # The service is down: the commands pile up.
    for n in range(12):
        send.send(topics.commands, CancelRun(principal_id="alice"), "Cancel", n, producer="run-api",
                  recorded_at_ms=EXPIRES_AT - 2_000, run_id=f"other-{n}")
    send.send(topics.commands, decision("apr_1", "1.0"), "Decide", 1, producer="run-api",
              recorded_at_ms=EXPIRES_AT - 1_000)
    send.send(topics.commands, decision("apr_2", "1.1"), "Decide", 2, producer="run-api",
              recorded_at_ms=EXPIRES_AT + 1)

    clock.now_ms = EXPIRES_AT + settings.expiry_grace_ms + 5_000
    registry = CollectorRegistry()
    with running(ApprovalProcessor(build_deps(settings, registry=registry)), config, clock):
        wait_until("a decision for each approval on the intake",
                   lambda: {d.approval_id for d in decisions(kafka_bootstrap, topics.run_intake)} == {"apr_1", "apr_2"})
    # Stopped: everything it will ever have produced is committed, so the intake read to its end is all.
    decided = {d.approval_id: [] for d in decisions(kafka_bootstrap, topics.run_intake)}
    for d in decisions(kafka_bootstrap, topics.run_intake):
        decided[d.approval_id].append((d.outcome, d.approver_id, d.decided_at_ms))

    # The decision recorded in time wins; no EXPIRED contradicts it.
    assert decided["apr_1"] == [(ApprovalOutcome.APPROVED, "bob", EXPIRES_AT - 1_000)]
    # The one recorded after the expiry is still refused, and the approval expires at the tick's clock.
    assert decided["apr_2"] == [(ApprovalOutcome.EXPIRED, "system", clock.now_ms)]

    def refusals(reason: str) -> float:
        return registry.get_sample_value("tether_approval_refusals_total", {"reason": reason}) or 0.0

    assert refusals("APPROVAL_EXPIRED") == 1
    assert refusals("DECISION_AFTER_EXPIRY") == 0
    assert {decided_event_id(RUN, a) for a in decided} == {
        decode_envelope(m.value()).event_id for m in committed_records(kafka_bootstrap, topics.run_intake, PARTITIONS)
    }


class SlowApproval(ApprovalProcessor):
    """The approval processor, slow on one run's records: its handler holds the loop (as a slow handler, a
    stalled disk or a starved CPU would) until the test lets go, while the commands behind it pile up."""

    def __init__(self, deps, *, slow_run: str) -> None:
        super().__init__(deps)
        self.slow_run = slow_run
        self.holding = threading.Event()
        self.release = threading.Event()

    def handle(self, msg: Inbound, ctx: Context) -> None:
        if msg.envelope.run_id == self.slow_run and not self.release.is_set():
            self.holding.set()
            if not self.release.wait(60):
                raise RuntimeError("never released")
        super().handle(msg, ctx)


@pytest.mark.integration
def test_a_service_behind_on_its_commands_applies_the_decision_recorded_in_time_before_expiring(
    kafka_bootstrap: str,
) -> None:
    # No restart, no rebalance: the service runs, but is behind on its commands partition when the expiry
    # and its grace pass. bob's APPROVE of apr_1, recorded 1 s before the expiry and on the topic long before
    # the grace ends, waits unread behind a slow record and others. Before, the next tick (its clock past the
    # grace) expired apr_1 at once, and bob's approval was refused DECISION_AFTER_EXPIRY when read.
    prefix = f"test-approval-behind-{uuid.uuid4().hex[:10]}."
    topics = Topics(prefix)
    declare_topics(kafka_bootstrap, PARTITIONS, ["approval"], prefix=prefix)
    settings = ApprovalSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=prefix, partitions=PARTITIONS)
    # A tick due at every batch, one record per batch: every record read after the clock moved is followed
    # by a tick, as in a loop working through a backlog.
    config = LoopConfig(bootstrap=kafka_bootstrap, topics=topics, tick_interval_ms=1, batch_max_messages=1)
    clock = Clock(T0)
    send = Sender(kafka_bootstrap)
    registry = CollectorRegistry()
    processor = SlowApproval(build_deps(settings, registry=registry), slow_run="slow-run")

    with running(processor, config, clock):
        park_two_approvals(send, topics, kafka_bootstrap)

        # The service gets stuck on a record (a decision for another run's approval, on the same partition).
        send.send(topics.commands, decision("apr_x", "9.0"), "Decide", "slow", producer="run-api",
                  recorded_at_ms=EXPIRES_AT - 3_000, run_id="slow-run")
        wait_until("the loop is held on the slow record", processor.holding.is_set)
        # Behind it: other commands, bob's decision of apr_1 in time and one of apr_2 1 ms late, all
        # appended now, well within the grace of the expiry on the service's clock.
        for n in range(5):
            send.send(topics.commands, CancelRun(principal_id="alice"), "Cancel", n, producer="run-api",
                      recorded_at_ms=EXPIRES_AT - 2_000, run_id=f"other-{n}")
        send.send(topics.commands, decision("apr_1", "1.0"), "Decide", 1, producer="run-api",
                  recorded_at_ms=EXPIRES_AT - 1_000)
        send.send(topics.commands, decision("apr_2", "1.1"), "Decide", 2, producer="run-api",
                  recorded_at_ms=EXPIRES_AT + 1)
        # The expiry and its grace pass while the service is still behind; then it goes on.
        clock.now_ms = EXPIRES_AT + settings.expiry_grace_ms + 5_000
        processor.release.set()
        wait_until("a decision for each approval on the intake",
                   lambda: {d.approval_id for d in decisions(kafka_bootstrap, topics.run_intake)} == {"apr_1", "apr_2"})
    decided: dict[str, list] = {}
    for d in decisions(kafka_bootstrap, topics.run_intake):
        decided.setdefault(d.approval_id, []).append((d.outcome, d.approver_id, d.decided_at_ms))

    # The decision recorded in time wins; no EXPIRED contradicts it.
    assert decided["apr_1"] == [(ApprovalOutcome.APPROVED, "bob", EXPIRES_AT - 1_000)]
    # The late one is refused, and apr_2 expires once the commands are read through the grace.
    assert decided["apr_2"] == [(ApprovalOutcome.EXPIRED, "system", clock.now_ms)]

    def refusals(reason: str) -> float:
        return registry.get_sample_value("tether_approval_refusals_total", {"reason": reason}) or 0.0

    assert refusals("APPROVAL_EXPIRED") == 1
    assert refusals("DECISION_AFTER_EXPIRY") == 0
