"""Each cap (steps, tokens, cost, wall clock) ends a run with its reason code and a termination report,
and nothing runs after it: no further grant, no further tool call, no further effect."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tether_api.v1 import run_service_pb2 as runs_pb, types_pb2 as types_pb
from tether_contracts.records import (
    ModelCallCompleted,
    RunTerminated,
    StepGranted,
    ToolCallBudgeted,
    ToolCallRequested,
)
from tether_messaging.chain import verify_chain
from tether_messaging.serde import open_payload

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Capped:
    """A run of a tests/e2e/scenarios/caps.json scenario under one tightened cap."""

    scenario: str
    caps: types_pb.Caps
    reason: str
    #: Steps whose tool calls ran (and whose kv keys cap/<run>/<step> were written), all others never.
    steps_with_effects: tuple[int, ...]
    #: Steps the model was asked for.
    model_steps: tuple[int, ...]


CASES = {
    # Steps 1 and 2 run their kv_put; step 3 is never granted.
    "steps": Capped("e2e-cap-steps", types_pb.Caps(max_steps=2), "STEP_CAP", (1, 2), (1, 2)),
    # 6,100 tokens per step: step 2's ModelCallCompleted makes 12,200 > 10,000, so its call is never run.
    "tokens": Capped("e2e-cap-tokens", types_pb.Caps(max_tokens=10_000), "TOKEN_CAP", (1,), (1, 2)),
    # 60,200 µUSD per step: step 2 makes 120,400 > 100,000 (120,200 tokens stay under the agent's 200,000).
    "cost": Capped("e2e-cap-cost", types_pb.Caps(max_cost_usd_micros=100_000), "COST_CAP", (1,), (1, 2)),
    # Step 1's model call takes 20 s; the run's 10 s run out while it is in flight (its call has
    # 10 s to start: ample on a loaded machine).
    "wall-clock": Capped("e2e-cap-wall-clock", types_pb.Caps(max_wall_clock_ms=10_000), "WALL_CLOCK_CAP", (), (1,)),
}


@pytest.fixture(scope="module")
def capped_runs(tether_system) -> Iterator[dict[str, str]]:
    """The four capped runs, submitted together (they are independent), by case name."""
    client = tether_system.client
    submitted = {}
    for name, case in CASES.items():
        request = runs_pb.SubmitRunRequest(request_id=str(uuid.uuid4()), agent_id="demo", caps=case.caps,
                                           goal=f"[scenario:{case.scenario}] Do a few small steps.")
        submitted[name] = client.runs.SubmitRun(request, metadata=client.metadata, timeout=30).run_id
    yield submitted


def wait_for(what: str, predicate, timeout_s: float, on_timeout) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f}s\n{on_timeout()}")
        time.sleep(0.5)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_a_cap_ends_the_run_with_its_reason_and_a_report(name, capped_runs, tether_system, runs, event_log):
    system, case = tether_system, CASES[name]
    run_id = capped_runs[name]
    run = runs.wait_for_end(run_id, timeout_s=180)
    assert run.status == runs_pb.RUN_STATUS_TERMINATED, f"{name}: {run}\n{runs.logs()}"
    report = run.termination
    assert report.reason_code == case.reason, f"{name}: {report}"
    assert report.detail and report.suggested_next_action, report

    if name == "wall-clock":
        # The model call in flight at the deadline still costs money, so its ModelCallCompleted is
        # appended after RunTerminated; wait for it, so that "nothing ran after" covers its tool call.
        wait_for("step 1's late ModelCallCompleted was not appended",
                 lambda: any(isinstance(open_payload(e), ModelCallCompleted) and open_payload(e).step == 1
                             for e in event_log.run(run_id)), 60, runs.logs)
    log = event_log.run(run_id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1)) and verify_chain(log) == []
    payloads = [open_payload(e) for e in log]
    ends = [i for i, p in enumerate(payloads) if isinstance(p, RunTerminated)]
    assert len(ends) == 1, f"{name}: {[type(p).__name__ for p in payloads]}"
    end = ends[0]
    terminated = payloads[end]

    # -- GetRun shows the log's report: reason, what was done, what is pending, usage, what next ----------
    assert terminated.reason_code == case.reason
    logged = terminated.report
    assert (report.reason_code, report.detail, report.steps_done, list(report.tool_calls_done), list(report.pending),
            report.last_error, report.suggested_next_action) == (
        logged.reason_code, logged.detail, logged.steps_done, logged.tool_calls_done, logged.pending,
        logged.last_error or "", logged.suggested_next_action)
    assert (report.usage.input_tokens, report.usage.output_tokens, report.usage.cost_usd_micros) == (
        logged.usage.input_tokens, logged.usage.output_tokens, logged.usage.cost_usd_micros)
    done = [f"{step}.0 kv_put COMPLETED" for step in case.steps_with_effects]
    assert list(report.tool_calls_done) == done, report
    before = [p for p in payloads[:end] if isinstance(p, ModelCallCompleted)]
    counted = (sum(p.usage.input_tokens for p in before), sum(p.usage.output_tokens for p in before),
               sum(p.usage.cost_usd_micros for p in before))
    assert (report.usage.input_tokens, report.usage.output_tokens, report.usage.cost_usd_micros) == counted
    if name == "steps":
        assert report.steps_done == 2 and list(report.pending) == [] and "2 steps" in report.detail
    elif name == "tokens":
        assert counted[0] + counted[1] == 12_200 > case.caps.max_tokens
        assert "1 tool call(s) of step 2 not yet requested" in report.pending, report
    elif name == "cost":
        assert counted[2] == 120_400 > case.caps.max_cost_usd_micros
        assert counted[0] + counted[1] < 200_000, "the token cap must not be what stopped it"
        assert "1 tool call(s) of step 2 not yet requested" in report.pending, report
    elif name == "wall-clock":
        assert list(report.pending) == ["model call for step 1"], report
        assert "deadline" in report.detail
        # The call in flight at the deadline still cost money: its usage is recorded after the end.
        late = [p for p in payloads[end + 1:] if isinstance(p, ModelCallCompleted)]
        assert [(p.step, p.tool_call_count) for p in late] == [(1, 1)], late

    # -- nothing ran after the cap ------------------------------------------------------------------------
    after = payloads[end + 1:]
    assert not [p for p in after if isinstance(p, (StepGranted, ToolCallRequested, ToolCallBudgeted))], \
        f"{name}: work after RunTerminated: {[type(p).__name__ for p in after]}"
    requested = {p.call.call_id for p in payloads if isinstance(p, ToolCallRequested)}
    budgeted = {p.call_id for p in payloads if isinstance(p, ToolCallBudgeted)}
    expected_calls = {f"{step}.0" for step in case.steps_with_effects}
    assert requested == budgeted == expected_calls, (requested, budgeted)
    granted = [p.step for p in payloads if isinstance(p, StepGranted)]
    assert granted == list(case.model_steps)
    asked = sorted({int(r["headers"]["x-tether-step"]) for r in system.model_requests()
                    if r["headers"].get("x-tether-run") == run_id})
    assert asked == list(case.model_steps), f"{name}: the model was asked for steps {asked}"
    written = {r["key"] for r in system.sink_records("kv") if r["key"].startswith(system.kv_store_key(f"cap/{run_id}/")) and r["applied"]}
    assert written == {system.kv_store_key(f"cap/{run_id}/{step}") for step in case.steps_with_effects}, f"{name}: kv writes {written}"
