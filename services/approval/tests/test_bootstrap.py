"""Settings come from TETHER_APPROVAL_* (infrastructure from TETHER_*), and the bootstrap wires them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tether_approval.bootstrap import build_processor
from tether_approval.notifier import WebhookNotifier
from tether_approval.settings import ApprovalSettings


def test_defaults(monkeypatch):
    for name in ("TETHER_APPROVAL_WEBHOOK_URL", "TETHER_APPROVAL_APPROVER_ROLE", "TETHER_TOPIC_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    processor = build_processor(ApprovalSettings(), registry=CollectorRegistry())
    assert processor.name == "approval"
    assert processor.inputs == ("tether.run-events.v1", "tether.commands.v1")
    assert processor.deps.notifier is None
    assert (processor.deps.policy.approver_role, processor.deps.policy.forbid_self_approval) == ("approver", True)


def test_environment_configures_policy_webhook_and_topics(monkeypatch):
    monkeypatch.setenv("TETHER_APPROVAL_APPROVER_ROLE", "release-manager")
    monkeypatch.setenv("TETHER_APPROVAL_FORBID_SELF_APPROVAL", "false")
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_URL", "http://127.0.0.1:9/hook")
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_SECRET", "s3cret")
    monkeypatch.setenv("TETHER_APPROVAL_OUTCOME_UNKNOWN_TTL_MS", "1234")
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "test-x.")
    settings = ApprovalSettings()
    assert "s3cret" not in repr(settings)  # a secret never reaches a log line
    processor = build_processor(settings, registry=CollectorRegistry())
    policy = processor.deps.policy
    assert (policy.approver_role, policy.forbid_self_approval, policy.outcome_unknown_ttl_ms) == (
        "release-manager", False, 1234)
    assert isinstance(processor.deps.notifier, WebhookNotifier)
    assert processor.deps.notifier.url == "http://127.0.0.1:9/hook"
    assert processor.inputs == ("test-x.tether.run-events.v1", "test-x.tether.commands.v1")
    assert processor.deps.topics.run_intake == "test-x.tether.run-intake.v1"
