"""A run's ledger has a size bound whatever the number of steps: it is checkpointed whole after
every record, and a checkpoint over message.max.bytes (1 MB) stalls the run. The calls and event
ids of old steps are folded into counters, the loop guard's run-wide memories are bounded, and
`last_error` is capped; the decisions stay those of a ledger that keeps everything.

Pure domain (`admit`, `fold`), no broker: thousands of steps run in seconds."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from tether_budget.domain import ledger as ledger_module
from tether_budget.domain.decisions import AdmissionPolicy, Decide, Plan, admit, fold, idem_key
from tether_budget.domain.errors import ProtocolViolation
from tether_budget.domain.ledger import Ledger
from tether_budget.domain.loopguard import LoopGuard, LoopGuardConfig
from tether_budget.entrypoint import BudgetStateCodec
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    Caps,
    ModelCallCompleted,
    ModelCallFailed,
    ModelRef,
    RiskClass,
    RunTerminated,
    StepGranted,
    SubmitRun,
    ToolCall,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallRequested,
    ToolSpec,
    Usage,
)

MODEL = ModelRef(provider="openai", name="gpt-test")
CODEC = BudgetStateCodec()
LAST_ERROR_CHARS = 1_000  # ledger.LAST_ERROR_CHARS


def _keep_everything(monkeypatch) -> LoopGuard:
    """A ledger that folds nothing and a guard that forgets nothing: the decisions before folding."""
    monkeypatch.setattr(ledger_module, "DETAIL_STEPS", 10**9, raising=False)
    return LoopGuard(LoopGuardConfig(pair_memory=10**9, action_memory=10**9))


def _tool(name: str, *, pollable: bool = False) -> ToolSpec:
    return ToolSpec(name=name, version=1, description=name, args_schema_json="{}", risk_class=RiskClass.READ_ONLY,
                    idempotent=True, untrusted_source=False, executor_kind="builtin", pollable=pollable)


@dataclass
class Run:
    """One run driven through the pure domain the way the handlers do: every appended record and
    decision is noted on the chain (`record_appended`), every outcome kept for comparison."""

    guard: LoopGuard = field(default_factory=LoopGuard)
    run_id: str = "r1"
    now_ms: int = 1_700_000_000_000
    outcomes: list[Any] = field(default_factory=list)
    ledger: Ledger | None = None

    def submit(self, max_steps: int) -> None:
        caps = Caps(max_steps=max_steps, max_wall_clock_ms=10**8, max_tokens=10**7, max_cost_usd_micros=10**8,
                    max_tool_calls=10_000)
        submit = SubmitRun(
            request_id="req", principal_id="alice", goal="g",
            agent=AgentSpec(agent_id="a", version=1, name="a", instructions="i", model=MODEL, tool_allowlist=[],
                            caps=caps),
            tools=[_tool("search"), _tool("fetch"), _tool("job_status", pollable=True)], caps=caps,
            tenant_grants=[],
        )  # fmt: skip
        self.ledger, plan = admit(submit, run_id=self.run_id, tenant_id="t1", partition=0, event_id="submit",
                                  now_ms=self.now_ms, policy=AdmissionPolicy(max_steps=100_000))
        self._write(plan, None)

    def _write(self, plan: Plan, event_id: str | None) -> None:
        ledger = self.ledger
        for entry in plan.entries:
            eid = event_id if not isinstance(entry, Decide) else hashlib.md5(repr(entry.what).encode()).hexdigest()
            if eid in ledger.seen_event_ids:
                continue
            ledger.record_appended(eid, ledger.seq + 1, "h")
        self.outcomes.append(
            (plan.dropped, [e.payload if isinstance(e, Decide) else "APPEND" for e in plan.entries])
        )

    def send(self, record: AvroRecord, *what: Any) -> Plan:
        self.now_ms += 10
        event_id = hashlib.md5(repr((type(record).__name__, *what)).encode()).hexdigest()
        plan = fold(self.ledger, record, event_id=event_id, tenant_id="t1", guard=self.guard, now_ms=self.now_ms)
        self._write(plan, event_id)
        return plan

    def model(self, step: int, k: int) -> Plan:
        usage = Usage(input_tokens=50, output_tokens=50, cost_usd_micros=1_000)
        return self.send(ModelCallCompleted(step=step, model=MODEL, usage=usage, tool_call_count=k,
                                            finish_reason="tool_calls", latency_ms=5), step)

    def request(self, step: int, index: int, tool_name: str, args: dict) -> ToolCall:
        args_json = json.dumps(args, sort_keys=True)
        call = ToolCall(call_id=f"{step}.{index}", call_index=index, idem_key=idem_key(self.run_id, step, index),
                        tool_name=tool_name, args_json=args_json, args_hash=hashlib.sha256(args_json.encode()).hexdigest())
        self.send(ToolCallRequested(step=step, call=call), step, index)
        return call

    def outcome(self, step: int, call: ToolCall, kind: str, result: str) -> Plan:
        common = dict(step=step, call_id=call.call_id, idem_key=call.idem_key, tool_name=call.tool_name)
        if kind == "done":
            record: AvroRecord = ToolCallCompleted(**common, result_json=result, duration_ms=3)
        elif kind == "failed":
            record = ToolCallFailed(**common, error_code="TOOL_ERROR", detail=result, retryable=True)
        else:
            record = ToolCallDenied(**common, reason_code="TOOL_NOT_ALLOWED", detail=result, policy_version="p1",
                                    inputs_hash="0" * 64)
        return self.send(record, call.call_id)

    def step(self, step: int, *calls: tuple[str, dict, str, str]) -> Plan:
        """A whole step: the model proposes the calls (tool, args, outcome kind, result), all finish."""
        self.model(step, len(calls))
        made = [self.request(step, i, tool, args) for i, (tool, args, _, _) in enumerate(calls)]
        plan = Plan()
        for call, (_, _, kind, result) in zip(made, calls, strict=True):
            plan = self.outcome(step, call, kind, result)
        return plan

    def size(self) -> int:
        return len(CODEC.encode(self.ledger))


def _progress(step: int) -> tuple[str, dict, str, str]:
    return ("search", {"q": f"page {step}"}, "done", json.dumps({"page": step, "rows": ["r"] * 3}))


def test_the_ledger_of_a_long_run_stays_the_same_size(monkeypatch) -> None:
    run = Run()
    run.submit(max_steps=6_000)
    sizes = {}
    for step in range(1, 5_001):
        plan = run.step(step, _progress(step))
        assert isinstance(plan.entries[-1].payload, StepGranted)
        if step in (100, 1_000, 2_000, 5_000):
            sizes[step] = run.size()
    # Without the fix: ~530 bytes more per step, 0.5 MB at step 1,000 and 2.6 MB at step 5,000.
    assert max(sizes.values()) < 40_000, sizes
    assert sizes[5_000] - sizes[1_000] < 1_000 and sizes[5_000] == sizes[2_000], sizes  # a digit more per step number
    ledger = run.ledger
    assert len(ledger.calls) <= ledger_module.DETAIL_STEPS + 1 and ledger.folded.count + len(ledger.calls) == 5_000
    assert len(ledger.loop.seen_pairs) == LoopGuardConfig().pair_memory
    # A checkpoint loads back to the same ledger.
    assert CODEC.decode(CODEC.encode(ledger)) == ledger


def test_steps_with_several_calls_also_keep_the_size_bound() -> None:
    run = Run()
    run.submit(max_steps=2_000)
    for step in range(1, 1_501):
        run.step(step, _progress(step), ("fetch", {"u": step % 7}, "failed", "boom " * 20),
                 ("search", {"q": -step}, "denied" if step % 50 == 0 else "done", '{"rows": []}'))
        if step == 1_000:
            at_1000 = run.size()
    assert run.ledger.active
    # Without the fix: ~1.5 kB more per step, 2.2 MB at step 1,500. With it, what still changes
    # is a digit more per step number and a few more denied actions remembered (`action_memory`).
    assert run.size() < 64_000 and abs(run.size() - at_1000) < 1_500, (at_1000, run.size())


def _script(run: Run) -> None:
    """A representative run: progress with failures, denials, polls and two-call steps; late
    duplicates of recent records; four early pairs the agent later wanders over (R5, only caught
    if the guard still remembers them); then an exact repeat (R1) that terminates the run."""
    run.submit(max_steps=2_000)
    early = [("fetch", {"u": f"e{i}"}, "done", f'{{"e": {i}}}') for i in range(4)]
    step = 0
    for call in early:
        step += 1
        run.step(step, call)
    for _ in range(300):
        step += 1
        calls = [_progress(step)]
        if step % 7 == 0:
            calls.append(("fetch", {"u": "flaky"}, "failed", f"timeout {step % 3}"))
        if step % 11 == 0:
            calls.append(("search", {"q": f"secret {step}"}, "denied", "not for you"))
        if step % 13 == 0:
            calls = [("job_status", {"job": "j"}, "done", '{"state": "pending"}')]
        run.step(step, *calls)
        if step % 17 == 0:  # a late duplicate of the step's model call: dropped, not appended
            run.model(step, len(calls))
    # Wander over the early pairs, first seen ~300 steps ago: no new information (no cycle either).
    for i in (0, 1, 0, 2, 3, 1, 1, 0, 3, 2, 0, 0):
        step += 1
        run.step(step, early[i])
    for _ in range(6):
        step += 1
        run.step(step, ("search", {"q": "same"}, "done", '{"results": []}'))
        if not run.ledger.active:
            return


def _loop_verdicts(outcomes: list[Any]) -> list[Any]:
    """The grants with a loop warning and the termination, from a run's outcomes."""
    found = []
    for _, entries in outcomes:
        for e in entries:
            if isinstance(e, StepGranted) and e.loop_warning:
                found.append((e.step, e.loop_warning))
            if isinstance(e, RunTerminated):
                found.append((e.reason_code, e.report.detail))
    return found


