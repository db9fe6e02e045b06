"""Per-tenant ledger: concurrency slots and the tenant's queue, spend cap, token-rate deferral (in-memory driver)."""

from __future__ import annotations

import pytest

from tether_budget.domain.ledger import Ledger, RunStatus
from tether_budget.domain.tenancy import TenantLedger
from tether_contracts.records import (
    ModelCallFailed,
    RunAccepted,
    RunQueued,
    RunRejected,
    RunTerminated,
    StepDeferred,
    StepGranted,
    TenantLimits,
    ToolCallBudgeted,
    Usage,
)
from tether_messaging.errors import Unprocessable


def types(records) -> list[str]:
    return [type(r).__name__ for r in records]


def cap(concurrent: int, queued: int = 0, **more: int) -> TenantLimits:
    return TenantLimits(max_concurrent_runs=concurrent, max_queued_runs=queued, **more)


def slots(harness, tenant_id: str = "t1") -> list[str]:
    """The runs holding one of the tenant's slots, as their ledgers say (in submission order);
    the tenant ledger counts as many."""
    holders = [run_id for run_id, state in harness.driver.states.items()
               if isinstance(state, Ledger) and state.tenant_id == tenant_id and state.holds_tenant_slot]
    assert harness.tenant(tenant_id).running == len(holders)
    return holders


# -- concurrency and the queue ---------------------------------------------------------------


def test_runs_beyond_the_cap_wait_in_order_and_beyond_the_queue_are_refused(harness):
    limits = cap(2, 3)
    for i in range(1, 7):
        harness.submit(f"r{i}", limits=limits)

    for run in ("r1", "r2"):
        assert types(harness.log_payloads(run)) == ["RunAccepted", "StepGranted"]
    positions = [harness.log_payloads(r)[0] for r in ("r3", "r4", "r5")]
    assert all(isinstance(p, RunQueued) for p in positions)
    assert [p.position for p in positions] == [1, 2, 3]
    assert {(p.running, p.max_concurrent_runs) for p in positions} == {(2, 2)}
    assert positions[0].goal == "find a cheap flight" and positions[0].agent.agent_id == "a1"
    [rejected] = harness.log_payloads("r6")
    assert isinstance(rejected, RunRejected) and rejected.reason_code == "TENANT_QUEUE_FULL"
    assert harness.ledger("r3").status is RunStatus.QUEUED
    assert slots(harness) == ["r1", "r2"] and harness.tenant().queue == ["r3", "r4", "r5"]

    # r2 ends: the first in line (r3) is accepted and granted, in the same transaction.
    harness.model(1, 0, "r2")
    harness.complete("r2")
    assert types(harness.log_payloads("r3")) == ["RunQueued", "RunAccepted", "StepGranted"]
    assert types(harness.log_payloads("r4")) == ["RunQueued"]
    assert slots(harness) == ["r1", "r3"] and harness.tenant().queue == ["r4", "r5"]

    # A queued run is cancelled: it leaves the queue, and the next slot goes to the one behind it.
    out = harness.cancel("r4")
    assert types(out) == ["RunTerminated"] and out[0].reason_code == "CANCELLED"
    assert out[0].report.steps_done == 0 and any("queue" in p for p in out[0].report.pending)
    assert harness.tenant().queue == ["r5"]
    harness.step(1, 1, "r1")  # r1 is now granted step 2, still running: nothing admitted
    assert types(harness.log_payloads("r5")) == ["RunQueued"]
    harness.cancel("r1")
    assert types(harness.log_payloads("r5")) == ["RunQueued", "RunAccepted", "StepGranted"]
    assert types(harness.log_payloads("r4")) == ["RunQueued", "RunTerminated"]
    assert slots(harness) == ["r3", "r5"] and harness.tenant().queue == []
    assert harness.metric("tether_budget_runs_queued_total") == 3


