"""The loop guard's rules versions: v1 (before bd39882) and v2 (now); a run keeps the version it was accepted under."""

from __future__ import annotations

import json

import pytest

from tether_budget.domain.ledger import Ledger
from tether_budget.domain.loopguard import CURRENT_RULES, LOOP_RULES, UnknownLoopRules, normalise_observation
from tether_budget.entrypoint import BudgetStateCodec
from tether_contracts.records import RunAccepted, RunTerminated, StepGranted

# What a job service answers every time it is asked: a different wait each time. Under v1 every
# whole-number duration was noise, so these were one result and the run was stopped as a repeat.
RETRIES = ["retry in 5 min", "retry in 30 min", "retry in 10 min", "retry in 2 min", "retry in 15 min"]


def _result(text: str) -> str:
    return json.dumps({"status": "busy", "detail": text})


def test_v1_is_the_normalisation_before_bd39882_and_v2_the_current_one() -> None:
    assert sorted(LOOP_RULES) == [1, 2] and CURRENT_RULES == 2
    # Durations and epoch-shaped numbers: any of them was noise under v1, only measured ones are under v2.
    for one, two in [("retry in 5 min", "retry in 30 min"), ("cached for 30 s", "cached for 60 s"),
                     ("call us at 1234567890", "call us at 1987654321"), ("order 1700000001", "order 1700000002")]:
        assert normalise_observation(one, 1) == normalise_observation(two, 1)
        assert normalise_observation(one, 2) != normalise_observation(two, 2)
        assert normalise_observation(one) == normalise_observation(one, 2)
    # Text nonces were kept by v1 and are ids under v2.
    assert normalise_observation("busy (nonce=8f3a1c)", 1) != normalise_observation("busy (nonce=b77e02)", 1)
    assert normalise_observation("busy (nonce=8f3a1c)", 2) == normalise_observation("busy (nonce=b77e02)", 2)
    # What both versions agree on is shared, not copied.
    for rules in LOOP_RULES:
        assert normalise_observation("took 35ms at 2024-05-01T10:00:00Z pid 42", rules) == \
            "took <duration> at <time> <id>"
    with pytest.raises(UnknownLoopRules):
        normalise_observation("x", 3)


def _retry_steps(h, steps: int, first: int = 1) -> list:
    """Steps whose single call gets one of RETRIES; the decision each step's end produced."""
    decisions = []
    for n, step in enumerate(range(first, first + steps)):
        h.model(step, 1)
        h.request(step, 0, args={"job": "j1"})
        decisions.append(h.done(f"{step}.0", result=_result(RETRIES[n % len(RETRIES)]))[-1])
    return decisions


def test_a_new_run_records_the_current_rules_and_is_judged_by_them(harness) -> None:
    h = harness
    accepted, _ = h.submit()
    assert isinstance(accepted, RunAccepted) and accepted.loop_guard_version == CURRENT_RULES == 2
    assert h.ledger().loop.rules == 2
    decisions = _retry_steps(h, 5)
    assert all(isinstance(d, StepGranted) and d.loop_warning is None for d in decisions)


def _restore(h, checkpoint: dict) -> None:
    codec = BudgetStateCodec()
    h.driver.states["r1"] = codec.decode(json.dumps(checkpoint).encode())


def test_a_run_in_flight_restored_from_a_checkpoint_written_before_versions_keeps_v1(harness) -> None:
    # The budget is upgraded while a run is in flight: the checkpoint it restores was written by
    # the previous release (no rules version in it), whose rules made the run's signatures so far.
    h = harness
    h.submit()
    old = json.loads(BudgetStateCodec().encode(h.ledger()))
    del old["loop"]["rules"]
    _restore(h, old)
    assert h.ledger().loop.rules == 1
    decisions = _retry_steps(h, 5)
    assert [isinstance(d, StepGranted) and d.loop_warning is not None for d in decisions[:4]] == \
        [False, False, False, True]
    assert "R1_REPEAT" in decisions[3].loop_warning
    assert isinstance(decisions[4], RunTerminated) and decisions[4].reason_code == "LOOP_DETECTED"
    assert h.ledger().loop.rules == 1  # every checkpoint since says so


def test_a_run_accepted_under_v1_keeps_v1_across_checkpoints_and_a_queued_one_takes_the_current_rules(
    harness,
) -> None:
    h = harness
    h.submit()
    state = json.loads(BudgetStateCodec().encode(h.ledger()))
    state["loop"]["rules"] = 1
    _restore(h, state)
    decisions = _retry_steps(h, 5)
    assert isinstance(decisions[-1], RunTerminated) and decisions[-1].reason_code == "LOOP_DETECTED"

    # A queued run has signed nothing: an old checkpoint of one takes the current rules.
    queued = json.loads(BudgetStateCodec().encode(h.ledger()))
    queued.update(status="QUEUED")
    del queued["loop"]["rules"]
    assert Ledger.model_validate_json(json.dumps(queued)).loop.rules == CURRENT_RULES
