"""Telling approvers that an approval waits: the port, and its adapter that POSTs a JSON webhook."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import httpx
from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_exponential, wait_random

from tether_contracts.records import ApprovalRequested

#: Statuses worth retrying: the receiver is overloaded or restarting, not refusing the request.
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
SIGNATURE_HEADER = "X-Tether-Signature"


@dataclass(frozen=True)
class ApprovalNotification:
    """What an approver is told: enough to decide, taken from the ApprovalRequested as recorded
    (arguments are the redacted ones the log holds; no secret ever reaches this point)."""

    approval_id: str
    run_id: str
    tenant_id: str
    step: int
    call_id: str
    tool_name: str
    args: Any
    args_hash: str
    risk_class: str
    reasons: list[str]
    provenance: Any
    expires_at_ms: int
    requested_at_ms: int
    policy_version: str

    @classmethod
    def from_request(
        cls, event: ApprovalRequested, *, run_id: str, tenant_id: str, requested_at_ms: int
    ) -> ApprovalNotification:
        return cls(
            approval_id=event.approval_id,
            run_id=run_id,
            tenant_id=tenant_id,
            step=event.step,
            call_id=event.call_id,
            tool_name=event.tool_name,
            args=_json_or_text(event.args_json),
            args_hash=event.args_hash,
            risk_class=event.risk_class.value,
            reasons=list(event.reasons),
            provenance=_json_or_text(event.provenance_json),
            expires_at_ms=event.expires_at_ms,
            requested_at_ms=requested_at_ms,
            policy_version=event.policy_version,
        )

    def body(self) -> bytes:
        """The webhook's JSON body (canonical, so a signature over it is reproducible)."""
        document = {"type": "tether.approval.requested", **asdict(self)}
        return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class Delivery:
    """A notification the receiver accepted."""

    status_code: int
    attempts: int


class NotificationFailed(Exception):
    """The notification could not be delivered (after retries, or refused by the receiver)."""

    def __init__(self, detail: str, attempts: int) -> None:
        super().__init__(f"{detail} (after {attempts} attempt{'s' if attempts != 1 else ''})")
        self.detail = detail
        self.attempts = attempts


class ApproverNotifier(Protocol):
    """Tells approvers about a new approval. Called off the loop thread; may block and retry.
    Best-effort: a failure is reported (NotificationFailed) but never blocks the run."""

    def notify(self, notification: ApprovalNotification) -> Delivery: ...


class _Retryable(Exception):
    pass


class UnusableWebhookUrl(ValueError):
    """The configured webhook URL is not http(s)://host/... (the message never repeats the URL)."""


def webhook_origin(url: str) -> str:
    """`scheme://host[:port]` of a webhook URL: all that an error or a log line may name of it.

    The rest is a credential: whoever holds a Teams, Slack or Discord incoming-webhook URL can
    post to that channel, and the path (or a query token) is what grants it.
    """
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise UnusableWebhookUrl("the webhook URL cannot be parsed") from None
    if parts.scheme not in ("http", "https") or not host:
        raise UnusableWebhookUrl("the webhook URL must be http(s)://host/...")
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def webhook_credentials(url: str) -> list[str]:
    """The parts of a webhook URL to register with the log redactor: the whole URL, its path
    with query and fragment, and a password in it, if any."""
    parts = urlsplit(url)
    rest = urlunsplit(("", "", parts.path, parts.query, parts.fragment))
    return [value for value in (url, rest, parts.password) if value]


class WebhookNotifier:
    """POSTs the notification as JSON to one URL, retrying transport errors and 408/429/5xx with
    exponential backoff (tenacity), bounded by attempts and total time.

    Headers: `Idempotency-Key: <approval_id>` (a crash can make the service send a notification
    again), and, with a secret, `X-Tether-Signature: sha256=<HMAC-SHA256 of the body>`.
    """

    def __init__(
        self,
        url: str,
        *,
        http: httpx.Client | None = None,
        timeout_s: float = 5.0,
        max_attempts: int = 4,
        max_seconds: float = 30.0,
        backoff_s: float = 0.5,
        secret: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.origin = webhook_origin(url)
        self._url = url
        self._http = http or httpx.Client(timeout=timeout_s)
        self._max_attempts = max_attempts
        self._max_seconds = max_seconds
        self._backoff_s = backoff_s
        self._secret = secret.encode() if secret else None
        self._sleep = sleep

    def close(self) -> None:
        self._http.close()

    def headers(self, notification: ApprovalNotification, body: bytes) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Idempotency-Key": notification.approval_id}
        if self._secret is not None:
            digest = hmac.new(self._secret, body, hashlib.sha256).hexdigest()
            headers[SIGNATURE_HEADER] = f"sha256={digest}"
        return headers

    def _post_once(self, body: bytes, headers: dict[str, str]) -> int:
        try:
            response = self._http.post(self._url, content=body, headers=headers)
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code in RETRYABLE_STATUS:
            raise _Retryable(f"HTTP {response.status_code}")
        if response.status_code >= 300:
            raise NotificationFailed(f"the receiver refused the notification: HTTP {response.status_code}", 0)
        return response.status_code

    def notify(self, notification: ApprovalNotification) -> Delivery:
        body = notification.body()
        headers = self.headers(notification, body)
        retrying = Retrying(
            stop=stop_after_attempt(self._max_attempts) | stop_after_delay(self._max_seconds),
            wait=wait_exponential(multiplier=self._backoff_s, max=10) + wait_random(0, self._backoff_s),
            retry=retry_if_exception_type(_Retryable),
            sleep=self._sleep,
        )
        attempts = 0
        try:
            for attempt in retrying:
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    status = self._post_once(body, headers)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            raise NotificationFailed(f"webhook {self.origin} failed: {last}", attempts) from last
        except NotificationFailed as exc:
            raise NotificationFailed(exc.detail, attempts) from exc
        return Delivery(status, attempts)