def test_the_accepted_run_of_a_queued_submit_is_the_run_an_immediate_one_would_be(harness):
    harness.submit("r1", limits=cap(1, 1))
    harness.submit("r2", limits=cap(1, 1))
    harness.driver.now_ms += 5_000
    harness.cancel("r1")
    accepted = harness.log_payloads("r2")[1]
    direct = harness.log_payloads("r1")[0]
    assert isinstance(accepted, RunAccepted) and isinstance(direct, RunAccepted)
    assert accepted.model_copy(update={"request_id": "x", "deadline_ms": 0}) == \
        direct.model_copy(update={"request_id": "x", "deadline_ms": 0})
    # The wall clock starts at acceptance, not at the submit.
    assert harness.ledger("r2").accepted_at_ms == harness.driver.now_ms
    assert accepted.deadline_ms == harness.driver.now_ms + harness.caps().max_wall_clock_ms


def test_without_a_queue_the_cap_refuses_at_once(harness):
    harness.submit("r1", limits=cap(1))
    [rejected] = harness.submit("r2", limits=cap(1))
    assert isinstance(rejected, RunRejected) and rejected.reason_code == "TENANT_CONCURRENCY_CAP"
    assert slots(harness) == ["r1"]


def test_tenants_and_runs_without_limits_do_not_share_slots(harness):
    harness.submit("a1", tenant="ta", limits=cap(1, 5))
    harness.submit("a2", tenant="ta", limits=cap(1, 5))
    [accepted, granted] = harness.submit("b1", tenant="tb", limits=cap(1, 5))
    assert isinstance(accepted, RunAccepted) and isinstance(granted, StepGranted)
    assert types(harness.submit("u1", tenant="ta")) == ["RunAccepted", "StepGranted"]  # no limits: not counted
    assert slots(harness, "ta") == ["a1"] and harness.tenant("ta").queue == ["a2"]
    assert slots(harness, "tb") == ["b1"]


def test_raising_the_cap_admits_waiting_runs_at_the_next_submit(harness):
    harness.submit("r1", limits=cap(1, 5))
    harness.submit("r2", limits=cap(1, 5))
    harness.submit("r3", limits=cap(3, 5))
    assert types(harness.log_payloads("r2")) == ["RunQueued", "RunAccepted", "StepGranted"]
    assert types(harness.log_payloads("r3")) == ["RunQueued", "RunAccepted", "StepGranted"]
    assert slots(harness) == ["r1", "r2", "r3"]


def test_a_queued_run_gets_no_intake_and_no_timer(harness):
    harness.submit("r1", limits=cap(1, 1))
    harness.submit("r2", limits=cap(1, 1))
    with pytest.raises(Unprocessable) as err:
        harness.model(1, 0, "r2")
    assert err.value.reason == "RUN_QUEUED"
    harness.driver.now_ms += 10 * 24 * 3_600_000  # far past any deadline and retention
    out = harness.tick()
    # r1's wall clock ran out: it is terminated and r2, which waited, is accepted now.
    assert [type(p).__name__ for p in out] == ["RunTerminated", "RunAccepted", "StepGranted"]
    assert harness.ledger("r2").active


def test_a_duplicate_submit_of_a_queued_run_is_dropped(harness):
    harness.submit("r1", limits=cap(1, 1))
    harness.submit("r2", limits=cap(1, 1))
    assert harness.submit("r2", limits=cap(1, 1)) == []
    assert harness.tenant().queue == ["r2"]


# -- spend cap -------------------------------------------------------------------------------


