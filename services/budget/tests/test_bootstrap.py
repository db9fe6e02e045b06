"""The composition root builds the processor exactly as the settings say."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tether_budget.bootstrap import build_processor
from tether_budget.settings import BudgetSettings


def test_settings_from_the_environment_reach_the_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "t-x.")
    monkeypatch.setenv("TETHER_BUDGET_CEILING_MAX_STEPS", "7")
    monkeypatch.setenv("TETHER_BUDGET_LOOP_REPEAT_N", "5")
    monkeypatch.setenv("TETHER_BUDGET_LOOP_POLL_BUDGET", "2")
    monkeypatch.setenv("TETHER_BUDGET_TOMBSTONE_RETENTION_MS", "1000")
    processor = build_processor(BudgetSettings(), registry=CollectorRegistry())
    assert processor.name == "budget"
    assert processor.inputs == ("t-x.tether.commands.v1", "t-x.tether.run-intake.v1")
    deps = processor.deps
    assert deps.topics.run_events == "t-x.tether.run-events.v1"
    assert deps.policy.max_steps == 7
    assert (deps.guard.config.repeat_n, deps.guard.config.poll_budget) == (5, 2)
    assert deps.retention.tombstone_ms == 1000

