"""LoopGuard normalisation of numbers: what changes on every call is volatile, what the call means is not.

A repeat is only a loop if the numbers that differ between the observations are noise (a clock
reading, a measured duration, an id named as such). A wait the server asks for, a phone number or
an order id that happens to have ten digits starting with 1 is information: the run is not looping.
"""

from __future__ import annotations

import json

import pytest

from tether_budget.domain.loopguard import (
    LoopGuard,
    LoopGuardState,
    LoopRule,
    StepSignature,
    Verdict,
    call_signature,
    canonical_action,
    normalise_observation,
)


def _trace(tool: str, args: dict, observations: list[str]) -> list[StepSignature]:
    return [
        StepSignature(step=n, calls=(call_signature(tool, json.dumps(args), observation=obs),))
        for n, obs in enumerate(observations, start=1)
    ]


def _fired(trace: list[StepSignature]) -> list[tuple[int, Verdict, LoopRule]]:
    guard, state, fired = LoopGuard(), LoopGuardState(), []
    for step in trace:
        verdict, detection = guard.observe(state, step)
        if detection is not None:
            fired.append((step.step, verdict, detection.rule))
    return fired


# -- defect 1: whole seconds and minutes the call means stay distinct -----------------------


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("retry in 5 min", "retry in 30 min"),
        ('{"error": "rate limited, retry in 5 min"}', '{"error": "rate limited, retry in 30 min"}'),
        ("cached for 30 s", "cached for 300 s"),
        ("timeout: 10 seconds", "timeout: 60 seconds"),
        ('{"eta": "delivery in 15 mins"}', '{"eta": "delivery in 45 mins"}'),
        ("minimum order 5 min", "minimum order 7 min"),
    ],
)
def test_a_wait_or_quantity_the_result_states_is_not_normalised(one: str, two: str) -> None:
    assert normalise_observation(one) != normalise_observation(two)


def test_a_server_giving_a_different_wait_every_call_is_not_a_repeat() -> None:
    # Each answer says something else: before, every "<n> min" was "<duration>", R1 warned at 4.
    waits = [5, 10, 15, 30, 45, 60, 90, 120]
    trace = _trace("book_slot", {"slot": "tomorrow"}, [f'{{"ok": false, "next": "in {w} min"}}' for w in waits])
    assert _fired(trace) == []


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("took 35ms", "took 120ms"),
        ("done: 3.2s", "done: 0.9s"),
        ("5 passed in 0.53s", "5 passed in 1.07s"),
        ("took 3 s", "took 41 s"),
        ("elapsed: 2 min", "elapsed: 7 min"),
        ("build finished in 41 s", "build finished in 38 s"),
        ('{"msg": "latency=40 ms"}', '{"msg": "latency=51 ms"}'),
        ("retry after 1375ms", "retry after 2811ms"),
    ],
)
def test_a_measured_duration_stays_volatile(one: str, two: str) -> None:
    assert normalise_observation(one) == normalise_observation(two)


def test_a_rerun_whose_only_change_is_its_timing_is_still_a_repeat() -> None:
    trace = _trace(
        "run_build", {}, [f'{{"status": "failed", "log": "build finished in {s} s"}}' for s in (41, 38, 44, 40, 39)]
    )
    assert _fired(trace)[:2] == [(4, Verdict.WARN, LoopRule.REPEAT), (5, Verdict.TERMINATE, LoopRule.REPEAT)]


def test_arguments_are_never_normalised() -> None:
    # A new page number, quantity, wait or id in the arguments is a new call (progress, not a repeat).
    for one, two in [
        ({"page": 2}, {"page": 3}),
        ({"qty": 5}, {"qty": 30}),
        ({"wait": "5 min"}, {"wait": "30 min"}),
        ({"order_id": 1234567890}, {"order_id": 1234567891}),
    ]:
        assert canonical_action("t", json.dumps(one)) != canonical_action("t", json.dumps(two))


def test_a_fresh_nonce_in_the_result_is_still_a_repeat() -> None:
    assert normalise_observation('{"state": "busy", "nonce": "8f3a1c"}') == normalise_observation(
        '{"state": "busy", "nonce": "b77e02"}'
    )
    assert normalise_observation("busy (nonce=8f3a1c)") == normalise_observation("busy (nonce=b77e02)")
    assert normalise_observation('busy ETag: "33a64df5"') == normalise_observation('busy ETag: "9b2cf1e0"')


# -- defect 2: ten digits starting with 1 are an epoch only where the context says time -------


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ('{"phone": "1234567890"}', '{"phone": "1234567891"}'),
        ('{"order_id": 1234567890}', '{"order_id": 1987654321}'),
        ("call us at 1234567890", "call us at 1555010203"),
        ("order 1234567890 shipped", "order 1234567891 shipped"),
        ("ISBN 1861972717", "ISBN 1565922573"),
    ],
)
def test_a_ten_digit_number_without_a_time_context_is_not_an_epoch(one: str, two: str) -> None:
    assert normalise_observation(one) != normalise_observation(two)


def test_a_queue_of_orders_with_ten_digit_ids_is_progress() -> None:
    # Each call takes the next order: before, every id read as an epoch and R1 warned at step 4.
    trace = _trace(
        "next_order", {"queue": "new"}, [json.dumps({"order": 1234567890 + 17 * k, "status": "new"}) for k in range(10)]
    )
    assert _fired(trace) == []


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ('{"state": "pending", "checked_at": 1717171717}', '{"state": "pending", "checked_at": 1717171790}'),
        ('{"state": "pending", "expiresAt": "1717175317"}', '{"state": "pending", "expiresAt": "1717175390"}'),
        ('{"lastModified": 1717171717123}', '{"lastModified": 1717171790456}'),
        ("pending since 1717171717", "pending since 1717171790"),
        ("pending, t=1717171717", "pending, t=1717171790"),
        ("[1717171717.123] pending", "[1717171790.5] pending"),
        ("pending at 1717171717123", "pending at 1717171790456"),
        ("timestamp 1717171717 pending", "timestamp 1717171790 pending"),
    ],
)
def test_an_epoch_named_as_a_time_or_shaped_like_a_clock_reading_stays_volatile(one: str, two: str) -> None:
    assert normalise_observation(one) == normalise_observation(two)


def test_polling_that_only_gets_a_new_check_time_is_still_a_repeat() -> None:
    trace = _trace(
        "job_status",
        {"job": "j1"},
        [json.dumps({"state": "pending", "checked_at": 1717171717 + 30 * k}) for k in range(5)],
    )
    assert _fired(trace)[:2] == [(4, Verdict.WARN, LoopRule.REPEAT), (5, Verdict.TERMINATE, LoopRule.REPEAT)]


def test_a_long_token_before_a_number_is_cheap() -> None:
    # The context is read from a bounded window: a 200 KB word costs no backtracking over it.
    blob = "A" * 200_000
    assert normalise_observation(f"{blob} 1234567890 took 3 s") == f"{blob} 1234567890 took <duration>"
