"""Settings come from TETHER_APPROVAL_* (infrastructure from TETHER_*), and the bootstrap wires them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tether_approval.bootstrap import build_processor
from tether_approval.notifier import WebhookNotifier
from tether_approval.settings import ApprovalSettings
from tether_runtime.logging import log_redactor


def test_defaults(monkeypatch):
    for name in ("TETHER_APPROVAL_WEBHOOK_URL", "TETHER_APPROVAL_APPROVER_ROLE", "TETHER_TOPIC_PREFIX",
                 "TETHER_FORBID_SELF_APPROVAL", "TETHER_APPROVAL_FORBID_SELF_APPROVAL"):
        monkeypatch.delenv(name, raising=False)
    processor = build_processor(ApprovalSettings(), registry=CollectorRegistry())
    assert processor.name == "approval"
    assert processor.inputs == ("tether.run-events.v1", "tether.commands.v1")
    assert processor.deps.notifier is None
    assert (processor.deps.policy.approver_role, processor.deps.policy.forbid_self_approval) == ("approver", True)


def test_environment_configures_policy_webhook_and_topics(monkeypatch):
    monkeypatch.setenv("TETHER_FORBID_SELF_APPROVAL", "false")  # shared with run-api
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_URL", "http://127.0.0.1:9/hook")
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_SECRET", "s3cret")
    monkeypatch.setenv("TETHER_APPROVAL_OUTCOME_UNKNOWN_TTL_MS", "1234")
    monkeypatch.setenv("TETHER_TOPIC_PREFIX", "test-x.")
    settings = ApprovalSettings()
    assert "s3cret" not in repr(settings)  # a secret never reaches a log line
    processor = build_processor(settings, registry=CollectorRegistry())
    policy = processor.deps.policy
    assert (policy.approver_role, policy.forbid_self_approval, policy.outcome_unknown_ttl_ms) == (
        "approver", False, 1234)
    assert isinstance(processor.deps.notifier, WebhookNotifier)
    assert processor.deps.notifier.origin == "http://127.0.0.1:9"
    assert "/hook" not in repr(settings)
    assert processor.inputs == ("test-x.tether.run-events.v1", "test-x.tether.commands.v1")
    assert processor.deps.topics.run_intake == "test-x.tether.run-intake.v1"


def test_the_webhook_url_and_signing_secret_are_registered_with_the_log_redactor(monkeypatch):
    path = "/webhookb2/0d9f2c4e-aa61-4b7e-9c3d-5e8f1a2b3c4d/IncomingWebhook/77ab01cd"
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_URL", f"https://acme.webhook.office.com{path}")
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_SECRET", "signing-key-1")
    build_processor(ApprovalSettings(), registry=CollectorRegistry())
    line = log_redactor().redact(f"POST https://acme.webhook.office.com{path} failed; GET {path}; key signing-key-1")
    assert "IncomingWebhook" not in line and "0d9f2c4e" not in line and "signing-key-1" not in line
