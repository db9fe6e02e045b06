"""`RunState.clone`: the working copy a handler changes shares nothing mutable with the committed
state the loop keeps (for undo); tool snapshots and sources are frozen values, shared."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tether_contracts.base import AvroRecord
from tether_tool_gateway.builtin_tools import builtin_tool_specs
from tether_tool_gateway.domain.state import CallState, CallStatus, RunState

KV_ARGS = {"key": "greeting", "value": {"text": "hi"}}


def _mutable_parts(value: Any, found: dict[int, Any]) -> dict[int, Any]:
    """Every object reachable from `value` that can be changed in place. Generated records
    (AvroRecord: frozen, never changed by the services) are values and not walked."""
    if isinstance(value, AvroRecord):
        return found
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


def _shared_mutable(a: RunState, b: RunState) -> list[Any]:
    ours, theirs = _mutable_parts(a, {}), _mutable_parts(b, {})
    return [ours[i] for i in ours.keys() & theirs.keys()]


def _busy_state() -> RunState:
    tools = builtin_tool_specs(kv_url="http://127.0.0.1:1", smtp_host="127.0.0.1", smtp_port=1,
                               email_from="agent@tether.test", http_allow_hosts=["127.0.0.1"])
    state = RunState(tenant_id="t1", principal_id="p1", agent_id="a1", agent_allowlist=[t.name for t in tools],
                     tenant_grants=[t.name for t in tools], delegated_scope=["kv:*"],
                     tools={t.name: t for t in tools})
    state.read_goal("find the greeting")
    for i, status in enumerate([CallStatus.RESOLVED, CallStatus.AWAITING_APPROVAL, CallStatus.EXECUTING]):
        state.calls[f"1.{i}"] = CallState(call_id=f"1.{i}", step=1, call_index=i, idem_key=f"k{i}", tool_name="kv_get",
                                          args_json='{"key":"greeting"}', args_hash="h", status=status,
                                          approval_id="ap" if status is CallStatus.AWAITING_APPROVAL else None)
    state.read_result("1.0", "kv_get", '{"value": "hi"}', untrusted=True)
    assert state.tainted_by and len(state.sources) == 2
    return state


def test_the_check_finds_what_a_shallow_copy_shares() -> None:
    state = _busy_state()
    assert _shared_mutable(state, state.model_copy())


def test_a_working_copy_shares_nothing_mutable() -> None:
    state = _busy_state()
    copy = state.clone()
    assert _shared_mutable(state, copy) == []
    assert copy.model_dump() == state.model_dump()


def test_changing_a_working_copy_leaves_the_committed_state_as_it_was() -> None:
    state = _busy_state()
    before = state.model_dump()
    copy = state.clone()
    copy.calls["1.2"].status = CallStatus.RESOLVED
    copy.read_result("1.2", "kv_get", '{"value": "again"}', untrusted=True)
    copy.read_goal("another goal")
    copy.tenant_grants.append("kv_put")
    assert state.model_dump() == before


def test_handling_records_leaves_the_committed_state_as_it_was(gw) -> None:
    gw.accept()
    call = gw.request("kv_put", KV_ARGS)
    committed = gw.driver.states["run-1"]
    before = committed.model_dump()
    gw.budget(call)  # the handler changes its working copy: the call starts executing
    assert gw.call_state(call).status is CallStatus.EXECUTING
    assert committed.model_dump() == before
