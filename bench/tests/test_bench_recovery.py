"""The recovery phase's figures count a service that never recovered instead of dropping it."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

import tether_bench.bench as bench_module
from tether_bench.bench import RECOVERY_TIMEOUT_S, Bench, BenchSettings, summary


class IdleLoad:
    """Stands in for the closed-loop load: the phase only starts and stops it."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def run(self, _seconds: float) -> None:
        pass

    def finish(self) -> None:
        pass

    def drain(self, _timeout_s: float) -> list[Any]:
        return []

    def close(self) -> None:
        pass


def recovery_results(monkeypatch: pytest.MonkeyPatch, recovery_s: list[float | None]) -> dict[str, Any]:
    """Run phase_recovery with each kill/restart sample replaced by the next of `recovery_s`."""
    monkeypatch.setattr(bench_module, "ClosedLoop", IdleLoad)
    monkeypatch.setattr(bench_module.time, "sleep", lambda _s: None)
    bench = Bench.__new__(Bench)
    bench.s = BenchSettings(scale=1.0, recovery_rounds=1)
    bench.observer = bench.tenants = bench.fast = bench.approve = None
    bench.bot = types.SimpleNamespace(enabled=False)
    bench.results = {}
    values: Iterator[float | None] = iter(recovery_s)
    bench._recover_once = lambda name: {"service": name, "restart_s": 1.0, "recovery_s": next(values)}
    bench.phase_recovery()
    return bench.results


def test_a_service_that_never_recovered_counts_as_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    results = recovery_results(monkeypatch, [1.2, 0.9, None, 1.1, 0.8, 1.0])

    assert results["recovery"]["recovery_s_p99"] >= RECOVERY_TIMEOUT_S
    assert results["recovery"]["unrecovered"] == 1
    line = summary(results)
    assert line["recovery_s_p99"] >= RECOVERY_TIMEOUT_S
    assert line["recovery_unrecovered"] == 1


def test_when_every_service_recovered_the_figures_are_the_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    results = recovery_results(monkeypatch, [1.2, 0.9, 3.5, 1.1, 0.8, 1.0])

    line = summary(results)
    assert line["recovery_s_p99"] == 3.5
    assert line["recovery_unrecovered"] == 0
