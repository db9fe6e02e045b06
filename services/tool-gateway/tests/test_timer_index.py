"""The gateway's timer index: a run is due while the tick may have to start one of its calls, never while parked."""

from __future__ import annotations

from tether_tool_gateway.domain.state import CallState, CallStatus, RunState


def _call(call_id: str, status: CallStatus, **fields) -> CallState:
    return CallState(call_id=call_id, step=1, call_index=int(call_id[-1]), idem_key=f"k{call_id}",
                     tool_name="kv_put", args_json="{}", args_hash="h", status=status, **fields)


def _run(*calls: CallState) -> RunState:
    return RunState(tenant_id="t1", calls={c.call_id: c for c in calls})


def test_parked_and_finished_calls_make_no_timer(gw) -> None:
    wake = gw.processor.wake_at_ms
    assert wake(_run()) is None
    assert wake(_run(_call("1.0", CallStatus.AWAITING_APPROVAL, approval_expires_at_ms=5_000),
                     _call("1.1", CallStatus.RESOLVED), _call("1.2", CallStatus.REQUESTED))) is None


def test_a_rate_limited_call_is_due_at_its_not_before_time(gw) -> None:
    wake = gw.processor.wake_at_ms
    assert wake(_run(_call("1.0", CallStatus.RATE_LIMITED, not_before_ms=7_000),
                     _call("1.1", CallStatus.RATE_LIMITED, not_before_ms=3_000),
                     _call("1.2", CallStatus.AWAITING_APPROVAL))) == 3_000


def test_an_executing_call_is_due_at_every_tick(gw) -> None:
    # Whether its work runs in this process is known only to the processor (after a failover
    # it does not): the tick must see it at once, whatever its recheck time.
    run = _run(_call("1.0", CallStatus.EXECUTING, recheck_at_ms=10**12),
               _call("1.1", CallStatus.RATE_LIMITED, not_before_ms=7_000))
    assert gw.processor.wake_at_ms(run) == 0
