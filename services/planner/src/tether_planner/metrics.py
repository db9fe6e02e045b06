"""Prometheus metrics of the planner: model calls, tokens, cost, repairs, compactions, skipped replays."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram


class PlannerMetrics:
    """The service's metrics, registered in `registry` (a fresh one per test)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.steps = Counter(
            "tether_planner_steps_total", "Steps whose model work finished, by outcome.", ["provider", "outcome"],
            registry=registry,
        )
        self.model_calls = Counter(
            "tether_planner_model_calls_total", "Model calls made (repairs included).", ["provider"], registry=registry
        )
        self.tokens = Counter(
            "tether_planner_tokens_total", "Tokens billed, by direction.", ["provider", "direction"], registry=registry
        )
        self.cost = Counter(
            "tether_planner_cost_usd_micros_total", "Cost of model calls in micro-dollars.", ["provider"], registry=registry
        )
        self.unpriced = Counter(
            "tether_planner_unpriced_steps_total",
            "Steps charged at the default price because the model is not in the pricing table.",
            ["model"],
            registry=registry,
        )
        self.repairs = Counter(
            "tether_planner_malformed_responses_total", "Model responses with invalid tool calls.", registry=registry
        )
        self.compactions = Counter(
            "tether_planner_compactions_total", "Steps whose working context was compacted.", registry=registry
        )
        self.results_shortened = Counter(
            "tether_planner_tool_results_shortened_total",
            "Tool results kept shorter than TOOL_RESULT_MAX_CHARS so the run's checkpoint fits STATE_MAX_BYTES.",
            registry=registry,
        )
        self.skipped = Counter(
            "tether_planner_skipped_total", "Inputs or work outcomes not acted on, by reason.", ["reason"], registry=registry
        )
        self.step_seconds = Histogram(
            "tether_planner_model_latency_seconds",
            "Model latency per step (all calls and retries).",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
            registry=registry,
        )
