"""Builds the approval processor and its dependencies from settings (no I/O besides topic declaration)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from tether_approval.domain.decisions import ApprovalPolicy
from tether_approval.entrypoint import ApprovalProcessor
from tether_approval.handlers import Deps
from tether_approval.metrics import ApprovalMetrics
from tether_approval.notifier import WebhookNotifier, webhook_credentials
from tether_approval.settings import ApprovalSettings
from tether_messaging.topics import Topics
from tether_runtime.logging import log_redactor


def build_deps(settings: ApprovalSettings, *, registry: CollectorRegistry = REGISTRY) -> Deps:
    """The handlers' dependencies as the settings describe them."""
    notifier = None
    url = settings.webhook_url.get_secret_value() if settings.webhook_url else ""
    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else None
    # The webhook URL is a bearer credential (its path or query grants posting to the channel),
    # and so is the signing secret: no log line of this process may show either.
    log_redactor().add_secrets([*webhook_credentials(url), *([secret] if secret else [])])
    if url:
        notifier = WebhookNotifier(
            url,
            timeout_s=settings.webhook_timeout_s,
            max_attempts=settings.webhook_max_attempts,
            max_seconds=settings.webhook_max_seconds,
            secret=secret,
        )
    return Deps(
        topics=Topics(settings.topic_prefix),
        policy=ApprovalPolicy(
            approver_role=settings.approver_role,
            forbid_self_approval=settings.forbid_self_approval,
            outcome_unknown_ttl_ms=settings.outcome_unknown_ttl_ms,
            max_early_decisions=settings.max_early_decisions,
            early_decision_ttl_ms=settings.early_decision_ttl_ms,
            expiry_grace_ms=settings.expiry_grace_ms,
        ),
        metrics=ApprovalMetrics(registry),
        notifier=notifier,
    )


def build_processor(settings: ApprovalSettings, *, registry: CollectorRegistry = REGISTRY) -> ApprovalProcessor:
    """The approval processor wired from settings."""
    return ApprovalProcessor(build_deps(settings, registry=registry))


def declare_topics(settings: ApprovalSettings) -> None:
    """Create the topics the approval service reads and writes (and its changelog) if missing; idempotent."""
    from tether_messaging.admin import declare_topics as declare

    declare(settings.kafka_bootstrap, settings.partitions, [ApprovalProcessor.name], prefix=settings.topic_prefix,
            replication_factor=settings.topic_replication_factor)
