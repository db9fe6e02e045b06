"""Step figures from observed events: a step's platform overhead is its span minus the model's and the tools' time."""

from __future__ import annotations

from tether_bench.analysis import steps_of, submit_to_first_event, throughput
from tether_bench.common import percentile
from tether_bench.observer import Seen


def seen(seq: int, kind: str, at: int, **extra) -> Seen:
    return Seen(seq, f"tether.v1.{kind}", at, float(at + 5), "x", extra)


RUN = [
    seen(1, "RunAccepted", 1000),
    seen(2, "StepGranted", 1000),
    seen(3, "ModelCallCompleted", 1100, latency_ms=60),
    seen(4, "ToolCallRequested", 1100),
    seen(5, "ToolCallBudgeted", 1120),
    seen(6, "ToolCallCompleted", 1200, duration_ms=30),
    seen(7, "StepGranted", 1230),
    seen(8, "ModelCallCompleted", 1300, latency_ms=50),
    seen(9, "RunCompleted", 1300),
]


def test_each_finished_step_has_its_overhead_and_parts() -> None:
    first, second = steps_of("r", list(reversed(RUN)))  # order comes from seq, not arrival
    assert (first.granted_ms, first.ended_ms, first.model_ms, first.tool_ms) == (1000, 1230, 60, 30)
    assert first.overhead_ms == 230 - 60 - 30
    assert first.parts == (40, 20, 50, 30)
    assert second.overhead_ms == 70 - 50
    assert second.parts == (20, None, None, 0)


def test_a_step_cut_off_by_termination_or_still_open_is_not_counted() -> None:
    terminated = [*RUN[:6], seen(7, "RunTerminated", 1300)]
    assert steps_of("r", terminated) == []
    assert len(steps_of("r", RUN[:7])) == 1


def test_throughput_counts_steps_ending_inside_the_window() -> None:
    steps = steps_of("r", RUN)
    figures = throughput(steps, (1200.0, 1300.0))
    assert figures["steps"] == 2
    assert figures["steps_per_s"] == 20.0
    assert throughput(steps, (1250.0, 1300.0))["steps"] == 1


def test_submit_to_first_event_uses_when_the_reader_got_run_accepted() -> None:
    assert submit_to_first_event({"r": 990.0, "missing": 1.0}, {"r": RUN}) == [1005.0 - 990.0]


def test_percentile_is_nearest_rank() -> None:
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([], 50) is None