def _without_done_list(outcomes: list[Any]) -> list[Any]:
    def strip(e: Any) -> Any:
        if isinstance(e, RunTerminated):
            return e.model_copy(update={"report": e.report.model_copy(update={"tool_calls_done": []})})
        return e

    return [(dropped, [strip(e) for e in entries]) for dropped, entries in outcomes]


def test_decisions_are_those_of_a_ledger_that_keeps_everything(monkeypatch) -> None:
    bounded = Run()
    _script(bounded)

    everything = Run(guard=_keep_everything(monkeypatch))
    _script(everything)
    assert everything.ledger.folded.count == 0  # the reference folded nothing

    assert _without_done_list(bounded.outcomes) == _without_done_list(everything.outcomes)
    verdicts = _loop_verdicts(bounded.outcomes)
    # The wander over pairs seen 300 steps earlier is caught (R5), then the repeat ends the run (R1).
    assert len(verdicts) == 2 and "R5_NO_PROGRESS" in verdicts[0][1], verdicts
    assert verdicts[1][0] == "LOOP_DETECTED" and "R1_REPEAT" in verdicts[1][1], verdicts
    assert sum(dropped == "DUPLICATE_EVENT" for dropped, _ in bounded.outcomes) == len(range(17, 305, 17))

    # The report's done list: the folded calls as one line of counts, then the same lines.
    done = bounded.outcomes[-1][1][-1].report.tool_calls_done
    full = everything.outcomes[-1][1][-1].report.tool_calls_done
    folded = bounded.ledger.folded
    assert done[1:] == full[folded.count:] and done[0] == folded.summary()
    assert sum(folded.outcomes.values()) == folded.count
    assert done[0].startswith(f"{folded.count} earlier call(s) of steps 1–{folded.through_step}: fetch COMPLETED ×")