def test_over_its_spend_cap_a_tenant_gets_no_grant_no_budget_and_no_new_run(harness):
    limits = cap(5, 5, spend_cap_usd_micros=1_500)
    harness.submit("r1", limits=limits)
    harness.model(1, 1, "r1", cost=1_000)  # the lane's first usage: grants reserve about 1,000 from now on
    harness.submit("r2", limits=limits)  # 1,000 spent + 1,000 reserved for r2's call
    assert isinstance(harness.request(1, 0, "r1")[-1], ToolCallBudgeted)
    out = harness.done("1.0", "r1")  # r2's call in flight is expected to reach the cap: r1's grant waits
    assert isinstance(out[-1], StepDeferred) and out[-1].reason_code == "TENANT_SPEND_CAP"
    out = harness.model(1, 1, "r2", cost=600)  # the lane's total is now over the cap
    assert [(type(p).__name__, getattr(p, "reason_code", None)) for p in out][-1] == ("RunTerminated", "TENANT_SPEND_CAP")
    assert types(harness.log_payloads("r1"))[-2:] == ["StepDeferred", "RunTerminated"]
    out = harness.request(1, 0, "r2")
    assert isinstance(out[-1], RunTerminated) and out[-1].reason_code == "TENANT_SPEND_CAP"
    assert "1600 of 1500" in out[-1].report.detail
    [rejected] = harness.submit("r3", limits=limits)
    assert isinstance(rejected, RunRejected) and rejected.reason_code == "TENANT_SPEND_CAP"
    assert harness.tenant().spent_usd_micros == 1_600 and harness.tenant().spend_reserved_usd_micros == 0


def test_the_spend_cap_counts_the_calls_already_granted(harness):
    # 50 runs at once, each model call costs 900 µUSD, cap 1,000: checking only what was spent
    # let every running run start a call, and 45,000 was spent.
    limits = cap(50, 0, spend_cap_usd_micros=1_000)
    runs = [f"r{i}" for i in range(50)]
    for run in runs:
        harness.submit(run, limits=limits)
    for _ in range(3):
        for run in runs:
            ledger = harness.ledger(run)
            if ledger.open and ledger.current is not None and not ledger.current.model_done:
                harness.model(ledger.step, 0, run, cost=900, text="done")
                harness.complete(run, step=ledger.step)
    # The first call, then one granted on its average while 900 < 1,000: past the cap by at
    # most one call's estimate, and every other run stopped before starting a call.
    assert harness.tenant().spent_usd_micros == 1_800
    ended = [harness.ledger(r).end_reason for r in runs]
    assert ended.count("COMPLETED") == 2 and ended.count("TENANT_SPEND_CAP") == 48
    assert harness.tenant().spend_reserved_usd_micros == 0 and harness.tenant().deferred == []


def test_the_spend_window_rolls_over(harness):
    limits = cap(5, 5, spend_cap_usd_micros=1_000, spend_window_ms=60_000)
    harness.driver.now_ms = 1_700_000_000_000 - 1_700_000_000_000 % 60_000 + 1_000
    harness.submit("r1", limits=limits)
    harness.model(1, 1, "r1", cost=1_000)  # reaching the cap is being at it: nothing more starts
    out = harness.request(1, 0, "r1")
    assert isinstance(out[-1], RunTerminated) and out[-1].reason_code == "TENANT_SPEND_CAP"
    assert isinstance(harness.submit("r2", limits=limits)[0], RunRejected)
    harness.driver.now_ms += 60_000
    assert types(harness.submit("r3", limits=limits)) == ["RunAccepted", "StepGranted"]
    assert harness.tenant().spent_usd_micros == 0


def test_a_grant_held_by_the_spend_of_calls_in_flight_waits_for_the_windows_end(harness):
    limits = cap(5, 5, spend_cap_usd_micros=1_500, spend_window_ms=60_000)
    window_end = harness.driver.now_ms - harness.driver.now_ms % 60_000 + 60_000
    harness.driver.now_ms = window_end - 59_000
    harness.submit("w", limits=limits)  # a call seen earlier: two grants may be in flight (slow start)
    harness.model(1, 0, "w", cost=1, text="hi")
    harness.complete("w")
    harness.submit("r1", limits=limits)
    harness.model(1, 1, "r1", cost=1_000)  # the latest usage: grants reserve 1,000 from now on
    harness.submit("r2", limits=limits)  # 1,000 spent + 1,000 reserved for r2's call, in flight all window
    harness.request(1, 0, "r1")
    out = harness.done("1.0", "r1")
    deferred = out[-1]
    assert isinstance(deferred, StepDeferred) and deferred.reason_code == "TENANT_SPEND_CAP"
    # The next window starts with nothing spent: the grant is due then, not at every tick before.
    assert deferred.not_before_ms == window_end and harness.tenant().deferred_due_at() == window_end
    assert deferred.tokens_available == 2**62  # no token rate on this lane
    harness.driver.now_ms = window_end - 1
    assert harness.tick() == []
    harness.driver.now_ms = window_end
    assert types(harness.tick()) == ["StepGranted"]
    assert types(harness.log_payloads("r1"))[-2:] == ["StepDeferred", "StepGranted"]


