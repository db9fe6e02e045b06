"""The webhook adapter against a local HTTP receiver on 127.0.0.1: body, headers, retries, giving up."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tether_approval.notifier import ApprovalNotification, NotificationFailed, WebhookNotifier
from tether_contracts.records import ApprovalRequested, RiskClass


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