def test_a_record_of_a_folded_step_is_dropped_as_stale() -> None:
    run = Run()
    run.submit(max_steps=100)
    calls = {step: run.step(step, _progress(step)) for step in range(1, 41)}
    assert calls and run.ledger.folded.through_step == 40 - ledger_module.DETAIL_STEPS
    before = run.ledger.model_dump()
    assert run.model(3, 1).dropped == "STALE_STEP"  # a duplicate whose id was forgotten
    assert run.ledger.seq == before["seq"]
    recent = 40 - ledger_module.DETAIL_STEPS + 1
    assert run.model(recent, 1).dropped == "DUPLICATE_EVENT"  # a recent one: still known by its id


@pytest.mark.parametrize("steps_before", [0, 40])
def test_a_record_of_step_0_is_a_step_mismatch_not_a_stale_step(steps_before: int) -> None:
    # Nothing is folded on a fresh run (through_step 0), yet step 0 was never granted either:
    # the record is dead-lettered as the protocol violation it is, not silently dropped.
    run = Run()
    run.submit(max_steps=100)
    for step in range(1, steps_before + 1):
        run.step(step, _progress(step))
    seq = run.ledger.seq
    with pytest.raises(ProtocolViolation) as refused:
        run.model(0, 1)
    assert refused.value.reason == "STEP_MISMATCH" and run.ledger.seq == seq


