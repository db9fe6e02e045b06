"""The projector's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram


class ProjectorMetrics:
    """Counters and timings of projection; one instance per process (or per test registry)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.events = Counter(
            "tether_projector_events_total",
            "Run log events by outcome: applied, duplicate (seq already projected), rejected (unsealed).",
            ["outcome"],
            registry=registry,
        )
        self.chain_problems = Counter(
            "tether_projector_chain_problems_total",
            "Hash-chain defects found while projecting (GAP, PREV_HASH_MISMATCH, HASH_MISMATCH, TENANT_MISMATCH).",
            ["kind"],
            registry=registry,
        )
        self.live_failures = Counter(
            "tether_projector_live_failures_total",
            "Batches whose Redis publish failed after the read model committed.",
            registry=registry,
        )
        self.read_model_retries = Counter(
            "tether_projector_read_model_retries_total",
            "Read-model transactions retried after PostgreSQL was unavailable.",
            registry=registry,
        )
        self.batch_seconds = Histogram(
            "tether_projector_batch_seconds",
            "Time to project a batch: read-model transaction plus Redis publish.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
