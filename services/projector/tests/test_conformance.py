"""One conformance suite per port, run against the in-memory fake and the real adapter (PostgreSQL, Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import psycopg
import pytest
import redis
from prometheus_client import CollectorRegistry
from psycopg import sql

from tether_projector.adapters.memory import InMemoryLiveState, InMemoryReadModel
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.adapters.redis_live import RedisLiveState, run_key, stream_key, tenant_index_key
from tether_projector.domain.rows import Json, Upsert
from tether_projector.domain.state import RunFold
from tether_projector.handlers import Deps, project_batch
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LiveState, LiveUpdate, ReadModel
from tether_projector.testing import (
    cancelled_while_waiting,
    expired_with_a_late_decision,
    happy_run,
    rejected_run,
    troubled_run,
)


# -- ReadModel ------------------------------------------------------------------------------------
@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
def read_model(request: pytest.FixtureRequest) -> Iterator[ReadModel]:
    if request.param == "memory":
        yield InMemoryReadModel()
    else:
        yield request.getfixturevalue("pg_read_model")


def fold_row(run_id: str, last_seq: int) -> Upsert:
    fold = RunFold(run_id=run_id, tenant_id="t", last_seq=last_seq, last_hash="h", created_at_ms=1, updated_at_ms=2)
    return Upsert("runs", (run_id,), {"tenant_id": "t", "status": fold.status, "created_at_ms": 1,
                                      "updated_at_ms": 2, "last_seq": last_seq, "last_hash": "h",
                                      "state": Json(fold.model_dump(mode="json"))})


def test_load_runs_returns_stored_folds_only(read_model: ReadModel) -> None:
    with read_model.transaction() as tx:
        assert tx.load_runs([]) == {}
        assert tx.load_runs(["nope"]) == {}
        tx.write([fold_row("r1", 3), fold_row("r2", 5)])
    with read_model.transaction() as tx:
        folds = tx.load_runs(["r2", "r1", "r3"])
    assert sorted(folds) == ["r1", "r2"]
    assert folds["r2"].last_seq == 5 and folds["r2"].tenant_id == "t"


def test_partial_upserts_compose_and_inserts_never_overwrite(read_model: ReadModel) -> None:
    with read_model.transaction() as tx:
        tx.write([Upsert("tool_calls", ("r", "1.0"), {"tenant_id": "t", "step": 1, "status": "REQUESTED",
                                                      "tool_name": "search"})])
        tx.write([Upsert("tool_calls", ("r", "1.0"), {"tenant_id": "t", "step": 1, "status": "COMPLETED",
                                                      "result_ref": Json({"sha256": "ab", "size": 3})})])
        tx.write([Upsert("events", ("r", 1), {"tenant_id": "t", "event_id": "e1", "event_type": "x",
                                              "recorded_at_ms": 1, "producer": "budget", "payload": Json({"a": 1}),
                                              "hash": "h", "prev_hash": "p"}, only_insert=True)])
        tx.write([Upsert("events", ("r", 1), {"tenant_id": "t", "event_id": "e2", "event_type": "y",
                                              "recorded_at_ms": 2, "producer": "budget", "payload": Json({"a": 2}),
                                              "hash": "h2", "prev_hash": "p2"}, only_insert=True)])
    [call] = read_model.rows("tool_calls")
    assert (call["status"], call["tool_name"], call["result_ref"]) == ("COMPLETED", "search", {"sha256": "ab", "size": 3})
    [event] = read_model.rows("events")
    assert (event["event_id"], event["payload"]) == ("e1", {"a": 1})


def test_a_failed_transaction_leaves_nothing(read_model: ReadModel) -> None:
    with pytest.raises(RuntimeError), read_model.transaction() as tx:
        tx.write([fold_row("r1", 1)])
        raise RuntimeError("handler failed after writing")
    assert read_model.rows("runs") == []


def test_rows_are_ordered_by_key(read_model: ReadModel) -> None:
    with read_model.transaction() as tx:
        for seq in (3, 1, 2):
            tx.write([Upsert("steps", ("r", seq), {"tenant_id": "t", "status": "GRANTED"})])
        tx.write([Upsert("steps", ("a", 9), {"tenant_id": "t", "status": "GRANTED"})])
    assert [(r["run_id"], r["step"]) for r in read_model.rows("steps")] == [("a", 9), ("r", 1), ("r", 2), ("r", 3)]


def test_projected_runs_read_the_same_through_every_adapter(read_model: ReadModel) -> None:
    logs = (happy_run("r1"), troubled_run("r2"), cancelled_while_waiting("r3"), rejected_run("r4"),
            expired_with_a_late_decision("r5"))
    events = [ev for log in logs for ev in log.log_events()]
    reference = InMemoryReadModel()
    for model in (reference, read_model):
        deps = Deps(read_model=model, live=None, metrics=ProjectorMetrics(CollectorRegistry()))
        project_batch(events[:20], deps=deps)
        project_batch(events[20:], deps=deps)
        project_batch(events[10:30], deps=deps)  # a redelivery
    for table in reference.tables:
        expected = reference.rows(table)
        actual = read_model.rows(table)
        assert len(actual) == len(expected), table
        for want, got in zip(expected, actual, strict=True):
            assert {k: got[k] for k in want} == want, table
            # Columns the projection never set are empty (NULL) or their documented default.
            assert all(v in (None, 0, True, []) for k, v in got.items() if k not in want), (table, got)


@pytest.mark.integration
def test_postgres_stores_text_with_nul_characters(pg_read_model: PostgresReadModel) -> None:
    with pg_read_model.transaction() as tx:
        tx.write([Upsert("tool_calls", ("r", "1.0"), {"tenant_id": "t", "step": 1, "result_json": "a\x00b",
                                                      "result_ref": Json({"k": "c\x00d"})})])
    [row] = pg_read_model.rows("tool_calls")
    assert row["result_json"] == "a\ufffdb" and row["result_ref"] == {"k": "c\ufffdd"}


@pytest.mark.integration
def test_postgres_schema_creation_is_idempotent(pg_read_model: PostgresReadModel) -> None:
    with pg_read_model.transaction() as tx:
        tx.write([fold_row("r1", 1)])
    pg_read_model.ensure_schema()
    assert [r["run_id"] for r in pg_read_model.rows("runs")] == ["r1"]


@pytest.mark.integration
def test_a_read_model_created_before_refused_decisions_gains_the_column_at_start_up(
    pg_read_model: PostgresReadModel,
) -> None:
    # A deployment whose approvals table predates ApprovalDecisionRefused: the next start-up adds the
    # column in place, and projecting the event then works (without it, every batch with one would fail).
    with pg_read_model.transaction() as tx:
        tx.write([Upsert("approvals", ("apr-1",), {"tenant_id": "t", "status": "EXPIRED"})])
    with psycopg.connect(pg_read_model.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {s}.approvals DROP COLUMN refused_decision").format(
            s=sql.Identifier(pg_read_model.schema)))
    pg_read_model.ensure_schema()
    with pg_read_model.transaction() as tx:
        tx.write([Upsert("approvals", ("apr-1",), {"tenant_id": "t", "refused_decision": Json({"approve": True})})])
    [row] = pg_read_model.rows("approvals")
    assert (row["status"], row["refused_decision"]) == ("EXPIRED", {"approve": True})


# -- LiveState ------------------------------------------------------------------------------------
class LiveView(Protocol):
    """What a reader sees of the live state (Redis keys, or the fake's dicts)."""

    def stream_ids(self, run_id: str) -> list[str]: ...

    def entry(self, run_id: str, index: int) -> dict[str, str]: ...

    def hot(self, run_id: str) -> dict[str, str]: ...

    def active(self, tenant_id: str) -> dict[str, float]: ...

    def ended_ttl(self, run_id: str) -> bool: ...


class FakeView:
    def __init__(self, live: InMemoryLiveState) -> None:
        self.live = live

    def stream_ids(self, run_id: str) -> list[str]:
        return [i for i, _ in self.live.streams.get(run_id, [])]

    def entry(self, run_id: str, index: int) -> dict[str, str]:
        return self.live.streams[run_id][index][1]

    def hot(self, run_id: str) -> dict[str, str]:
        return self.live.hot.get(run_id, {})

    def active(self, tenant_id: str) -> dict[str, float]:
        return {k: float(v) for k, v in self.live.active.get(tenant_id, {}).items()}

    def ended_ttl(self, run_id: str) -> bool:
        return self.live.ttl.get(run_id) == "ended"


class RedisView:
    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.r, self.p = client, prefix

    def stream_ids(self, run_id: str) -> list[str]:
        return [i.decode() for i, _ in self.r.xrange(stream_key(run_id, self.p))]

    def entry(self, run_id: str, index: int) -> dict[str, str]:
        _, fields = self.r.xrange(stream_key(run_id, self.p))[index]
        return {k.decode(): v.decode() for k, v in fields.items()}

    def hot(self, run_id: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(run_key(run_id, self.p)).items()}

    def active(self, tenant_id: str) -> dict[str, float]:
        return {k.decode(): s for k, s in self.r.zrange(tenant_index_key(tenant_id, self.p), 0, -1, withscores=True)}

    def ended_ttl(self, run_id: str) -> bool:
        ttls = [self.r.ttl(run_key(run_id, self.p)), self.r.ttl(stream_key(run_id, self.p))]
        return all(0 < t <= ENDED_TTL for t in ttls)


ENDED_TTL = 600
LIVE_TTL = 86_400


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def live(request: pytest.FixtureRequest) -> tuple[LiveState, LiveView]:
    if request.param == "memory":
        fake = InMemoryLiveState(live_ttl_s=LIVE_TTL)
        return fake, FakeView(fake)
    client: redis.Redis = request.getfixturevalue("redis_client")
    prefix: str = request.getfixturevalue("redis_prefix")
    adapter = RedisLiveState(client, prefix=prefix, stream_maxlen=1000, live_ttl_s=LIVE_TTL, ended_ttl_s=ENDED_TTL)
    return adapter, RedisView(client, prefix)


def update(seq: int, *, hot_seq: int | None = None, ended: bool = False, run_id: str = "r1",
           created_at_ms: int = 1000) -> LiveUpdate:
    hot_seq = seq if hot_seq is None else hot_seq
    return LiveUpdate(run_id=run_id, tenant_id="t1", seq=seq, entry={"seq": str(seq), "event_type": "x"},
                      hot={"last_seq": str(hot_seq), "status": "ENDED" if ended else "RUNNING"}, hot_seq=hot_seq,
                      created_at_ms=created_at_ms, ended=ended)


def test_stream_entries_are_added_once_in_seq_order(live: tuple[LiveState, LiveView]) -> None:
    state, view = live
    state.publish([update(1), update(2), update(3)])
    state.publish([update(2), update(3)])  # redelivery
    state.publish([update(1)])  # an old entry after newer ones
    assert view.stream_ids("r1") == ["1-0", "2-0", "3-0"]
    assert view.entry("r1", 1) == {"seq": "2", "event_type": "x"}


def test_hot_state_only_moves_forwards(live: tuple[LiveState, LiveView]) -> None:
    state, view = live
    state.publish([update(1, hot_seq=5)])
    assert view.hot("r1") == {"last_seq": "5", "status": "RUNNING"}
    state.publish([update(2, hot_seq=3)])
    assert view.hot("r1")["last_seq"] == "5"
    state.publish([update(6)])
    assert view.hot("r1")["last_seq"] == "6"


def test_an_ended_run_leaves_the_tenant_index_and_expires(live: tuple[LiveState, LiveView]) -> None:
    state, view = live
    state.publish([update(1), update(1, run_id="r2")])
    assert view.active("t1") == {"r1": 1000.0, "r2": 1000.0}
    assert not view.ended_ttl("r1")
    state.publish([update(2, ended=True)])
    assert view.active("t1") == {"r2": 1000.0}
    assert view.ended_ttl("r1")
    assert view.hot("r1")["status"] == "ENDED"


def test_runs_that_never_ended_leave_the_index_after_the_live_ttl(live: tuple[LiveState, LiveView]) -> None:
    state, view = live
    state.publish([update(1, run_id="old")])
    state.publish([update(1, run_id="recent", created_at_ms=1000 + LIVE_TTL * 1000)])
    assert view.active("t1") == {"old": 1000.0, "recent": 1000.0 + LIVE_TTL * 1000}
    state.publish([update(1, run_id="new", created_at_ms=1001 + LIVE_TTL * 1000)])
    assert sorted(view.active("t1")) == ["new", "recent"]


def test_a_late_older_publish_leaves_an_ended_run_out_of_the_index_with_its_ended_ttl(
    live: tuple[LiveState, LiveView],
) -> None:
    # Two owners during a rebalance: the new one published the run up to its end; the old one's
    # publish of an earlier batch (the run not ended in that fold) arrives after it.
    state, view = live
    state.publish([update(1), update(2, ended=True)])
    state.publish([update(1, hot_seq=1)])
    assert view.active("t1") == {}
    assert view.ended_ttl("r1")
    assert view.hot("r1")["status"] == "ENDED"


def test_an_update_without_an_entry_adds_nothing_to_the_stream(live: tuple[LiveState, LiveView]) -> None:
    state, view = live
    state.publish([update(1)])
    state.publish([LiveUpdate(run_id="r1", tenant_id="t1", seq=2, entry={}, hot={"last_seq": "2", "status": "RUNNING"},
                              hot_seq=2, created_at_ms=1000, ended=False)])
    assert view.stream_ids("r1") == ["1-0"]
    assert view.hot("r1")["last_seq"] == "2"