def test_an_old_checkpoint_that_kept_every_call_and_id_loads_and_folds_like_a_live_one(monkeypatch) -> None:
    live = Run()
    live.submit(max_steps=200)
    for step in range(1, 61):
        live.step(step, _progress(step))

    old = Run(guard=_keep_everything(monkeypatch))
    old.submit(max_steps=200)
    for step in range(1, 61):
        old.step(step, _progress(step))
    monkeypatch.undo()
    old.guard = LoopGuard()
    # As written before folding: ids and pairs as sets (JSON lists), every call, no `folded`.
    data = json.loads(old.ledger.model_dump_json())
    data["seen_event_ids"] = list(data["seen_event_ids"])
    data["loop"]["seen_pairs"] = sorted(data["loop"]["seen_pairs"])
    del data["folded"]
    old.ledger = CODEC.decode(json.dumps(data).encode())
    assert len(old.ledger.calls) == 60

    for run in (live, old):
        run.outcomes.clear()
        for step in range(61, 81):
            run.step(step, _progress(step))
    assert old.outcomes == live.outcomes
    assert old.ledger.calls == live.ledger.calls and old.ledger.folded == live.ledger.folded
    assert old.ledger.seen_event_ids.keys() == live.ledger.seen_event_ids.keys()
    assert old.ledger.loop.seen_pairs.keys() == live.ledger.loop.seen_pairs.keys()


@pytest.mark.parametrize("kind", ["model", "failed", "denied"])
def test_a_huge_error_detail_gives_a_bounded_last_error(kind: str) -> None:
    huge = "stack frame\n" * 200_000  # 2.4 MB
    run = Run()
    run.submit(max_steps=10)
    if kind == "model":
        plan = run.send(ModelCallFailed(step=1, error_code="PROVIDER_ERROR", detail=huge, attempts=3,
                                        usage=Usage()), 1)
        report = plan.entries[-1].payload.report
        assert len(report.last_error) == LAST_ERROR_CHARS
    else:
        run.step(1, ("fetch", {"u": 1}, kind, huge))
    last_error = run.ledger.last_error
    assert len(last_error) == LAST_ERROR_CHARS and last_error.startswith("step 1 model call" if kind == "model" else "1.0")
    assert last_error.endswith(" chars in all]") and "… [truncated, " in last_error[-40:]
    assert run.size() < 8_000
    # A short error is kept whole.
    assert ledger_module.capped_error("boom") == "boom" and ledger_module.LAST_ERROR_CHARS == LAST_ERROR_CHARS
