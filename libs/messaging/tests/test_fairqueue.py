"""Deficit round-robin over tenants: fair and weighted order, FIFO per tenant, blocking queue for workers."""

from __future__ import annotations

import threading

import pytest

from tether_messaging.fairqueue import DeficitRoundRobin, FairWorkQueue, InvalidWeight


def drain(drr: DeficitRoundRobin[str]) -> list[str]:
    out = []
    while (item := drr.pop()) is not None:
        out.append(item)
    return out


def test_a_tenant_with_one_item_waits_one_turn_of_a_tenant_with_a_thousand() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin()
    for i in range(1_000):
        drr.push("a", f"a{i}")
    assert drr.pop() == "a0"
    drr.push("b", "b0")  # arrives while a's backlog waits
    order = drain(drr)
    assert order.index("b0") == 1  # one more of a's (its turn already began), then b
    assert [x for x in order if x.startswith("a")] == [f"a{i}" for i in range(1, 1_000)]  # FIFO per tenant


def test_the_cost_of_the_quiet_tenant_does_not_depend_on_the_noisy_backlog() -> None:
    def items_before_b(backlog: int) -> int:
        drr: DeficitRoundRobin[str] = DeficitRoundRobin()
        for i in range(backlog):
            drr.push("a", f"a{i}")
        drr.push("b", "b0")
        return drain(drr).index("b0")

    assert items_before_b(100) == items_before_b(1_000) == items_before_b(10_000) == 1


def test_busy_tenants_alternate_and_weights_give_proportional_shares() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin({"big": 3})
    for i in range(9):
        drr.push("big", f"B{i}")
    for i in range(3):
        drr.push("small", f"s{i}")
        drr.push("other", f"o{i}")
    order = drain(drr)
    assert order[:15] == ["B0", "B1", "B2", "s0", "o0", "B3", "B4", "B5", "s1", "o1", "B6", "B7", "B8", "s2", "o2"]


def test_an_idle_tenant_saves_no_credit() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin({"b": 5})
    drr.push("b", "b0")
    assert drr.pop() == "b0"  # b's line empties and b leaves the round
    for i in range(4):
        drr.push("a", f"a{i}")
    for i in range(7):
        drr.push("b", f"b{i + 1}")
    order = drain(drr)
    assert order == ["a0", "b1", "b2", "b3", "b4", "b5", "a1", "b6", "b7", "a2", "a3"]
    assert len(drr) == 0 and drr.waiting() == {}


def test_waiting_counts_per_tenant() -> None:
    drr: DeficitRoundRobin[int] = DeficitRoundRobin()
    for i in range(3):
        drr.push("a", i)
    drr.push("b", 9)
    assert len(drr) == 4 and drr.waiting() == {"a": 3, "b": 1}


@pytest.mark.parametrize("weights", [{"a": 0}, {"a": -1}, {"a": 1.5}])
def test_weights_must_be_positive_integers(weights) -> None:
    with pytest.raises(InvalidWeight):
        DeficitRoundRobin(weights)


def test_workers_take_items_in_fair_order_and_stop_when_closed() -> None:
    first: FairWorkQueue[str] = FairWorkQueue()
    for i in range(5):
        first.put("a", f"a{i}")
    first.put("b", "b0")
    assert [first.get(timeout=1) for _ in range(3)] == ["a0", "b0", "a1"]

    queue: FairWorkQueue[str] = FairWorkQueue()
    got: list[str] = []
    two_taken = threading.Event()

    def worker() -> None:
        while (item := queue.get()) is not None:
            got.append(item)
            if len(got) == 2:
                two_taken.set()

    thread = threading.Thread(target=worker)
    thread.start()
    queue.put("x", "x0")
    queue.put("x", "x1")
    assert two_taken.wait(5)
    assert queue.close() == []  # nothing left waiting
    thread.join(5)
    assert not thread.is_alive() and got == ["x0", "x1"]
    queue.put("x", "late")  # after close nothing is accepted
    assert queue.get(timeout=0.01) is None


def test_close_drops_what_waits_and_wakes_blocked_workers() -> None:
    queue: FairWorkQueue[str] = FairWorkQueue()
    results: list[str | None] = []
    threads = [threading.Thread(target=lambda: results.append(queue.get())) for _ in range(3)]
    for t in threads:
        t.start()
    dropped = queue.close()
    for t in threads:
        t.join(5)
    assert dropped == [] and results == [None, None, None]
    queue2: FairWorkQueue[str] = FairWorkQueue()
    queue2.put("a", "a0")
    queue2.put("b", "b0")
    assert sorted(queue2.close()) == ["a0", "b0"] and len(queue2) == 0
