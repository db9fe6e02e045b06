"""Prometheus metrics of the approval service: approvals requested, decisions, refusals, webhook results."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter


class ApprovalMetrics:
    """The service's counters, registered in `registry` (a fresh one per test).

    Counted when a batch is handled; a batch that aborts and replays counts twice, so these
    are operational signals, not the record (the run event log is).
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requested = Counter(
            "tether_approval_requested_total", "Approvals parked, by reason for approval.", ["reason"],
            registry=registry,
        )
        self.decisions = Counter(
            "tether_approval_decisions_total", "ApprovalDecided emitted, by outcome.", ["outcome"], registry=registry
        )
        self.refusals = Counter(
            "tether_approval_refusals_total",
            "DecideApproval commands refused (nothing emitted), by reason.",
            ["reason"],
            registry=registry,
        )
        self.decisions_after_expiry = Counter(
            "tether_approval_decisions_after_expiry_total",
            "Decisions recorded in time but read after their approval had expired (refused"
            " DECISION_AFTER_EXPIRY; EXPIRED stands), by what the approver decided (approve, reject)."
            " An approve is a call a human allowed that did not run: alert on it.",
            ["decision"],
            registry=registry,
        )
        self.early_decisions = Counter(
            "tether_approval_early_decisions_total",
            "Decisions read before their ApprovalRequested and kept until it arrives.",
            registry=registry,
        )
        self.outcome_unknown_requests = Counter(
            "tether_approval_outcome_unknown_requests_total",
            "Approvals requested because a tool call's outcome became unknown.",
            registry=registry,
        )
        self.webhook = Counter(
            "tether_approval_webhook_total", "Approver webhook results (delivered, failed).", ["result"],
            registry=registry,
        )