def test_a_queued_run_admitted_after_the_tenant_ran_out_of_money_is_rejected_and_the_next_one_tried(harness):
    limits = cap(1, 5, spend_cap_usd_micros=500)
    harness.submit("r1", limits=limits)
    harness.submit("r2", limits=limits)
    harness.submit("r3", limits=limits)
    harness.model(1, 0, "r1", cost=900)
    harness.complete("r1")
    assert types(harness.log_payloads("r2")) == ["RunQueued", "RunRejected"]
    assert types(harness.log_payloads("r3")) == ["RunQueued", "RunRejected"]
    assert slots(harness) == [] and harness.tenant().queue == []


# -- token rate ------------------------------------------------------------------------------


def test_over_the_token_rate_a_grant_is_deferred_and_made_on_a_tick_in_order(harness):
    limits = cap(5, 5, tokens_per_minute=1_000)
    t0 = harness.driver.now_ms
    harness.submit("r1", limits=limits)
    harness.model(1, 1, "r1", tokens=10)  # the lane's first usage: from now on grants reserve its average
    harness.submit("r2", limits=limits)
    harness.model(1, 1, "r2", tokens=1_500)  # bucket: 1,000 - 10 - 1,500 (the reservations settled)
    harness.request(1, 0, "r1")
    out = harness.done("1.0", "r1")
    assert types(out) == ["ToolCallCompleted", "StepDeferred"]
    deferred = out[-1]
    assert isinstance(deferred, StepDeferred) and deferred.step == 2 and deferred.reason_code == "TENANT_TOKEN_RATE"
    assert deferred.tokens_available < 0 and deferred.not_before_ms > t0
    assert harness.ledger("r1").deferred_step == 2 and harness.ledger("r1").step == 1

    harness.request(1, 0, "r2")
    assert types(harness.done("1.0", "r2")) == ["ToolCallCompleted", "StepDeferred"]
    assert harness.tenant().deferred == ["r1", "r2"]

    harness.driver.now_ms = deferred.not_before_ms - 1_000
    assert harness.tick() == []  # not yet: the grant waits, it is not denied
    harness.driver.now_ms = deferred.not_before_ms + 1_000
    out = harness.driver.tick()
    # r1 waited longest and goes first; its grant reserves about one model call's tokens
    # (the tenant's average so far), which empties the bucket again: r2 waits for a later tick.
    assert [(type(e.payload).__name__, e.envelope.run_id) for e in out] == [("StepGranted", "r1")]
    assert types(harness.log_payloads("r1"))[-2:] == ["StepDeferred", "StepGranted"]
    assert harness.tenant().deferred == ["r2"]
    assert harness.ledger("r1").rate_reserved > 0
    harness.driver.now_ms += 120_000
    harness.tick()
    assert types(harness.log_payloads("r2"))[-2:] == ["StepDeferred", "StepGranted"]
    assert harness.tenant().deferred == []
    assert harness.metric("tether_budget_steps_deferred_total") == 2


def test_a_deferred_run_that_is_cancelled_leaves_the_line(harness):
    limits = cap(5, 5, tokens_per_minute=100)
    harness.submit("r1", limits=limits)
    harness.model(1, 1, "r1", tokens=5_000)
    harness.request(1, 0, "r1")
    harness.done("1.0", "r1")
    assert harness.tenant().deferred == ["r1"]
    out = harness.cancel("r1")
    assert out[0].reason_code == "CANCELLED" and any("token rate" in p for p in out[0].report.pending)
    assert harness.tenant().deferred == [] and slots(harness) == []


