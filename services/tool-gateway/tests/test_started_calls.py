"""What the gateway remembers of the calls it started is bounded by the calls in flight on the partitions it owns."""

from __future__ import annotations

import pytest

from tether_messaging import testing as driver_module
from tether_tool_gateway.domain.state import CallStatus
from tether_tool_gateway.handlers import StartedCalls, call_work_key

KV_ARGS = {"key": "greeting", "value": {"text": "hi"}}


def test_keys_of_partitions_no_longer_owned_are_forgotten() -> None:
    started = StartedCalls()
    started.add("call:a", 0)
    started.add("call:b", 1)
    started.add("call:c", 1)
    started.discard("call:c")
    started.discard("call:never-started")
    assert "call:a" in started and "call:b" in started and "call:c" not in started and len(started) == 2
    started.keep_only([0, 2])
    assert "call:a" in started and "call:b" not in started and len(started) == 1


def test_resolved_calls_and_ended_runs_leave_nothing_behind(gw) -> None:
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    gw.budget(call)
    assert call_work_key(call.idem_key) in gw.processor._seen
    gw.driver.run_work()
    assert len(gw.processor._seen) == 0
    gw.accept("run-2")
    other = gw.request("kv_put", KV_ARGS, run_id="run-2")
    gw.budget(other)
    gw.driver.tick()  # the partition is still ours: the call's work is still known
    assert call_work_key(other.idem_key) in gw.processor._seen


def test_a_call_of_a_partition_lost_and_won_back_restarts_at_the_next_tick(gw, monkeypatch: pytest.MonkeyPatch) -> None:
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    gw.budget(call)
    # The partition moves away: the loop drops its work (a late result carries a stale epoch).
    with monkeypatch.context() as moved:
        moved.setattr(driver_module._TickCtx, "owned_partitions", lambda self: [])
        gw.driver.tick()
    gw.driver.pending.clear()
    assert len(gw.processor._seen) == 0
    # Won back with the call still EXECUTING: started again at once, not after its stall time.
    gw.driver.tick()
    assert list(gw.driver.pending) == [call_work_key(call.idem_key)]
    assert gw.call_state(call).status is CallStatus.EXECUTING
