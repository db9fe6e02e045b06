"""Builds the budget processor and its dependencies from settings (no I/O besides topic declaration)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from tether_budget.domain.decisions import AdmissionPolicy, Retention
from tether_budget.domain.loopguard import LoopGuard, LoopGuardConfig
from tether_budget.entrypoint import BudgetProcessor
from tether_budget.handlers import Deps
from tether_budget.metrics import BudgetMetrics
from tether_budget.settings import BudgetSettings
from tether_messaging.topics import Topics


def build_deps(settings: BudgetSettings, *, registry: CollectorRegistry = REGISTRY) -> Deps:
    """The handlers' dependencies as the settings describe them."""
    return Deps(
        topics=Topics(settings.topic_prefix),
        policy=AdmissionPolicy(
            max_steps=settings.ceiling_max_steps,
            max_wall_clock_ms=settings.ceiling_max_wall_clock_ms,
            max_tokens=settings.ceiling_max_tokens,
            max_cost_usd_micros=settings.ceiling_max_cost_usd_micros,
            max_tool_calls=settings.ceiling_max_tool_calls,
        ),
        guard=LoopGuard(
            LoopGuardConfig(
                repeat_n=settings.loop_repeat_n,
                error_n=settings.loop_error_n,
                denial_n=settings.loop_denial_n,
                monologue_n=settings.loop_monologue_n,
                cycle_repeats=settings.loop_cycle_repeats,
                novelty_window=settings.loop_novelty_window,
                poll_budget=settings.loop_poll_budget,
            )
        ),
        retention=Retention(
            ended_ledger_ms=settings.ended_ledger_retention_ms,
            tombstone_ms=settings.tombstone_retention_ms,
        ),
        metrics=BudgetMetrics(registry),
    )


def build_processor(settings: BudgetSettings, *, registry: CollectorRegistry = REGISTRY) -> BudgetProcessor:
    """The budget processor wired from settings."""
    return BudgetProcessor(build_deps(settings, registry=registry))


def declare_topics(settings: BudgetSettings) -> None:
    """Create the topics the budget reads and writes (and its changelog) if missing; idempotent."""
    from tether_messaging.admin import declare_topics as declare

    declare(settings.kafka_bootstrap, settings.partitions, [BudgetProcessor.name], prefix=settings.topic_prefix,
            replication_factor=settings.topic_replication_factor)
