"""Prometheus metrics of the budget service: admissions, grants, terminations, loop detections, drops."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter


class BudgetMetrics:
    """The service's counters, registered in `registry` (a fresh one per test).

    Counted when a batch is handled; a batch that aborts and replays counts twice, so these
    are operational signals, not the ledger (the run event log is).
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.runs_accepted = Counter("tether_budget_runs_accepted_total", "Runs admitted.", registry=registry)
        self.runs_queued = Counter(
            "tether_budget_runs_queued_total", "Runs put in their tenant's queue (at its concurrency cap).",
            registry=registry,
        )
        self.steps_deferred = Counter(
            "tether_budget_steps_deferred_total", "Grants deferred by a tenant's token rate.", registry=registry
        )
        self.runs_rejected = Counter(
            "tether_budget_runs_rejected_total", "Runs refused at admission, by reason.", ["reason"], registry=registry
        )
        self.runs_completed = Counter(
            "tether_budget_runs_completed_total", "Runs that ended with a final answer.", registry=registry
        )
        self.runs_terminated = Counter(
            "tether_budget_runs_terminated_total", "Runs stopped, by reason.", ["reason"], registry=registry
        )
        self.steps_granted = Counter("tether_budget_steps_granted_total", "StepGranted decisions.", registry=registry)
        self.tool_calls_budgeted = Counter(
            "tether_budget_tool_calls_budgeted_total", "ToolCallBudgeted decisions.", registry=registry
        )
        self.loop_detections = Counter(
            "tether_budget_loop_detections_total",
            "Loop detections by rule and effect (warn or terminate).",
            ["rule", "effect"],
            registry=registry,
        )
        self.events_sequenced = Counter(
            "tether_budget_events_sequenced_total",
            "Events appended to the run event log, by type.",
            ["event_type"],
            registry=registry,
        )
        self.usage_clamped = Counter(
            "tether_budget_usage_clamped_total",
            "Model-call usage fields reported below zero and counted as 0 (a producer bug), by field.",
            ["field"],
            registry=registry,
        )
        self.records_dropped = Counter(
            "tether_budget_records_dropped_total",
            "Input records not appended (duplicates, late requests), by reason.",
            ["reason"],
            registry=registry,
        )
