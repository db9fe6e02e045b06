"""Caps above the budget service's ceilings are refused by run-api (INVALID_ARGUMENT with a field violation)
at CreateAgent, UpdateAgent and SubmitRun, on the real stack; both services read the same settings."""

from __future__ import annotations

import uuid

import grpc
import pytest
from google.protobuf import field_mask_pb2
from google.rpc import error_details_pb2

from tether_api.v1 import (
    agent_service_pb2 as agents_pb,
    agent_service_pb2_grpc as agents_grpc,
    run_service_pb2 as runs_pb,
    run_service_pb2_grpc as runs_grpc,
    types_pb2 as types_pb,
)
from tether_budget.bootstrap import build_deps
from tether_budget.settings import BudgetSettings
from tether_contracts.records import AgentSpec, Caps, ModelRef
from tether_run_api import admin
from tether_run_api.api.status import error_info
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_MEMBER
from tether_run_api.domain.catalog import CapCeilings
from tether_run_api.settings import RunApiSettings

CEILING_ENV = ("TETHER_BUDGET_CEILING_MAX_STEPS", "TETHER_BUDGET_CEILING_MAX_WALL_CLOCK_MS",
               "TETHER_BUDGET_CEILING_MAX_TOKENS", "TETHER_BUDGET_CEILING_MAX_COST_USD_MICROS",
               "TETHER_BUDGET_CEILING_MAX_TOOL_CALLS")


def md(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def violations(err: grpc.RpcError) -> dict[str, str]:
    info, details = error_info(err)
    assert info is not None and info.reason == "INVALID_ARGUMENT"
    return {v.field: v.description for d in details if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations}


def caps(**over: int) -> types_pb.Caps:
    values = {"max_steps": 4, "max_wall_clock_ms": 60_000, "max_tokens": 5_000, "max_cost_usd_micros": 10_000}
    return types_pb.Caps(**{**values, **over})


def an_agent(agent_id: str, **over: int) -> agents_pb.Agent:
    return agents_pb.Agent(agent_id=agent_id, display_name="Helper", instructions="Help.",
                           model=types_pb.ModelRef(provider="openai", name="tether-scripted"), caps=caps(**over))


def test_run_api_and_the_budget_read_the_same_ceilings(monkeypatch) -> None:
    for name in CEILING_ENV:
        monkeypatch.delenv(name, raising=False)
    defaults = RunApiSettings()
    assert CapCeilings() == CapCeilings(defaults.ceiling_max_steps, defaults.ceiling_max_wall_clock_ms,
                                        defaults.ceiling_max_tokens, defaults.ceiling_max_cost_usd_micros,
                                        defaults.ceiling_max_tool_calls)
    for i, name in enumerate(CEILING_ENV):
        monkeypatch.setenv(name, str(11 + i))
    run_api, budget = RunApiSettings(), BudgetSettings()
    fields = ("ceiling_max_steps", "ceiling_max_wall_clock_ms", "ceiling_max_tokens", "ceiling_max_cost_usd_micros",
              "ceiling_max_tool_calls")
    assert [getattr(run_api, f) for f in fields] == [getattr(budget, f) for f in fields] == [11, 12, 13, 14, 15]
    policy = build_deps(budget).policy  # the budget still enforces what it reads
    assert (policy.max_steps, policy.max_tool_calls) == (11, 15)


@pytest.mark.integration
def test_caps_above_the_ceilings_are_refused_at_create_update_and_submit(stack) -> None:
    tenant_id = f"t-{uuid.uuid4().hex[:10]}"
    admin.create_tenant(stack.app.store, tenant_id, spread=1)
    key = admin.issue_key(stack.app.store, tenant_id, "alice", (ROLE_ADMIN, ROLE_MEMBER)).api_key
    agents = agents_grpc.AgentServiceStub(stack.channel)
    runs = runs_grpc.RunServiceStub(stack.channel)
    ceiling = stack.settings.ceiling_max_steps  # the default, 1000

    with pytest.raises(grpc.RpcError) as err:
        agents.CreateAgent(agents_pb.CreateAgentRequest(agent=an_agent("big", max_steps=ceiling + 1,
                                                                        max_tool_calls=20_000)), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    bad = violations(err.value)
    assert set(bad) == {"agent.caps.max_steps", "agent.caps.max_tool_calls"}
    assert f"above the service ceiling {ceiling}" in bad["agent.caps.max_steps"]
    assert stack.app.store.get_agent(tenant_id, "big") is None

    agents.CreateAgent(agents_pb.CreateAgentRequest(agent=an_agent("helper", max_steps=ceiling)), metadata=md(key))
    with pytest.raises(grpc.RpcError) as err:
        agents.UpdateAgent(agents_pb.UpdateAgentRequest(
            agent=an_agent("helper", max_tokens=stack.settings.ceiling_max_tokens + 1),
            update_mask=field_mask_pb2.FieldMask(paths=["caps.max_tokens"])), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert set(violations(err.value)) == {"agent.caps.max_tokens"}
    assert stack.app.store.get_agent(tenant_id, "helper").spec.version == 1

    # An agent stored above the ceilings (before they were lowered) is refused at submit, naming the cap ...
    stack.app.store.create_agent(tenant_id, AgentSpec(
        agent_id="legacy", version=1, name="Legacy", instructions="x", model=ModelRef(provider="openai", name="m"),
        tool_allowlist=[], caps=Caps(max_steps=ceiling * 5, max_wall_clock_ms=60_000, max_tokens=5_000,
                                     max_cost_usd_micros=10_000, max_tool_calls=10)), "root", 1, None)
    with pytest.raises(grpc.RpcError) as err:
        runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="legacy", goal="g"), metadata=md(key))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert set(violations(err.value)) == {"caps.max_steps"}
    assert stack.app.store.list_runs(tenant_id, None, 10) == []  # nothing recorded, nothing produced
    # ... unless the request tightens the cap under the ceiling.
    ok = runs.SubmitRun(runs_pb.SubmitRunRequest(agent_id="legacy", goal="g", caps=types_pb.Caps(max_steps=10)),
                        metadata=md(key))
    assert ok.run_id
