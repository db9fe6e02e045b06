"""Pure figures from what the observer saw: completed steps, per-step platform overhead, submit latency."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tether_bench.common import (
    MODEL_CALL_COMPLETED,
    RUN_ACCEPTED,
    RUN_COMPLETED,
    STEP_GRANTED,
    TERMINAL_TYPES,
    TOOL_CALL_BUDGETED,
    TOOL_CALL_COMPLETED,
    TOOL_CALL_FAILED,
    percentile,
    rounded,
)
from tether_bench.observer import Seen


@dataclass(frozen=True)
class Step:
    """One finished step of a run: StepGranted(n) up to StepGranted(n+1) or RunCompleted, by recorded_at_ms."""

    run_id: str
    granted_ms: int
    ended_ms: int
    model_ms: int  # ModelCallCompleted.latency_ms: the model's own time
    tool_ms: int  # sum of the step's ToolCallCompleted/Failed.duration_ms: the tools' own time
    #: Platform time of the parts of the step, where the step had them (ms):
    #: grant → model call recorded (minus the model), model call → last budgeted call,
    #: last budget → last tool outcome (minus the tools), last outcome → next grant.
    parts: tuple[int | None, int | None, int | None, int | None]

    @property
    def overhead_ms(self) -> int:
        return self.ended_ms - self.granted_ms - self.model_ms - self.tool_ms


def steps_of(run_id: str, events: Sequence[Seen]) -> list[Step]:
    """The run's finished steps (a step still open at the end of `events` is not counted)."""
    ordered = sorted(events, key=lambda e: e.seq)
    steps: list[Step] = []
    current: list[Seen] | None = None
    for event in ordered:
        if event.event_type == STEP_GRANTED or event.event_type == RUN_COMPLETED:
            if current is not None:
                steps.append(_step(run_id, current, event))
            current = [event] if event.event_type == STEP_GRANTED else None
        elif event.event_type in TERMINAL_TYPES:
            current = None  # terminated mid-step: not a finished step
        elif current is not None:
            current.append(event)
    return steps


def _step(run_id: str, events: list[Seen], end: Seen) -> Step:
    grant = events[0]
    model = [e for e in events if e.event_type == MODEL_CALL_COMPLETED]
    budgeted = [e for e in events if e.event_type == TOOL_CALL_BUDGETED]
    outcomes = [e for e in events if e.event_type in (TOOL_CALL_COMPLETED, TOOL_CALL_FAILED)]
    model_ms = sum(int(e.extra.get("latency_ms", 0)) for e in model)
    tool_ms = sum(int(e.extra.get("duration_ms", 0)) for e in outcomes)
    parts: list[int | None] = [None, None, None, None]
    if model:
        parts[0] = model[-1].recorded_at_ms - grant.recorded_at_ms - model_ms
        last = model[-1].recorded_at_ms
        if budgeted:
            parts[1] = budgeted[-1].recorded_at_ms - last
            if outcomes:
                parts[2] = outcomes[-1].recorded_at_ms - budgeted[-1].recorded_at_ms - tool_ms
                parts[3] = end.recorded_at_ms - outcomes[-1].recorded_at_ms
        else:
            parts[3] = end.recorded_at_ms - last
    return Step(run_id, grant.recorded_at_ms, end.recorded_at_ms, model_ms, tool_ms, tuple(parts))


def all_steps(runs: Mapping[str, Sequence[Seen]], only: Iterable[str] | None = None) -> list[Step]:
    chosen = runs.keys() if only is None else [r for r in only if r in runs]
    return [step for run in chosen for step in steps_of(run, runs[run])]


def throughput(steps: Sequence[Step], window_ms: tuple[float, float]) -> dict[str, float | int | None]:
    """Steps finished inside the window, per second, and the overhead percentiles of those steps."""
    start, end = window_ms
    inside = [s for s in steps if start <= s.ended_ms <= end]
    seconds = max(0.001, (end - start) / 1000)
    overheads = [s.overhead_ms for s in inside]
    parts = {}
    for i, name in enumerate(("planner", "budget_tools", "gateway", "budget_grant")):
        values = [s.parts[i] for s in inside if s.parts[i] is not None]
        parts[f"{name}_ms_p50"] = rounded(percentile(values, 50), 1)
    return {
        "steps": len(inside),
        "window_s": round(seconds, 1),
        "steps_per_s": round(len(inside) / seconds, 1),
        "step_overhead_ms_p50": rounded(percentile(overheads, 50), 1),
        "step_overhead_ms_p99": rounded(percentile(overheads, 99), 1),
        "model_ms_p50": rounded(percentile([s.model_ms for s in inside], 50), 1),
        "tool_ms_p50": rounded(percentile([s.tool_ms for s in inside], 50), 1),
        **{f"overhead_{k}": v for k, v in parts.items()},
    }


def submit_to_first_event(submit_start_ms: Mapping[str, float], runs: Mapping[str, Sequence[Seen]]) -> list[float]:
    """Per run: from the client's SubmitRun call to the moment a log reader got the run's first event."""
    out = []
    for run_id, started in submit_start_ms.items():
        events = runs.get(run_id)
        if not events:
            continue
        first = min(events, key=lambda e: e.seq)
        if first.event_type == RUN_ACCEPTED:
            out.append(first.seen_ms - started)
    return out
