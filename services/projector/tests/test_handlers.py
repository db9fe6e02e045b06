"""Projecting batches through the ports (in-memory fakes): idempotence, failures, the processor."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from tether_contracts.records import CancelRun
from tether_messaging.envelopes import make_envelope
from tether_messaging.errors import Unprocessable
from tether_messaging.processor import Inbound
from tether_projector.adapters.memory import InMemoryLiveState, InMemoryReadModel
from tether_projector.domain.project import problem_kind, project
from tether_projector.domain.state import RunFold
from tether_projector.entrypoint import ProjectorProcessor
from tether_projector.handlers import Deps, project_batch
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LogEvent, ReadModelUnavailable
from tether_projector.testing import happy_run, random_run, troubled_run


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def deps(registry: CollectorRegistry) -> Deps:
    return Deps(read_model=InMemoryReadModel(), live=InMemoryLiveState(), metrics=ProjectorMetrics(registry))


def counter(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_each_event_once_then_redelivery_is_a_no_op(deps: Deps, registry: CollectorRegistry) -> None:
    events = happy_run("r1").log_events() + troubled_run("r2").log_events()
    for ev in events:
        project_batch([ev], deps=deps)
    read_model: InMemoryReadModel = deps.read_model  # type: ignore[assignment]
    live: InMemoryLiveState = deps.live  # type: ignore[assignment]
    tables = {t: read_model.rows(t) for t in read_model.tables}
    streams = {k: list(v) for k, v in live.streams.items()}
    hot = {k: dict(v) for k, v in live.hot.items()}

    result = project_batch(events, deps=deps)  # everything again, as one batch
    assert (result.applied, result.duplicates) == (0, len(events))
    assert {t: read_model.rows(t) for t in read_model.tables} == tables
    assert live.streams == streams and live.hot == hot
    assert [e[0] for e in live.streams["r1"]] == [f"{s}-0" for s in range(1, 15)]
    assert counter(registry, "tether_projector_events_total", outcome="applied") == len(events)
    assert counter(registry, "tether_projector_events_total", outcome="duplicate") == len(events)


def test_batch_and_single_event_projection_agree(registry: CollectorRegistry) -> None:
    rng = random.Random(7)
    events = [ev for i in range(6) for ev in random_run(f"g{i}", rng).log_events()]
    one = Deps(InMemoryReadModel(), InMemoryLiveState(), ProjectorMetrics(registry))
    for ev in events:
        project_batch([ev], deps=one)
    many = Deps(InMemoryReadModel(), InMemoryLiveState(), ProjectorMetrics(CollectorRegistry()))
    for start in range(0, len(events), 23):
        project_batch(events[start:start + 23], deps=many)
    assert one.read_model.tables == many.read_model.tables  # type: ignore[attr-defined]
    assert one.live.streams == many.live.streams  # type: ignore[attr-defined]
    assert one.live.hot == many.live.hot  # type: ignore[attr-defined]


def test_batches_write_what_the_pure_projection_writes_event_by_event(registry: CollectorRegistry) -> None:
    # The batch advances each run's fold in place and writes its runs row once; the pure
    # `project` copies the fold and writes a runs row per event. Interleaved runs, batches that
    # split runs (folds loaded back from the read model mid-run): the same tables.
    rng = random.Random(11)
    runs = [random_run(f"i{i}", rng).log_events() for i in range(8)] + [happy_run("h").log_events()]
    events = []
    while any(runs):
        run = rng.choice([r for r in runs if r])
        events.append(run.pop(0))
    batched = Deps(InMemoryReadModel(), None, ProjectorMetrics(registry))
    start = 0
    while start < len(events):
        size = rng.randint(1, 40)
        project_batch(events[start:start + size], deps=batched)
        start += size

    reference = InMemoryReadModel()
    folds: dict[str, RunFold] = {}
    for ev in events:
        fold = folds.get(ev.envelope.run_id)
        projected = project(fold, ev.envelope, ev.payload)
        with reference.transaction() as tx:
            tx.write(projected.writes)
        folds[ev.envelope.run_id] = projected.fold
        if fold is not None:  # the pure projection left the fold it was given alone
            assert fold.last_seq == ev.envelope.seq - 1
    assert batched.read_model.tables == reference.tables  # type: ignore[attr-defined]


def test_read_model_failure_commits_and_publishes_nothing(deps: Deps) -> None:
    events = happy_run("r1").log_events()
    read_model: InMemoryReadModel = deps.read_model  # type: ignore[assignment]
    project_batch(events[:3], deps=deps)
    before = {t: read_model.rows(t) for t in read_model.tables}
    read_model.fail_next = 1
    with pytest.raises(ReadModelUnavailable):
        project_batch(events[3:6], deps=deps)
    assert {t: read_model.rows(t) for t in read_model.tables} == before
    assert len(deps.live.streams["r1"]) == 3  # type: ignore[attr-defined]
    project_batch(events[3:6], deps=deps)  # the redelivery applies it
    assert read_model.rows("runs")[0]["last_seq"] == 6


def test_live_outage_does_not_stop_the_read_model_and_heals_on_redelivery(deps: Deps, registry: CollectorRegistry) -> None:
    events = happy_run("r1").log_events()
    live: InMemoryLiveState = deps.live  # type: ignore[assignment]
    project_batch(events[:4], deps=deps)
    live.unavailable = True
    project_batch(events[4:8], deps=deps)
    assert deps.read_model.rows("runs")[0]["last_seq"] == 8
    assert counter(registry, "tether_projector_live_failures_total") == 1
    assert live.hot["r1"]["last_seq"] == "4"
    live.unavailable = False
    project_batch(events[4:8], deps=deps)  # at-least-once redelivery: duplicates for PostgreSQL
    assert [e[0] for e in live.streams["r1"]] == [f"{s}-0" for s in range(1, 9)]
    assert live.hot["r1"]["last_seq"] == "8"


def test_tenant_index_holds_live_runs_only(deps: Deps) -> None:
    events = happy_run("r1", "t1").log_events()
    live: InMemoryLiveState = deps.live  # type: ignore[assignment]
    project_batch(events[:5], deps=deps)
    assert live.active == {"t1": {"r1": events[0].envelope.recorded_at_ms}}
    assert live.ttl["r1"] == "live"
    project_batch(events[5:], deps=deps)
    assert live.active == {"t1": {}}
    assert live.ttl["r1"] == "ended"


def test_unsealed_events_are_rejected_without_stopping_the_batch(deps: Deps, registry: CollectorRegistry) -> None:
    events = happy_run("r1").log_events()
    stray = make_envelope(CancelRun(principal_id="x"), run_id="r1", tenant_id="tenant-a", event_id="s",
                          producer="run-api", recorded_at_ms=1)
    result = project_batch([*events[:2], LogEvent(stray, CancelRun(principal_id="x")), *events[2:4]], deps=deps)
    assert result.applied == 4 and [e.envelope.event_id for e, _ in result.rejected] == ["s"]
    assert counter(registry, "tether_projector_events_total", outcome="rejected") == 1


def test_chain_problems_are_counted(deps: Deps, registry: CollectorRegistry) -> None:
    events = happy_run("r1").log_events()
    result = project_batch([events[0], events[2]], deps=deps)
    assert [problem_kind(p) for p in result.chain_problems] == ["GAP"]
    assert counter(registry, "tether_projector_chain_problems_total", kind="GAP") == 1
    assert deps.read_model.rows("runs")[0]["chain_ok"] is False


# -- the processor the loop drives ----------------------------------------------------------------
def inbound(ev: LogEvent, offset: int = 0) -> Inbound:
    return Inbound("events", 0, offset, ev.envelope, ev.payload)


def test_processor_projects_the_loop_batch_before_the_loop_commits(deps: Deps, registry: CollectorRegistry) -> None:
    processor = ProjectorProcessor(deps, "events")
    assert processor.inputs == ("events",) and processor.name == "projector" and processor.state_codec is None
    events = happy_run("r1").log_events()
    for i, ev in enumerate(events[:5]):
        processor.handle(inbound(ev, i), ctx=None)  # type: ignore[arg-type]
    assert deps.read_model.rows("runs") == []  # nothing is written until the batch ends
    processor.before_commit()
    assert deps.read_model.rows("runs")[0]["last_seq"] == 5
    assert deps.read_model.commits == 1  # type: ignore[attr-defined]  # one transaction for the batch
    processor.before_commit()  # an empty batch writes nothing
    assert deps.read_model.commits == 1  # type: ignore[attr-defined]
    for i, ev in enumerate(events[5:]):
        processor.handle(inbound(ev, i + 5), ctx=None)  # type: ignore[arg-type]
    processor.before_commit()
    assert deps.read_model.rows("runs")[0]["status"] == "COMPLETED"


def test_processor_refuses_unsealed_records(deps: Deps) -> None:
    processor = ProjectorProcessor(deps, "events")
    stray = make_envelope(CancelRun(principal_id="x"), run_id="r1", tenant_id="tenant-a", event_id="s",
                          producer="run-api", recorded_at_ms=1)
    with pytest.raises(Unprocessable) as err:
        processor.handle(inbound(LogEvent(stray, CancelRun(principal_id="x"))), ctx=None)  # type: ignore[arg-type]
    assert err.value.reason == "UNSEALED_EVENT"
    processor.before_commit()
    assert deps.read_model.rows("events") == []


def test_processor_retries_while_the_read_model_is_unavailable(deps: Deps, registry: CollectorRegistry) -> None:
    processor = ProjectorProcessor(deps, "events", read_model_attempts=3)
    read_model: InMemoryReadModel = deps.read_model  # type: ignore[assignment]
    events = happy_run("r1").log_events()
    read_model.fail_next = 2
    processor.handle(inbound(events[0]), ctx=None)  # type: ignore[arg-type]
    processor.before_commit()
    assert read_model.rows("runs")[0]["last_seq"] == 1
    assert counter(registry, "tether_projector_read_model_retries_total") == 2

    read_model.fail_next = 3
    processor.handle(inbound(events[1]), ctx=None)  # type: ignore[arg-type]
    with pytest.raises(ReadModelUnavailable):  # the loop then stops before committing the offsets
        processor.before_commit()
    assert read_model.rows("runs")[0]["last_seq"] == 1
