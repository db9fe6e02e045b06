"""The loop's state store: bounded decoded states, identical reloads, the wake-time index, partitions, restore."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.processor import Context, Inbound, PydanticStateCodec, TickContext, WorkDone
from tether_messaging.statestore import ALWAYS_DUE, StateStore
from tether_messaging.testing import InMemoryDriver


class Run(BaseModel):
    n: int
    note: str = ""
    wake: int | None = None


class CountingCodec(PydanticStateCodec[Run]):
    """Counts decodes, to see when a state came from disk rather than memory."""

    def __init__(self) -> None:
        super().__init__(Run)
        self.decodes = 0

    def decode(self, data: bytes) -> Run:
        self.decodes += 1
        return super().decode(data)


@pytest.fixture
def codec() -> CountingCodec:
    return CountingCodec()


@pytest.fixture
def store(codec: CountingCodec, tmp_path: Path):
    s = StateStore(codec, name="test", directory=tmp_path, cache_runs=4, wake_at=lambda run: run.wake)
    yield s
    s.close()


def test_decoded_states_stay_at_the_bound_and_evicted_ones_reload_equal(store: StateStore, codec: CountingCodec) -> None:
    runs = {f"run-{i}": Run(n=i, note="x" * i) for i in range(20)}
    for run_id, run in runs.items():
        store.put(0, run_id, run)
        assert store.decoded_count <= 4
    assert store.decoded_count == 4 and store.count() == 20 and codec.decodes == 0

    for i in range(16, 20):  # the most recently put are still decoded
        assert store.get(0, f"run-{i}") == runs[f"run-{i}"]
    assert codec.decodes == 0
    for i in range(16):  # the others come from disk
        assert store.get(0, f"run-{i}") == runs[f"run-{i}"]
        assert store.decoded_count <= 4
    assert codec.decodes == 16

    # Recently used states are served from memory, as the same object.
    last = store.get(0, "run-15")
    assert store.get(0, "run-15") is last and codec.decodes == 16


def test_batch_writes_encode_only_what_was_not_encoded(store: StateStore) -> None:
    store.put_many([(0, "a", Run(n=1), None), (0, "b", Run(n=2), b'{"n":2,"note":"given","wake":null}')])
    store.forget_decoded()
    assert store.get(0, "a") == Run(n=1)
    assert store.get(0, "b") == Run(n=2, note="given")  # the given encoding is what was stored


def test_none_deletes(store: StateStore) -> None:
    store.put(0, "a", Run(n=1, wake=5))
    store.put(0, "a", None)
    assert store.get(0, "a") is None and store.count() == 0 and store.due(0, 10) == []
    store.put(0, "b", Run(n=1))
    store.delete(0, "b")
    assert store.get(0, "b") is None


def test_forget_decoded_rereads_the_committed_bytes(store: StateStore) -> None:
    store.put(0, "a", Run(n=1))
    run = store.get(0, "a")
    run.n = 99  # a handler that changed a state in place (in a batch that then aborted)
    store.forget_decoded()
    assert store.get(0, "a") == Run(n=1) and store.decoded_count == 1


def test_due_index(store: StateStore) -> None:
    store.put(0, "parked", Run(n=1))  # no timer
    store.put(0, "later", Run(n=2, wake=2_000))
    store.put(0, "soon", Run(n=3, wake=1_000))
    store.put(0, "overdue", Run(n=4, wake=10))
    store.put(1, "elsewhere", Run(n=5, wake=10))
    assert store.due(0, 999) == [(10, "overdue")]
    assert store.due(0, 1_000) == [(10, "overdue"), (1_000, "soon")]
    assert [r for _, r in store.due(0, 10**12)] == ["overdue", "soon", "later"]
    assert store.due(1, 10**12) == [(10, "elsewhere")]

    store.put(0, "overdue", Run(n=4))  # the timer fired; the new state has none
    store.put(0, "parked", Run(n=1, wake=500))
    assert store.due(0, 1_000) == [(500, "parked"), (1_000, "soon")]
    assert store.wake_at(Run(n=1, wake=7)) == 7 and store.wake_at(Run(n=1)) is None


def test_without_a_wake_rule_every_run_is_always_due(codec: CountingCodec, tmp_path: Path) -> None:
    store = StateStore(codec, name="plain", directory=tmp_path, cache_runs=2)
    try:
        store.put(0, "b", Run(n=1, wake=10**15))
        store.put(0, "a", Run(n=2))
        assert store.due(0, 0) == [(ALWAYS_DUE, "a"), (ALWAYS_DUE, "b")]
    finally:
        store.close()


def test_drop_partition_forgets_only_that_partition(store: StateStore) -> None:
    for p in (0, 1):
        for i in range(3):
            store.put(p, f"run-{i}", Run(n=i, wake=0))
    store.drop_partition(0)
    assert store.count(0) == 0 and store.count(1) == 3
    assert store.get(0, "run-1") is None and store.get(1, "run-1") == Run(n=1, wake=0)
    assert store.due(0, 10) == [] and len(store.due(1, 10)) == 3
    assert list(store.keys(1)) == ["run-0", "run-1", "run-2"]


def test_restore_keeps_the_latest_record_of_each_run_and_decodes_each_once(store: StateStore, codec: CountingCodec) -> None:
    store.put(0, "stale", Run(n=0))  # left from an earlier ownership of the partition
    store.put(1, "other", Run(n=0))
    store.begin_restore([0])
    # A changelog partition: superseded records, a tombstone, a run deleted then recreated.
    store.load(0, "a", b'{"n":1}')
    store.load(0, "b", b'{"n":1,"wake":50}')
    store.load(0, "a", b'{"n":2,"wake":70}')
    store.load(0, "c", b'{"n":1}')
    store.load(0, "c", None)
    store.load(0, "b", None)
    store.load(0, "b", b'{"n":3}')
    store.end_restore([0])
    assert codec.decodes == 2  # a and b once each, for their wake time
    assert sorted(store.keys(0)) == ["a", "b"]
    assert store.get(0, "a") == Run(n=2, wake=70) and store.get(0, "b") == Run(n=3) and store.get(0, "c") is None
    assert store.due(0, 100) == [(70, "a")]
    assert store.get(0, "stale") is None and store.get(1, "other") == Run(n=0)


def test_restore_pages_through_many_runs(store: StateStore) -> None:
    store.begin_restore([0])
    for i in range(1_234):
        store.load(0, f"run-{i:05d}", Run(n=i, wake=i).model_dump_json().encode())
    store.end_restore([0])
    assert store.count(0) == 1_234
    assert [r for _, r in store.due(0, 9)] == [f"run-{i:05d}" for i in range(10)]
    assert store.decoded_count == 0  # a restore decodes for the index only; memory stays empty


def test_files_appear_on_first_use_in_a_fresh_directory_and_go_at_close(codec: CountingCodec, tmp_path: Path) -> None:
    first = StateStore(codec, name="svc", directory=tmp_path / "states")
    second = StateStore(codec, name="svc", directory=tmp_path / "states")
    assert first.path is None  # nothing opened yet
    first.put(0, "a", Run(n=1))
    second.put(0, "a", Run(n=2))
    assert first.path.exists() and second.path.exists() and first.path.parent != second.path.parent
    assert first.path.parent.parent == tmp_path / "states"
    path = first.path
    first.close()
    assert not path.parent.exists() and second.get(0, "a") == Run(n=2)
    second.close()
    assert list((tmp_path / "states").iterdir()) == []


# -- the in-memory driver follows the same rule ------------------------------------------------


class Timers:
    """Each input parks its run until `wake`; the tick records which runs it was shown."""

    name = "timers"
    inputs = ("in",)
    state_codec = PydanticStateCodec(Run)

    def __init__(self) -> None:
        self.shown: list[list[str]] = []

    def handle(self, msg: Inbound, ctx: Context) -> None:
        step = msg.payload.step
        ctx.put_state(msg.envelope.run_id, Run(n=step, wake=None if step == 0 else step))

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        raise AssertionError("no work")

    def wake_at_ms(self, state: Run) -> int | None:
        return state.wake

    def on_tick(self, ctx: TickContext) -> None:
        self.shown.append(list(ctx.runs_due(0)))


def test_in_memory_driver_shows_the_tick_only_due_runs() -> None:
    processor = Timers()
    driver = InMemoryDriver(processor, now_ms=0)
    remaining = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)
    for run_id, wake in (("parked", 0), ("late", 300), ("early", 100)):
        driver.feed_payload("in", StepGranted(step=wake, remaining=remaining), run_id=run_id)
    driver.tick()
    driver.now_ms = 300
    driver.tick()
    assert processor.shown == [[], ["early", "late"]]
