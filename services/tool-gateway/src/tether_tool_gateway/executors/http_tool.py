"""Executor for executor_kind 'http': a tenant's own tool service, called with an HTTP POST of the arguments.

Config (ToolSpec.executor_config_json):
  url                  the endpoint (http or https); the validated arguments are POSTed to it as JSON. Its
                       path may hold a `secret://name` handle (a webhook's token path), resolved at
                       execution time: the value only extends the path (same host, query and fragment)
  headers              extra headers; values may hold `secret://name` handles, resolved at execution time
  allow_hosts          hosts the tool may contact (default: the url's host); constraints' egress rules add none
  max_response_bytes   the response body is read as a stream and the call fails past this (default 1 MiB)
  max_attempts         attempts for an idempotent tool on a retryable failure (default 3; 1 = no retry)
  attempt_timeout_ms   cap of one attempt (default: what is left of the tool's timeout)

Every request carries the call's idem_key as `Idempotency-Key`, the same on every attempt and
after a gateway restart, so the service can apply a call once. Redirects are never followed: a
3xx answer is a tool error naming the location (the tool's URL is what the tenant registered).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential_jitter

from tether_tool_gateway.domain.errors import EgressDenied, InvalidToolResult, ToolError, head_of
from tether_tool_gateway.executors.builtin import (
    _HANDLE,
    _config,
    _headers,
    _tls,
    body_chunks,
    http_transport_error,
    resolve_secret_handles,
)
from tether_tool_gateway.executors.http_deadline import call_deadline, deadline_transport
from tether_tool_gateway.ports import ExecutionRequest, SecretProvider

DEFAULT_MAX_RESPONSE_BYTES = 1024 * 1024
DEFAULT_MAX_ATTEMPTS = 3
#: Give up (and report) a little before the gateway's own timeout for the tool fires.
_DEADLINE_MARGIN_S = 0.25


def endpoint(config: dict[str, Any], key: str = "url", secrets: SecretProvider | None = None) -> httpx.URL:
    """The configured endpoint, checked to be an absolute http(s) URL on an allowed host, with the
    `secret://` handles in its path resolved (`secret_path`)."""
    raw = config.get(key)
    if not isinstance(raw, str):
        raise ToolError("EXECUTOR_UNAVAILABLE", f"executor config has no {key!r}")
    try:
        url = httpx.URL(raw)
    except httpx.InvalidURL as exc:
        raise ToolError("EXECUTOR_UNAVAILABLE", f"executor config {key!r} is not a URL: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ToolError("EXECUTOR_UNAVAILABLE", f"executor config {key!r} must be an absolute http(s) URL")
    check_egress(url, allowed_hosts(config, url))
    if _HANDLE.search(raw):
        return secret_path(url, raw, key, secrets)
    return url


def secret_path(url: httpx.URL, raw: str, key: str, secrets: SecretProvider | None) -> httpx.URL:
    """`raw` with its path's `secret://` handles resolved: for a service that takes its credential only
    in the URL (a Slack or Discord webhook), so the registered config, and the run log it is copied
    into, hold the handle, never the value. The value may only extend the path: the resolved URL keeps
    `url`'s scheme, host, port, query and fragment and the path up to the handle, and has no '..'
    segment (a value with '?', '#' or a host of its own is refused). No error names the value."""
    parts = urlsplit(raw)
    if len(_HANDLE.findall(raw)) != len(_HANDLE.findall(parts.path)):
        raise ToolError("EXECUTOR_UNAVAILABLE", f"executor config {key!r}: a secret:// handle may stand only in "
                                                "the url's path")
    if secrets is None:
        raise ToolError("EXECUTOR_UNAVAILABLE", f"executor config {key!r} holds a secret:// handle, which this "
                                                "caller cannot resolve")
    resolved_raw = resolve_secret_handles({key: raw}, secrets)[key]
    refused = ToolError("EXECUTOR_UNAVAILABLE", f"executor config {key!r}: a secret in the url's path may only "
                                                "extend the path (no '?', '#' or '..' in its value)")
    try:
        resolved = httpx.URL(resolved_raw)
    except httpx.InvalidURL:
        raise refused from None  # its message would quote the URL, secret and all
    now = urlsplit(resolved_raw)
    prefix = parts.path[:_HANDLE.search(parts.path).start()]
    if ((now.scheme, now.netloc, now.query, now.fragment) != (parts.scheme, parts.netloc, parts.query, parts.fragment)
            or (resolved.scheme, resolved.host, resolved.port) != (url.scheme, url.host, url.port)
            or not now.path.startswith(prefix) or ".." in map(unquote, now.path.split("/"))):
        raise refused
    return resolved


def allowed_hosts(config: dict[str, Any], url: httpx.URL) -> set[str]:
    """The tool's egress allowlist: `allow_hosts` from its config, else only its endpoint's host."""
    hosts = config.get("allow_hosts")
    if hosts is None:
        return {url.host.lower()}
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise ToolError("EXECUTOR_UNAVAILABLE", "executor config 'allow_hosts' must be a list of host names")
    return {h.lower() for h in hosts}


def check_egress(url: httpx.URL, allow: Iterable[str]) -> None:
    """Raise EgressDenied unless the URL's host is on the allowlist."""
    if (url.host or "").lower() not in set(allow):
        raise EgressDenied(url.host or "")


