"""The webhook adapter against a local HTTP receiver on 127.0.0.1: body, headers, retries, giving up."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import structlog
from prometheus_client import CollectorRegistry

from tether_approval.bootstrap import build_deps
from tether_approval.notifier import (
    ApprovalNotification,
    NotificationFailed,
    UnusableWebhookUrl,
    WebhookNotifier,
    webhook_origin,
)
from tether_approval.settings import ApprovalSettings
from tether_contracts.records import ApprovalRequested, RiskClass
from tether_runtime.logging import configure


@dataclass
class Receiver:
    statuses: list[int] = field(default_factory=list)  # replies in order; 200 once exhausted
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[tuple[str, Receiver]]:
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
            status = state.statuses.pop(0) if state.statuses else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks/approvals", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def notification() -> ApprovalNotification:
    event = ApprovalRequested(
        approval_id="apr_1", step=2, call_id="2.0", idem_key="k", tool_name="send_email",
        args_json='{"to":"[REDACTED]","body":"hi"}', args_hash="a" * 64, risk_class=RiskClass.IRREVERSIBLE,
        reasons=["RISK_CLASS", "TAINTED_EGRESS"], provenance_json='{"to":"tool:1.0"}', expires_at_ms=9_000,
        policy_version="p1", inputs_hash="b" * 64,
    )
    return ApprovalNotification.from_request(event, run_id="r1", tenant_id="t1", requested_at_ms=1_000)


def notifier(url: str, **kwargs) -> WebhookNotifier:
    sleeps: list[float] = []
    n = WebhookNotifier(url, sleep=sleeps.append, **kwargs)
    n.sleeps = sleeps  # type: ignore[attr-defined]
    return n


def test_posts_the_notification_as_json(receiver):
    url, state = receiver
    delivery = notifier(url).notify(notification())
    assert (delivery.status_code, delivery.attempts) == (200, 1)
    [(headers, body)] = state.requests
    document = json.loads(body)
    assert document == {
        "type": "tether.approval.requested", "approval_id": "apr_1", "run_id": "r1", "tenant_id": "t1", "step": 2,
        "call_id": "2.0", "tool_name": "send_email", "args": {"to": "[REDACTED]", "body": "hi"},
        "args_hash": "a" * 64, "risk_class": "IRREVERSIBLE", "reasons": ["RISK_CLASS", "TAINTED_EGRESS"],
        "provenance": {"to": "tool:1.0"}, "expires_at_ms": 9_000, "requested_at_ms": 1_000, "policy_version": "p1",
    }
    assert headers["content-type"] == "application/json"
    assert headers["idempotency-key"] == "apr_1"
    assert "x-tether-signature" not in headers


def test_signs_the_body_when_a_secret_is_set(receiver):
    url, state = receiver
    notifier(url, secret="s3cret").notify(notification())
    [(headers, body)] = state.requests
    expected = hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
    assert headers["x-tether-signature"] == f"sha256={expected}"


def test_retries_overload_and_server_errors_then_delivers(receiver):
    url, state = receiver
    state.statuses = [503, 429, 500]
    n = notifier(url, max_attempts=4, backoff_s=0.01)
    delivery = n.notify(notification())
    assert (delivery.status_code, delivery.attempts) == (200, 4)
    assert len(state.requests) == 4
    assert len(n.sleeps) == 3
    assert len({body for _, body in state.requests}) == 1  # the same body every time


def test_gives_up_after_the_attempts(receiver):
    url, state = receiver
    state.statuses = [502] * 10
    with pytest.raises(NotificationFailed) as failed:
        notifier(url, max_attempts=3, backoff_s=0.01).notify(notification())
    assert failed.value.attempts == 3
    assert len(state.requests) == 3
    assert "HTTP 502" in str(failed.value)


def test_a_refusal_is_not_retried(receiver):
    url, state = receiver
    state.statuses = [400]
    with pytest.raises(NotificationFailed) as failed:
        notifier(url, max_attempts=4).notify(notification())
    assert failed.value.attempts == 1
    assert len(state.requests) == 1


def test_unreachable_receiver_is_retried_then_fails():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = notifier(f"http://127.0.0.1:{port}/", max_attempts=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(NotificationFailed) as failed:
        n.notify(notification())
    assert failed.value.attempts == 2
    assert "ConnectError" in str(failed.value)


def test_arguments_that_are_not_json_are_sent_as_text():
    event = ApprovalRequested(
        approval_id="apr_1", step=1, call_id="1.0", idem_key="k", tool_name="t", args_json="{truncated",
        args_hash="a" * 64, risk_class=RiskClass.WRITE, reasons=[], expires_at_ms=1, policy_version="p",
        inputs_hash="b" * 64,
    )
    sent = ApprovalNotification.from_request(event, run_id="r1", tenant_id="t1", requested_at_ms=0)
    assert json.loads(sent.body())["args"] == "{truncated"
    assert json.loads(sent.body())["provenance"] == {}


# -- the URL is a credential -------------------------------------------------------------------------

TEAMS_PATH = ("/webhookb2/3f1c2a9e-7b4d-4c1e-9a8f-2d6e5b7c9a01@8e2f4d6a-1c3b-4e5f-9a7b-6c8d0e2f4a6b"
              "/IncomingWebhook/7c4e9b2a1d3f5e6a8b0c2d4e6f8a0b1c/5a7c9e1b-3d5f-4a6c-8e0b-2d4f6a8c0e1f")
HOOK_PATH = "/hook/" + "9e107d9d372bb6826bd81d3542a419d6e4c1f2a3"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """A test may configure logging for real (to its captured stderr): put the configuration
    back after it, as later tests' stderr is not that one."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        structlog.configure(**saved)
        root.handlers[:] = handlers
        root.setLevel(level)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path", [TEAMS_PATH, HOOK_PATH], ids=["teams", "hex-hook"])
