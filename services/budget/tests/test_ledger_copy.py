"""`Ledger.clone`: the working copy a handler changes must share nothing mutable with the committed
ledger the loop keeps (for undo), while sharing the frozen parts to stay cheap."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from tether_budget.domain.ledger import CallStatus, Ledger
from tether_contracts.records import ApprovalOutcome, TenantLimits


def _mutable_parts(value: Any, found: dict[int, Any]) -> dict[int, Any]:
    """Every object reachable from `value` that can be changed in place: containers, and models
    that are not frozen (a frozen model's own containers are still walked)."""
    if isinstance(value, BaseModel):
        if not value.model_config.get("frozen"):
            found[id(value)] = value
        for name in type(value).model_fields:
            _mutable_parts(getattr(value, name), found)
    elif isinstance(value, dict):
        found[id(value)] = value
        for item in value.values():
            _mutable_parts(item, found)
    elif isinstance(value, list | set | bytearray):
        found[id(value)] = value
        for item in value:
            _mutable_parts(item, found)
    elif isinstance(value, tuple | frozenset):
        for item in value:
            _mutable_parts(item, found)
    return found


def _shared_mutable(a: Ledger, b: Ledger) -> list[Any]:
    ours, theirs = _mutable_parts(a, {}), _mutable_parts(b, {})
    return [ours[i] for i in ours.keys() & theirs.keys()]


@pytest.fixture
def busy_ledger(harness) -> Ledger:
    """A run with every part of the ledger filled: calls in several states, an approval, the loop
    guard's history, denials, polls and a warning, the current step's calls."""
    h = harness
    h.submit(run_caps=h.caps(max_steps=30))
    for step in range(1, 5):  # the same call and result four times: the R1 warning
        h.model(step, 1)
        h.request(step, 0, args={"q": "same"})
        h.done(f"{step}.0", result='{"results": []}')
    h.model(5, 1)
    h.request(5, 0, args={"q": "other"})
    h.denied("5.0")
    h.model(6, 1)
    h.request(6, 0, tool_name="job_status", args={"job": "j"})
    h.done("6.0", result='{"state": "pending"}')
    h.model(7, 3)
    h.request(7, 0)
    h.failed("7.0")
    h.request(7, 1)
    h.approval_requested("7.1")
    h.decided("7.1", ApprovalOutcome.APPROVED)
    h.request(7, 2)
    ledger = h.ledger()
    assert ledger.loop.warned is not None and ledger.loop.denials and ledger.loop.polls
    assert {c.status for c in ledger.calls.values()} >= {CallStatus.COMPLETED, CallStatus.DENIED, CallStatus.FAILED,
                                                        CallStatus.APPROVED, CallStatus.BUDGETED}
    assert ledger.current is not None and len(ledger.current.call_ids) == 3
    return ledger


def test_the_check_finds_what_a_shallow_copy_shares(busy_ledger: Ledger) -> None:
    # The test below could not fail if the walk missed the ledger's containers.
    assert _shared_mutable(busy_ledger, busy_ledger.model_copy())


def test_a_working_copy_shares_nothing_mutable(busy_ledger: Ledger) -> None:
    assert _shared_mutable(busy_ledger, busy_ledger.clone()) == []
    assert busy_ledger.clone().model_dump() == busy_ledger.model_dump()


def test_a_queued_runs_working_copy_shares_nothing_mutable(harness) -> None:
    limits = TenantLimits(max_concurrent_runs=1, max_queued_runs=1)
    harness.submit("r1", limits=limits)
    harness.submit("r2", limits=limits)
    queued = harness.ledger("r2")
    assert queued.queued_submit is not None
    assert _shared_mutable(queued, queued.clone()) == []


def test_handling_records_on_a_working_copy_leaves_the_committed_ledger_as_it_was(harness, busy_ledger) -> None:
    h = harness
    before = busy_ledger.model_dump()
    # The loop hands the same committed object to the next record's handler; the driver keeps it.
    h.driver.states["r1"] = busy_ledger
    h.done("7.1")
    h.done("7.2")  # the step finishes: the loop guard folds it, the next step is granted
    assert h.ledger() is not busy_ledger and h.ledger().step == 8
    assert busy_ledger.model_dump() == before