def test_a_grant_reservation_the_model_call_never_used_is_given_back(harness):
    limits = cap(5, 5, tokens_per_minute=1_000)
    harness.submit("r1", limits=limits)
    level = harness.tenant().tokens
    assert harness.ledger("r1").rate_reserved == 1 and level == 999
    harness.cancel("r1")
    assert harness.tenant().tokens == 1_000


def test_tenant_ledger_clone_leaves_the_committed_one_untouched():
    committed = TenantLedger(tenant_id="t", limits=cap(1, 3), running=1, queue=["b", "c"])
    work = committed.clone()
    assert work.next_queued() is None  # no slot
    work.release("a", held_slot=True)
    assert work.next_queued() == "b" and work.touched
    assert committed.running == 1 and committed.queue == ["b", "c"] and not committed.touched


def test_parked_runs_do_not_grow_the_tenant_ledger(harness):
    # Every admitted run holds a slot until it ends, parked on a human for days or not: the
    # tenant ledger counts them (the runs' ledgers say which), so its size, held in memory and
    # written to the changelog with every change, does not grow with them.
    limits = cap(10_000, 10)
    sizes = []
    for i in range(1, 41):
        harness.submit(f"r{i}", limits=limits)
        if i in (10, 40):  # the same number of digits in the count
            sizes.append(len(harness.tenant().model_dump_json()))
    assert harness.tenant().running == 40 and sizes[0] == sizes[1]


def test_ledgers_written_before_running_became_a_count_read_as_they_meant():
    old_tenant = '{"kind":"tenant","tenant_id":"t","running":["a","b"],"queue":["c"],"deferred":[]}'
    assert TenantLedger.model_validate_json(old_tenant).running == 2
    old_run = {"run_id": "a", "tenant_id": "t", "principal_id": "p", "request_id": "q", "partition": 0,
               "submit_event_id": "e", "tenant_tracked": True}
    assert Ledger.model_validate(old_run).holds_tenant_slot  # active, tracked: it was in `running`
    for status in ("QUEUED", "COMPLETED"):
        assert not Ledger.model_validate({**old_run, "status": status}).holds_tenant_slot
    assert not Ledger.model_validate({**old_run, "tenant_tracked": False}).holds_tenant_slot
    fresh = Ledger.model_validate_json(Ledger.model_validate(old_run).model_dump_json())
    assert fresh.holds_tenant_slot


def test_a_tenant_without_limits_gets_no_ledger(harness):
    for i in range(3):
        assert types(harness.submit(f"r{i}", limits=TenantLimits())) == ["RunAccepted", "StepGranted"]
    assert harness.tenant() is None and not harness.ledger("r0").tenant_tracked


def test_lifting_the_limits_lets_the_queue_go_and_stops_tracking_new_runs(harness):
    harness.submit("r1", limits=cap(1, 5))
    harness.submit("r2", limits=cap(1, 5))
    harness.submit("r3", limits=cap(1, 5))
    out = harness.submit("r4", limits=TenantLimits())
    assert types(out)[:2] == ["RunAccepted", "StepGranted"]
    assert types(harness.log_payloads("r2")) == ["RunQueued", "RunAccepted", "StepGranted"]
    assert types(harness.log_payloads("r3")) == ["RunQueued", "RunAccepted", "StepGranted"]
    assert slots(harness) == ["r1", "r2", "r3"] and harness.tenant().queue == []
    assert not harness.ledger("r4").tenant_tracked