def test_a_failed_delivery_logs_only_the_scheme_and_host_of_the_url(path, make_harness, monkeypatch,
                                                                     restore_logging, capsys):
    configure("approval", "DEBUG")  # the service's JSON logs and redactor; httpx logs each request's URL at DEBUG
    port = closed_port()
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_URL", f"http://127.0.0.1:{port}{path}")
    monkeypatch.setenv("TETHER_APPROVAL_WEBHOOK_MAX_ATTEMPTS", "1")
    settings = ApprovalSettings()
    assert path not in repr(settings)
    h = make_harness(notifier=build_deps(settings, registry=CollectorRegistry()).notifier)
    h.requested()
    assert h.driver.run_work() == []
    assert h.webhook("failed") == 1
    err = capsys.readouterr().err
    [failed] = [json.loads(line) for line in err.splitlines() if '"approval_webhook_failed"' in line]
    assert f"webhook http://127.0.0.1:{port} failed: ConnectError" in failed["error"]
    for secret in (path, path.rsplit("/", 1)[-1], path.split("/")[2]):
        assert secret not in err


def test_the_failure_names_the_origin_only_even_without_the_redactor():
    url = f"https://127.0.0.1:{closed_port()}{TEAMS_PATH}?token=abcdef0123456789"
    n = notifier(url, max_attempts=1, timeout_s=2)
    with pytest.raises(NotificationFailed) as failed:
        n.notify(notification())
    assert "IncomingWebhook" not in str(failed.value) and "token" not in str(failed.value)
    assert n.origin == url.split("/webhookb2")[0]


@pytest.mark.parametrize("url,origin", [
    ("https://acme.webhook.office.com/webhookb2/x", "https://acme.webhook.office.com"),
    ("http://user:pw@[::1]:8080/hook?token=t", "http://[::1]:8080"),
])
def test_webhook_origin(url, origin):
    assert webhook_origin(url) == origin


@pytest.mark.parametrize("url", ["ftp://host/secret-path", "/relative/secret-path", "http:///secret-path",
                                 "http://host:notaport/secret-path"])
def test_an_unusable_url_is_refused_at_start_up_without_repeating_it(url):
    with pytest.raises(UnusableWebhookUrl) as refused:
        WebhookNotifier(url)
    assert "secret-path" not in str(refused.value)
