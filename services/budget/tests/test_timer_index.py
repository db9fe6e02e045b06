"""The budget's timer index: a ledger's wake time is exactly when the tick has something to do for it."""

from __future__ import annotations

import pytest

from tether_budget.domain.decisions import Retention, tick_due, wake_at
from tether_budget.domain.ledger import CallEntry, CallStatus, Ledger, RunStatus
from tether_budget.domain.tenancy import TenantLedger
from tether_contracts.records import TenantLimits

RETENTION = Retention(ended_ledger_ms=60_000, tombstone_ms=600_000)
CLOCK = [0, 1, 499, 500, 999, 1_000, 1_199, 1_200, 1_201, 5_000, 60_999, 61_000, 61_001, 600_999, 601_000, 10**9]


def _ledger(**fields) -> Ledger:
    return Ledger(run_id="r1", tenant_id="t1", principal_id="p", request_id="q", partition=0,
                  submit_event_id="e", **fields)


def _parked() -> dict[str, CallEntry]:
    call = CallEntry(call_id="1.0", step=1, call_index=0, idem_key="k", tool_name="send_email", args_json="{}",
                     status=CallStatus.APPROVAL_PENDING)
    return {"1.0": call}


LEDGERS = {
    "queued": _ledger(status=RunStatus.QUEUED, deadline_ms=1_000),
    "active": _ledger(deadline_ms=1_000, human_wait_ms=200),
    "parked on a human": _ledger(deadline_ms=1_000, waiting_since_ms=500, calls=_parked()),
    "wait clock left running, after the deadline": _ledger(deadline_ms=1_000, waiting_since_ms=1_200),
    "wait clock left running, before the deadline": _ledger(deadline_ms=1_000, waiting_since_ms=999),
    "ended": _ledger(status=RunStatus.COMPLETED, ended_at_ms=1_000),
    "tombstoned": _ledger(status=RunStatus.TERMINATED, ended_at_ms=1_000, tombstoned=True),
}


@pytest.mark.parametrize("name", LEDGERS)
def test_a_run_is_due_exactly_from_its_wake_time(name: str) -> None:
    ledger = LEDGERS[name]
    wake = wake_at(ledger, retention=RETENTION)
    for now in CLOCK:
        assert tick_due(ledger, now_ms=now, retention=RETENTION) == (wake is not None and now >= wake), (name, now)


def test_a_run_parked_on_a_human_has_no_timer() -> None:
    assert wake_at(LEDGERS["parked on a human"], retention=RETENTION) is None


def _tenant(tokens: float | None, *, tpm: int = 600, deferred: bool = True) -> TenantLedger:
    return TenantLedger(tenant_id="t1", limits=TenantLimits(tokens_per_minute=tpm), tokens=tokens, tokens_at_ms=1_000,
                        deferred=["r1"] if deferred else [])


@pytest.mark.parametrize("tenant", [
    _tenant(-35.5), _tenant(-1), _tenant(0.0), _tenant(0.25), _tenant(None), _tenant(-50, tpm=0), _tenant(-7, tpm=7),
])
def test_deferred_grants_are_due_exactly_when_the_bucket_has_room(tenant: TenantLedger) -> None:
    wake = tenant.deferred_due_at()
    assert wake is not None
    for now in sorted({*CLOCK, max(0, wake - 1), wake, wake + 1, 4_549, 4_550, 4_551}):
        assert tenant.rate_allows(now) == (now >= wake), (tenant.tokens, now, wake)


@pytest.mark.parametrize("estimate", [1.0, 40.4, 600.0, 5_000.0])
def test_deferred_grants_are_due_exactly_when_the_bucket_holds_the_reservation(estimate: float) -> None:
    tenant = _tenant(-35.5).model_copy(update={"step_tokens_estimate": estimate})
    wake = tenant.deferred_due_at()
    assert wake is not None
    for now in sorted({*CLOCK, wake - 1, wake, wake + 1}):
        assert tenant.rate_allows(now) == (now >= wake), (estimate, now, wake)


def test_grants_waiting_for_the_lanes_first_usage_have_no_timer() -> None:
    # A record (the usage of the one call granted meanwhile), not the clock, ends that wait.
    assert _tenant(500.0).model_copy(update={"reservations_open": 1}).deferred_due_at() is None


def test_a_tenant_without_deferred_runs_has_no_timer() -> None:
    assert _tenant(-100, deferred=False).deferred_due_at() is None


def _spend_held(**fields) -> TenantLedger:
    """1,000 of 1,500 µUSD spent in the window from 120,000, and a call in flight expected to cost 1,000."""
    values: dict = dict(tenant_id="t1", limits=TenantLimits(spend_cap_usd_micros=1_500, spend_window_ms=60_000),
                        spend_window_start_ms=120_000, spent_usd_micros=1_000, spend_reserved_usd_micros=1_000,
                        usage_samples=1, deferred=["r1"])
    values.update(fields)
    return TenantLedger(**values)


def _with_rate(tokens: float | None, at_ms: int) -> TenantLedger:
    limits = TenantLimits(spend_cap_usd_micros=1_500, spend_window_ms=60_000, tokens_per_minute=600)
    return _spend_held(limits=limits, tokens=tokens, tokens_at_ms=at_ms)


@pytest.mark.parametrize(("tenant", "wake"), [
    # No token rate: the bucket's clock stays at 0, a window long gone; the hold lasts until 180,000.
    (_spend_held(), 180_000),
    # A token rate too: the later of the window's end and the bucket's refill (153,650 / 185,100).
    (_with_rate(-35.5, 150_000), 180_000),
    (_with_rate(-100.0, 175_000), 185_100),
    (_with_rate(None, 130_000), 180_000),
    # The bucket's clock already in the next window: the spend of the recorded one holds nothing.
    (_with_rate(-1.0, 190_000), 190_200),
])
def test_deferred_grants_held_by_the_spend_cap_are_due_exactly_when_the_window_ends(tenant: TenantLedger,
                                                                                    wake: int) -> None:
    assert tenant.deferred_due_at() == wake
    latest = max(tenant.tokens_at_ms, tenant.spend_window_start_ms)  # the clock never goes back behind it
    clock = {*range(120_000, 200_001, 1_000), wake - 1, wake, wake + 1, 239_999, 240_000, 10**9}
    for now in sorted(n for n in clock if n >= latest):
        assert tenant.rate_allows(now) == (now >= wake), (now, wake)


@pytest.mark.parametrize("tenant", [
    _spend_held(spend_reserved_usd_micros=1_500),  # the calls in flight alone reach the cap, in any window
    _spend_held(limits=TenantLimits(spend_cap_usd_micros=1_500)),  # no window: the spend never rolls over
])
def test_grants_held_by_the_spend_of_calls_in_flight_alone_have_no_timer(tenant: TenantLedger) -> None:
    # Their usage (a record), not the clock, ends that wait.
    assert tenant.deferred_due_at() is None
    assert not any(tenant.rate_allows(now) for now in range(120_000, 10**6, 7_000))
