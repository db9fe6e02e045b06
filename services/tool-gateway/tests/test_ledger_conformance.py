"""One conformance suite for the idempotency ledger port, run against the fake and PostgreSQL."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tether_contracts.records import BlobRef
from tether_tool_gateway.ledger import (
    Busy,
    Execute,
    Intent,
    IntentMismatch,
    Owner,
    Resolution,
    ResolutionStatus,
    Resolved,
)
from tether_tool_gateway.testing import InMemoryLedger

LONG = 60_000  # a lease that does not expire during a test
EXPIRED = 0  # a lease that is already expired when anyone looks

A = Owner("tool-gateway-0", "boot-a")
A_REBORN = Owner("tool-gateway-0", "boot-a2")
B = Owner("tool-gateway-1", "boot-b")


def intent(n: int = 0, *, idempotent: bool = True, partition: int = 0, args_hash: str = "h") -> Intent:
    return Intent(
        idem_key=f"key-{n}",
        run_id="run-1",
        tenant_id="t1",
        partition=partition,
        step=1,
        call_id=f"1.{n}",
        tool_name="kv_put",
        args_json='{"key":"a","value":1}',
        args_hash=args_hash,
        tool_spec_json="{}",
        idempotent=idempotent,
    )


DONE = Resolution(ResolutionStatus.COMPLETED, result_json='{"ok":true}', duration_ms=12)


# -- adapters under test -----------------------------------------------------------------------
@pytest.fixture
def memory_ledger():
    shared = InMemoryLedger()  # "instances" share one store, as they share one database
    yield lambda: shared


@pytest.fixture
def postgres_ledger(pg_schema):
    from psycopg_pool import ConnectionPool

    from tether_tool_gateway.ledger.postgres import PostgresLedger

    dsn, schema = pg_schema.base_dsn, pg_schema.name
    pools = []

    def make():
        # Each call is another "instance": its own pool, same database schema.
        pool = ConnectionPool(dsn, min_size=1, max_size=4, open=True)
        pools.append(pool)
        ledger = PostgresLedger(pool, schema=schema)
        ledger.ensure_schema()
        return ledger

    try:
        yield make
    finally:
        for pool in pools:
            pool.close()


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
def make_ledger(request):
    return request.getfixturevalue(f"{request.param}_ledger")


@pytest.fixture
def ledger(make_ledger):
    return make_ledger()


# -- the contract ------------------------------------------------------------------------------
def test_first_claim_records_the_intent_and_takes_the_lease(ledger):
    claim = ledger.claim(intent(), A, LONG)
    assert isinstance(claim, Execute) and claim.attempt == 1 and not claim.resumed
    rec = ledger.get("key-0")
    assert rec.intent == intent() and rec.resolution is None and rec.lease_owner == A


def test_resolution_is_replayed_not_re_executed(ledger):
    claim = ledger.claim(intent(), A, LONG)
    done = ledger.complete("key-0", claim.token, DONE)
    assert done.recorded and done.resolution == DONE
    again = ledger.claim(intent(), B, LONG)
    assert isinstance(again, Resolved) and again.resolution == DONE and not again.by_this_claim
    assert ledger.get("key-0").attempt == 1


def test_result_ref_round_trips(ledger):
    ref = BlobRef(sha256="a" * 64, size=100_000)
    res = Resolution(ResolutionStatus.COMPLETED, result_ref=ref, untrusted=True, duration_ms=5)
    claim = ledger.claim(intent(), A, LONG)
    ledger.complete("key-0", claim.token, res)
    assert ledger.get("key-0").resolution == res


def test_live_lease_of_another_instance_is_busy(ledger):
    ledger.claim(intent(), A, LONG)
    assert isinstance(ledger.claim(intent(), B, LONG), Busy)


def test_live_lease_of_this_incarnation_is_busy(ledger):
    # Same process claiming again (e.g. a tick re-check while the work runs): never twice.
    ledger.claim(intent(), A, LONG)
    assert isinstance(ledger.claim(intent(), A, LONG), Busy)


def test_expired_lease_idempotent_is_re_executed_with_a_new_token(ledger):
    first = ledger.claim(intent(), A, EXPIRED)
    second = ledger.claim(intent(), B, LONG)
    assert isinstance(second, Execute) and second.resumed and second.attempt == 2
    assert second.token != first.token
    # The old holder lost the lease: its heartbeat and completion are refused.
    assert not ledger.heartbeat("key-0", first.token, LONG)
    assert ledger.complete("key-0", first.token, DONE) == ledger.complete("key-0", first.token, DONE)
    assert ledger.get("key-0").resolution is None
    assert ledger.complete("key-0", second.token, DONE).recorded


def test_previous_life_lease_is_taken_over_at_once(ledger):
    ledger.claim(intent(), A, LONG)
    claim = ledger.claim(intent(), A_REBORN, LONG)
    assert isinstance(claim, Execute) and claim.resumed and claim.attempt == 2


def test_expired_lease_non_idempotent_becomes_outcome_unknown(ledger):
    first = ledger.claim(intent(idempotent=False), A, EXPIRED)
    claim = ledger.claim(intent(idempotent=False), B, LONG)
    assert isinstance(claim, Resolved) and claim.by_this_claim
    assert claim.resolution.status is ResolutionStatus.OUTCOME_UNKNOWN
    # Later claims replay the unknown outcome; nobody executes it again.
    again = ledger.claim(intent(idempotent=False), B, LONG)
    assert isinstance(again, Resolved) and again.resolution.status is ResolutionStatus.OUTCOME_UNKNOWN
    # A zombie's real result arriving afterwards is kept as a late resolution, not applied.
    late = ledger.complete("key-0", first.token, DONE)
    assert not late.recorded and late.resolution.status is ResolutionStatus.OUTCOME_UNKNOWN
    rec = ledger.get("key-0")
    assert rec.resolution.status is ResolutionStatus.OUTCOME_UNKNOWN and rec.late_resolution == DONE


def test_heartbeat_keeps_the_lease(ledger):
    claim = ledger.claim(intent(), A, EXPIRED)
    assert ledger.heartbeat("key-0", claim.token, LONG)
    assert isinstance(ledger.claim(intent(), B, LONG), Busy)


def test_heartbeat_after_resolution_is_refused(ledger):
    claim = ledger.claim(intent(), A, LONG)
    ledger.complete("key-0", claim.token, DONE)
    assert not ledger.heartbeat("key-0", claim.token, LONG)


def test_same_key_for_other_arguments_is_refused(ledger):
    ledger.claim(intent(), A, LONG)
    with pytest.raises(IntentMismatch):
        ledger.claim(intent(args_hash="other"), A, LONG)


def test_sweep_takes_over_only_expired_unresolved_intents_of_its_partitions(ledger):
    ledger.claim(intent(0), A, EXPIRED)  # expired, idempotent → re-execute
    ledger.claim(intent(1, idempotent=False), A, EXPIRED)  # expired, not idempotent → unknown
    ledger.claim(intent(2), A, LONG)  # live lease
    done = ledger.claim(intent(3), A, EXPIRED)
    ledger.complete("key-3", done.token, DONE)  # resolved
    ledger.claim(intent(4, partition=1), A, EXPIRED)  # another partition
    claims = ledger.sweep(B, LONG, partitions=[0])
    by_key = {c.record.intent.idem_key: c for c in claims}
    assert set(by_key) == {"key-0", "key-1"}
    assert isinstance(by_key["key-0"], Execute) and by_key["key-0"].attempt == 2
    assert isinstance(by_key["key-1"], Resolved) and by_key["key-1"].resolution.status is ResolutionStatus.OUTCOME_UNKNOWN
    assert ledger.sweep(B, LONG, partitions=[0]) == []  # now leased or resolved
    assert [c.record.intent.idem_key for c in ledger.sweep(B, LONG)] == ["key-4"]


def test_concurrent_claims_give_one_executor(make_ledger):
    ledgers = [make_ledger() for _ in range(2)]
    barrier = threading.Barrier(8)

    def go(i):
        barrier.wait()
        return ledgers[i % 2].claim(intent(), Owner(f"gw-{i}", "boot"), LONG)

    with ThreadPoolExecutor(8) as pool:
        claims = list(pool.map(go, range(8)))
    assert sum(isinstance(c, Execute) for c in claims) == 1
    assert sum(isinstance(c, Busy) for c in claims) == 7


def test_racing_sweeps_take_each_intent_once(make_ledger):
    one, two = make_ledger(), make_ledger()
    for n in range(40):
        one.claim(intent(n, idempotent=n % 2 == 0), A, EXPIRED)
    barrier = threading.Barrier(2)

    def sweep(ledger, owner):
        barrier.wait()
        out = []
        while batch := ledger.sweep(owner, LONG, limit=7):
            out.extend(batch)
        return out

    with ThreadPoolExecutor(2) as pool:
        f1 = pool.submit(sweep, one, Owner("gw-1", "b1"))
        f2 = pool.submit(sweep, two, Owner("gw-2", "b2"))
        got = f1.result() + f2.result()
    keys = [c.record.intent.idem_key for c in got]
    assert len(keys) == len(set(keys)) == 40
    assert sum(isinstance(c, Execute) for c in got) == 20
    assert all(one.get(f"key-{n}").attempt == (2 if n % 2 == 0 else 1) for n in range(40))