def _read_capped(response: httpx.Response, cap: int, deadline: float) -> bytes:
    """The body, read as a stream; stops reading (and fails) as soon as it passes `cap` bytes, or
    at `deadline` (`body_chunks`)."""
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise ToolError("OVERSIZED_RESULT", f"the tool service announced {declared} bytes; the limit is {cap}")
    size = 0
    chunks: list[bytes] = []
    for chunk in body_chunks(response, deadline, "the tool service's answer"):
        size += len(chunk)
        if size > cap:
            raise ToolError("OVERSIZED_RESULT", f"the tool service sent more than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def body_unreadable(status: int, code: str, detail: str) -> dict[str, Any]:
    """The result of a non-idempotent call answered 2xx whose body could not be used (too large, not
    JSON, cut or late): the service says the effect took place, so the call completed; reported as a
    failure it would invite the model to do it again. `code` is the failure code an idempotent tool
    gets for the same body (OVERSIZED_RESULT, INVALID_RESULT, TIMEOUT, TOOL_ERROR)."""
    return {"status": status, "body": None, "body_unreadable": {"code": code, "detail": detail}}


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ToolError) and exc.retryable


class HttpToolExecutor:
    """POSTs a call's validated arguments to the tool's own service and records its JSON answer.

    Non-2xx, timeouts, oversized and non-JSON answers are `ToolError`s (TOOL_ERROR, TIMEOUT,
    OVERSIZED_RESULT, INVALID_RESULT), except that a non-idempotent tool answered 2xx completes
    whatever its body (`body_unreadable`): the effect took place. Idempotent tools are retried with exponential backoff on
    5xx/429, timeouts and connection errors, within the tool's timeout; others are tried once.
    """

    def __init__(self, *, sleep: Any = time.sleep) -> None:
        self._sleep = sleep

    def execute(self, request: ExecutionRequest, secrets: SecretProvider) -> Any:
        config = _config(request)
        url = endpoint(config, secrets=secrets)
        allow = allowed_hosts(config, url)
        cap = int(config.get("max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES))
        attempts = int(config.get("max_attempts", DEFAULT_MAX_ATTEMPTS)) if request.tool.idempotent else 1
        attempt_cap = config.get("attempt_timeout_ms")
        headers = _headers(config, secrets)
        headers["Idempotency-Key"] = request.idem_key
        deadline = time.monotonic() + max(0.1, request.timeout_s - _DEADLINE_MARGIN_S)
        body = json.dumps(request.args, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        headers["Content-Type"] = "application/json"

        def attempt() -> Any:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ToolError("TIMEOUT", f"no time left within the tool's {request.tool.timeout_ms} ms")
            timeout = min(left, attempt_cap / 1000) if attempt_cap else left
            return self._post(url, body, headers, cap, timeout, allow, time.monotonic() + timeout,
                              request.tool.idempotent)

        retrying = Retrying(
            stop=stop_after_attempt(max(1, attempts)) | stop_after_delay(max(0.0, request.timeout_s - 1)),
            wait=wait_exponential_jitter(multiplier=0.2, max=2.0, jitter=0.2),
            retry=retry_if_exception(_retryable),
            reraise=True,
            sleep=self._sleep,
        )
        return retrying(attempt)

    def _post(self, url: httpx.URL, body: bytes, headers: dict[str, str], cap: int, timeout: float,
              allow: set[str], deadline: float, idempotent: bool) -> Any:
        try:
            with call_deadline(deadline), httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False,
                                                       trust_env=False, transport=deadline_transport(_tls())) as client:
                with client.stream("POST", url, content=body, headers=headers) as response:
                    if response.is_redirect:
                        # Never followed: the registered URL is the only endpoint the tenant allowed.
                        location = response.headers.get("location", "")
                        target = (url.join(location).host or "").lower()
                        why = ("a host off the tool's egress allowlist" if target not in allow
                               else "redirects are not followed")
                        raise ToolError("TOOL_ERROR", f"the tool service redirected to {location!r}: refused "
                                                      f"({why})", retryable=False)
                    status = response.status_code
                    try:
                        data = _read_capped(response, cap, deadline)
                    except (ToolError, httpx.HTTPError) as exc:
                        if idempotent or not 200 <= status < 300:
                            raise
                        error = exc if isinstance(exc, ToolError) else http_transport_error(exc)
                        return body_unreadable(status, error.code, error.detail)
        except httpx.TimeoutException as exc:
            raise http_transport_error(exc, f"the tool service did not answer in time ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise http_transport_error(exc, f"could not reach the tool service: {type(exc).__name__}: {exc}") from exc
        if not 200 <= status < 300:
            # The body's head uncut for display: the runner redacts it whole, then shortens it.
            raise ToolError("TOOL_ERROR", f"the tool service answered HTTP {status}: {head_of(data)}",
                            retryable=status >= 500 or status == 429)
        if not data.strip():
            return {"status": status, "body": None}
        try:
            parsed = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if not idempotent:
                return body_unreadable(status, "INVALID_RESULT", f"the body is not JSON: {head_of(data, 2048)!r}")
            raise InvalidToolResult(f"the tool service answered HTTP {status} with a body that is not JSON: "
                                    f"{head_of(data)!r}") from exc
        return {"status": status, "body": parsed}