def test_a_model_call_that_reports_no_usage_gives_its_reservation_back(harness):
    limits = cap(5, 5, tokens_per_minute=1_000)
    harness.submit("warm", limits=limits)
    harness.model(1, 0, "warm", tokens=400, text="x")  # the lane's estimate: 400 tokens a call
    harness.complete("warm")
    harness.submit("r1", limits=limits)
    for step in (1, 2, 3):
        assert harness.ledger("r1").rate_reserved == 400
        harness.model(step, 1, "r1", tokens=0, cost=0)  # e.g. a cached answer: no usage at all
        assert harness.ledger("r1").rate_reserved == 0
        harness.request(step, 0, "r1", args={"q": step})
        assert isinstance(harness.done(f"{step}.0", "r1")[-1], StepGranted)
    # 400 used this minute, 400 reserved by the step granted now; nothing left behind by the others.
    assert harness.tenant().tokens == 1_000 - 400 - 400


def test_before_the_lanes_first_usage_one_grant_at_a_time_so_a_burst_stays_about_a_minutes_worth(harness):
    # 50 runs start at once on a 1,000-tokens/min bucket, each model call uses 800 tokens. With
    # nothing known about a call's size, granting them all (1 token reserved each) let them use
    # 40,000 tokens in the first minute and deferred the tenant for 40 minutes.
    limits = cap(50, 0, tokens_per_minute=1_000)
    runs = [f"r{i}" for i in range(50)]
    for run in runs:
        harness.submit(run, limits=limits)
    assert [r for r in runs if harness.ledger(r).step == 1] == ["r0"]
    assert harness.tenant().deferred == runs[1:]

    used, lowest, t0 = 0, 1_000.0, harness.driver.now_ms
    for _ in range(300):  # five minutes of the budget's ticks, each granted call returning at once
        for run in runs:
            ledger = harness.ledger(run)
            if ledger.open and ledger.step == 1 and not ledger.current.model_done:
                harness.model(1, 0, run, tokens=800, text="done")
                harness.complete(run)
                used += 800
                lowest = min(lowest, harness.tenant().tokens)
        harness.driver.now_ms += 1_000
        harness.tick()
    minutes = (harness.driver.now_ms - t0) / 60_000
    assert lowest >= 0  # no grant drew the bucket below zero: at most a burst of one minute's worth
    assert 1_000 * minutes <= used <= 1_000 + 1_000 * minutes  # the rate is used, not exceeded


def test_a_run_finishing_a_step_between_ticks_does_not_overtake_the_deferred_line(harness):
    limits = cap(5, 5, tokens_per_minute=1_000)
    harness.submit("r1", limits=limits)
    harness.model(1, 1, "r1", tokens=10)
    harness.submit("r2", limits=limits)
    harness.model(1, 1, "r2", tokens=1_500)  # the bucket: 1,000 - 1,510
    harness.request(1, 0, "r1")
    harness.request(1, 0, "r2")
    assert types(harness.done("1.0", "r1")) == ["ToolCallCompleted", "StepDeferred"]
    # The bucket holds one grant's reservation again; the budget's tick has not run yet.
    harness.driver.now_ms = harness.tenant().deferred_due_at()
    out = harness.done("1.0", "r2")
    # r1, waiting longest, gets the refill at once (not at the next tick), and r2 waits behind it.
    assert types(out) == ["StepGranted", "ToolCallCompleted", "StepDeferred"]
    assert types(harness.log_payloads("r2"))[-2:] == ["ToolCallCompleted", "StepDeferred"]
    assert types(harness.log_payloads("r1"))[-2:] == ["StepDeferred", "StepGranted"]
    assert harness.tenant().deferred == ["r2"]
    assert harness.tick() == []  # the refill went to r1; r2 waits for the next one


def _granted(harness, runs) -> list[str]:
    return [r for r in runs if harness.ledger(r).open and harness.ledger(r).current is not None
            and not harness.ledger(r).current.model_done]


def _drive(harness, runs, *, tokens: int, cost: int, seconds: int = 600) -> tuple[float, int]:
    """Every granted model call returns at once with `tokens`/`cost` and its run completes; the
    budget ticks once a second. Returns the lowest bucket level seen and the peak of calls in flight."""
    lowest, peak = float("inf"), 0
    for _ in range(seconds):
        granted = _granted(harness, runs)
        peak = max(peak, len(granted))
        for run in granted:
            harness.model(harness.ledger(run).step, 0, run, tokens=tokens, cost=cost, text="done")
            harness.complete(run, step=harness.ledger(run).step)
            if harness.tenant().tokens is not None:
                lowest = min(lowest, harness.tenant().tokens)
        harness.driver.now_ms += 1_000
        harness.tick()
    return lowest, peak


def test_a_first_model_call_without_usage_does_not_release_the_deferred_line(harness):
    # 20 runs on 1,000 tokens/min and a 10,000 µUSD cap; the lane's first model call fails
    # with no usage (a provider 503). Counted as a sample, it made the estimate "known" at 0,
    # every reservation 1 token / 1 µUSD, and all 19 waiting grants went in one transaction:
    # the bucket ended at -8,500 and 17,100 µUSD were spent.
    limits = cap(100, 0, tokens_per_minute=1_000, spend_cap_usd_micros=10_000)
    runs = [f"r{i}" for i in range(1, 21)]
    for run in runs:
        harness.submit(run, limits=limits)
    assert _granted(harness, runs) == ["r1"]
    harness.intake(ModelCallFailed(step=1, error_code="PROVIDER_ERROR", detail="503", attempts=3, usage=Usage()),
                   "r1", what=("ModelCallFailed", 1), producer="planner")
    assert harness.tenant().usage_samples == 0
    assert _granted(harness, runs) == ["r2"]  # still one at a time: the lane knows nothing yet
    lowest, _ = _drive(harness, runs, tokens=500, cost=900)
    # About one call past each limit, as docs/tenancy.md says, not one per waiting run.
    assert lowest >= -500
    assert harness.tenant().spent_usd_micros <= 10_000 + 900


def test_one_tiny_first_sample_does_not_open_the_gate_for_many(harness):
    # The lane's first call answers in 10 tokens, then every call uses 500. On the average of
    # that one sample (10) 29 grants went at once and the bucket fell to -13,510.
    limits = cap(100, 0, tokens_per_minute=1_000)
    runs = [f"r{i}" for i in range(1, 31)]
    for run in runs:
        harness.submit(run, limits=limits)
    harness.model(1, 0, "r1", tokens=10, text="hi")
    harness.complete("r1")
    assert len(_granted(harness, runs)) == 1  # as many in flight as calls seen
    lowest, peak = _drive(harness, runs[1:], tokens=500, cost=0)
    assert lowest >= -500  # about one call's error, not 29 calls'
    assert harness.tenant().reservation() == 500  # the latest call counts at once, not after the average catches up


def test_negative_usage_counts_as_zero_and_gives_no_cap_back(harness):
    # A first ModelCallCompleted reporting -5,000 tokens and µUSD left 6,000 tokens on a 1,000
    # cap and the tenant's spend at -5,000. A usage record is a fact (not dead-lettered): it is
    # appended as it came, counted as 0, and reported.
    harness.submit("r1", run_caps=harness.caps(max_tokens=1_000, max_cost_usd_micros=1_000, max_steps=10),
                   limits=cap(5, spend_cap_usd_micros=2_000, tokens_per_minute=1_000))
    harness.model(1, 1, tokens=-5_000, cost=-5_000)
    assert types(harness.log_payloads())[-1] == "ModelCallCompleted"
    ledger, tenant = harness.ledger(), harness.tenant()
    assert (ledger.usage.input_tokens, ledger.usage.output_tokens, ledger.usage.cost_usd_micros) == (0, 0, 0)
    assert tenant.spent_usd_micros == 0 and tenant.tokens == 1_000 and tenant.usage_samples == 0
    assert harness.metric("tether_budget_usage_clamped_total", field="cost_usd_micros") == 1
    harness.request(1, 0)
    granted = harness.done("1.0")[-1]
    assert isinstance(granted, StepGranted) and granted.remaining.tokens == 1_000
    # The real usage then reaches the caps as it would have without the bad record.
    harness.model(2, 0, tokens=1_200, cost=900, text="x")
    assert not harness.ledger().open and harness.tenant().spent_usd_micros == 900
