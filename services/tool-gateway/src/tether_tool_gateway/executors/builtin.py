"""Executor for executor_kind 'builtin': http_get, kv_put, kv_get, send_email (see builtin_tools)."""

from __future__ import annotations

import contextlib
import email.policy
import functools
import json
import re
import smtplib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from email.message import EmailMessage
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from tether_security import SecretNotFound, SecretTooShort
from tether_tool_gateway.builtin_tools import HTTP_GET, KV_GET, KV_PUT, SEND_EMAIL
from tether_tool_gateway.domain.errors import EgressDenied, InvalidToolResult, ToolError
from tether_tool_gateway.executors.http_deadline import call_deadline, deadline_transport, lookup_addresses
from tether_tool_gateway.ports import ExecutionRequest, SecretProvider

MAX_REDIRECTS = 5

Builtin = Callable[[ExecutionRequest, dict[str, Any], SecretProvider], Any]

_HANDLE = re.compile(r"secret://[A-Za-z0-9._/-]+")


def _config(request: ExecutionRequest) -> dict[str, Any]:
    try:
        config = json.loads(request.tool.executor_config_json)
    except json.JSONDecodeError as exc:
        raise ToolError("EXECUTOR_UNAVAILABLE", f"executor_config_json is not JSON: {exc.msg}") from exc
    if not isinstance(config, dict):
        raise ToolError("EXECUTOR_UNAVAILABLE", "executor_config_json must be a JSON object")
    return config


def _require(config: dict[str, Any], name: str) -> Any:
    if name not in config:
        raise ToolError("EXECUTOR_UNAVAILABLE", f"executor config has no {name!r}")
    return config[name]


T = TypeVar("T")


def _built_once(factory: Callable[[], T]) -> Callable[[], T]:
    """`factory`'s result, made once per process and shared. Under a lock: the first calls arrive
    together from every execution thread, and functools.cache alone may run the factory twice."""
    cached = functools.cache(factory)
    lock = threading.Lock()

    def get() -> T:
        with lock:
            return cached()

    return get


@_built_once
def _tls() -> ssl.SSLContext:
    """One TLS context for every call of this process (the same settings httpx builds by default).

    httpx builds a fresh context (loading the CA bundle) for every client, i.e. for every call made
    with `httpx.get`/`httpx.put` or a per-call Client: tens of milliseconds of CPU per tool call,
    even for plain-http URLs. Under load that was 73% of the gateway's CPU (py-spy, make bench)."""
    return httpx.create_ssl_context(trust_env=False)


@_built_once
def _kv_client() -> httpx.Client:
    """One client (one connection pool) for every KV call of this process.

    The KV store is the operator's configured endpoint, not a URL from the model, so its calls may
    share kept-alive connections: a client per call (`httpx.get`/`httpx.put`) built a transport and
    a connection per call, ≈ 20% of the gateway's CPU under load (py-spy, make bench). Nothing else
    is shared between calls: the cookie jar refuses every cookie, there is no auth on the client,
    and each call passes its own timeout, headers and deadline (`call_deadline`). httpx clients may
    be shared between threads.
    """
    return httpx.Client(trust_env=False, transport=deadline_transport(_tls()), follow_redirects=False,
                        cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])))


def _timeout(request: ExecutionRequest) -> httpx.Timeout:
    return httpx.Timeout(request.timeout_s)


#: httpx failures after the request may have left and before its answer came: it may have taken
#: effect. The others (connect and pool timeouts, connect errors, a bad URL) come before anything is sent.
ANSWER_LOST = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def http_transport_error(exc: httpx.HTTPError, what: str = "") -> ToolError:
    """TIMEOUT or TOOL_ERROR (retryable) for an httpx failure, saying whether the request may have
    taken effect (`ToolError.effect_unknown`: what makes a non-idempotent call's outcome unknown)."""
    code = "TIMEOUT" if isinstance(exc, httpx.TimeoutException) else "TOOL_ERROR"
    detail = what or f"{type(exc).__name__}: {exc}"
    return ToolError(code, detail, retryable=True,
                     effect_unknown=isinstance(exc, ANSWER_LOST))


def _headers(config: dict[str, Any], secrets: SecretProvider) -> dict[str, str]:
    """The config's headers with `secret://name` handles replaced by the values, resolved now.

    The values exist only in this request: never in the tool's config, the arguments the model
    wrote, or the result (the registry teaches the redactor each value it resolves)."""
    headers = config.get("headers", {})
    if not isinstance(headers, dict):
        raise ToolError("EXECUTOR_UNAVAILABLE", "executor config 'headers' must be an object")
    return resolve_secret_handles(headers, secrets)


def resolve_secret_handles(values: dict[str, Any], secrets: SecretProvider) -> dict[str, str]:
    """`values` with every `secret://name` handle inside them replaced by the secret's value, resolved now."""

    def value(match: re.Match[str]) -> str:
        try:
            return secrets.resolve(match.group(0))
        except SecretTooShort as exc:
            # Its message names the handle and the minimum length, never the value.
            raise ToolError("EXECUTOR_UNAVAILABLE", str(exc)) from None
        except SecretNotFound:
            raise ToolError("EXECUTOR_UNAVAILABLE", f"secret {match.group(0)!r} is not configured") from None

    return {str(k): _HANDLE.sub(value, str(v)) for k, v in values.items()}


# -- http_get ----------------------------------------------------------------------------------
def http_get(request: ExecutionRequest, config: dict[str, Any], secrets: SecretProvider) -> dict[str, Any]:
    """GET `url` if its host is allowlisted; follow redirects only within the same host; cap the body.
    Config `headers` may reference secrets by handle; they are sent to the allowlisted origin only."""
    allow = {h.lower() for h in config.get("allow_hosts", [])}
    max_body = int(config.get("max_body_bytes", 1024 * 1024))
    try:
        url = httpx.URL(request.args["url"])
    except (httpx.InvalidURL, TypeError) as exc:
        raise ToolError("TOOL_ERROR", f"invalid url: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise ToolError("TOOL_ERROR", "only absolute http(s) URLs can be fetched")
    if url.host.lower() not in allow:
        raise EgressDenied(url.host)
    origin = (url.scheme, url.host.lower(), url.port)
    headers = _headers(config, secrets)
    deadline = time.monotonic() + request.timeout_s
    with call_deadline(deadline), httpx.Client(timeout=_timeout(request), follow_redirects=False, trust_env=False,
                                               transport=deadline_transport(_tls()), headers=headers) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                with client.stream("GET", url) as response:
                    location = response.headers.get("location")
                    if response.is_redirect and location:
                        target = url.join(location)
                        if (target.scheme, (target.host or "").lower(), target.port) != origin:
                            return _page(url, response, b"", False, redirect_not_followed=str(target))
                        url = target
                        continue
                    body, truncated = _read_capped(response, max_body, deadline)
                    return _page(url, response, body, truncated)
            except httpx.HTTPError as exc:
                raise http_transport_error(exc) from exc
    raise ToolError("TOOL_ERROR", f"more than {MAX_REDIRECTS} redirects")


def body_chunks(response: httpx.Response, deadline: float, what: str) -> Iterator[bytes]:
    """The response body's chunks as they arrive; TIMEOUT once time.monotonic() passes `deadline`:
    httpx's read timeout is per chunk, so a server dripping bytes would otherwise hold the
    execution thread for as long as it likes. `what` names the body in the error."""
    for chunk in response.iter_bytes():
        if time.monotonic() > deadline:
            response.close()
            raise ToolError("TIMEOUT", f"{what} did not arrive in time (the server was still sending)",
                            retryable=True)
        yield chunk


def _read_capped(response: httpx.Response, max_body: int, deadline: float) -> tuple[bytes, bool]:
    """The body up to `max_body` bytes (and whether it was cut), by `deadline` (`body_chunks`)."""
    chunks: list[bytes] = []
    size = 0
    for chunk in body_chunks(response, deadline, "the page"):
        chunks.append(chunk)
        size += len(chunk)
        if size > max_body:
            return b"".join(chunks)[:max_body], True
    return b"".join(chunks), False


def _page(url: httpx.URL, response: httpx.Response, body: bytes, truncated: bool,
          redirect_not_followed: str | None = None) -> dict[str, Any]:
    page: dict[str, Any] = {
        "url": str(url),
        "status": response.status_code,
        "content_type": response.headers.get("content-type", ""),
        "body": body.decode(response.encoding or "utf-8", errors="replace"),
        "truncated": truncated,
    }
    if redirect_not_followed is not None:
        page["redirect_not_followed"] = redirect_not_followed
    return page


# -- kv ----------------------------------------------------------------------------------------
def _kv_url(config: dict[str, Any], request: ExecutionRequest) -> str:
    """The key's URL in the tenant's own part of the store: every tenant's calls go to one kv_url, and
    a value one tenant's run wrote (perhaps injected text) must never reach another's as trusted content."""
    tenant = request.tenant_id
    if not tenant or "/" in tenant:  # tenant ids are [a-z][a-z0-9-]*: nothing to confuse with a key's path
        raise ToolError("EXECUTOR_UNAVAILABLE", f"no KV namespace for tenant id {tenant!r}")
    key = f"{tenant}/{request.args['key']}"
    return f"{str(_require(config, 'base_url')).rstrip('/')}/kv/{quote(key, safe='')}"


def _json_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidToolResult(f"the KV store answered {response.status_code} with a body that is not JSON") from exc


def _kv_error(response: httpx.Response) -> ToolError:
    retryable = response.status_code >= 500
    return ToolError("TOOL_ERROR", f"the KV store answered HTTP {response.status_code}", retryable=retryable)


def kv_put(request: ExecutionRequest, config: dict[str, Any], secrets: SecretProvider) -> dict[str, Any]:
    """PUT the value, with the call's idem_key as Idempotency-Key so a re-run is applied once."""
    key = request.args["key"]
    try:
        with call_deadline(time.monotonic() + request.timeout_s):
            response = _kv_client().put(_kv_url(config, request), json={"value": request.args["value"]},
                                        headers={"Idempotency-Key": request.idem_key}, timeout=_timeout(request))
    except httpx.HTTPError as exc:
        raise http_transport_error(exc) from exc
    if response.status_code != 200:
        raise _kv_error(response)
    body = _json_body(response)
    if not isinstance(body, dict) or "version" not in body:
        raise InvalidToolResult("the KV store's answer has no version")
    return {"key": key, "version": body["version"],
            "deduplicated": response.headers.get("idempotent-replayed") == "true"}


def kv_get(request: ExecutionRequest, config: dict[str, Any], secrets: SecretProvider) -> dict[str, Any]:
    key = request.args["key"]
    try:
        with call_deadline(time.monotonic() + request.timeout_s):
            response = _kv_client().get(_kv_url(config, request), timeout=_timeout(request))
    except httpx.HTTPError as exc:
        raise http_transport_error(exc) from exc
    if response.status_code == 404:
        return {"key": key, "found": False}
    if response.status_code != 200:
        raise _kv_error(response)
    body = _json_body(response)
    if not isinstance(body, dict) or "value" not in body:
        raise InvalidToolResult("the KV store's answer has no value")
    return {"key": key, "found": True, "value": body["value"], "version": body.get("version")}


# -- send_email --------------------------------------------------------------------------------
class _DeadlineSMTP(smtplib.SMTP):
    """An SMTP client whose whole conversation (connect, greeting, every command) ends at `deadline`,
    a time.monotonic() value.

    smtplib's timeout bounds each socket operation, and getreply() reads a reply's continuation lines
    ("220-…") for as long as they come: a server sending one every few seconds would hold the execution
    thread without end, and the message could go out after the call was recorded as TIMEOUT. At the
    deadline a timer shuts the socket down, which wakes a read or write blocked on it (closing it would
    not); a socket connected after the deadline is shut down before anything is read or sent on it."""

    def __init__(self, deadline: float) -> None:
        super().__init__(timeout=max(deadline - time.monotonic(), 0.001))
        self._deadline = deadline
        self._lock = threading.Lock()
        self._expired = False
        self._live: socket.socket | None = None
        self._timer = threading.Timer(max(deadline - time.monotonic(), 0.0), self._expire)
        self._timer.daemon = True
        self._timer.start()

    data_sent = False  # whether DATA was issued: from then on the server may accept the message

    def data(self, msg):  # type: ignore[no-untyped-def]  # smtplib's signature
        self.data_sent = True
        return super().data(msg)

    @property
    def expired(self) -> bool:
        """Whether the deadline passed (the conversation was, or will be, cut)."""
        return self._expired or time.monotonic() >= self._deadline

    def _get_socket(self, host: str, port: int, timeout: float | None) -> socket.socket:
        # smtplib's own hook (SMTP_SSL and LMTP override it too): the socket, before the greeting is read.
        sock = self._connect(host, port, timeout)
        with self._lock:
            self._live = sock
            if self._expired:  # the lookup or the connect outlasted the deadline
                _shut(sock)
        return sock

    def _connect(self, host: str, port: int, timeout: float | None) -> socket.socket:
        """What smtplib's socket.create_connection does, with the relay's name lookup bounded by the
        deadline (getaddrinfo takes no timeout: a DNS server that does not answer would hold the
        execution thread as long as the system resolver waits) and each address given the time left."""
        error: OSError = OSError(f"{host!r} has no address")
        for address in lookup_addresses(host, port, self._left(timeout)):
            try:
                return socket.create_connection((address, port), self._left(timeout), self.source_address)
            except OSError as exc:  # TimeoutError included: the next address gets what is left
                error = exc
        raise error

    def _left(self, timeout: float | None) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the tool call's deadline passed")
        return left if timeout is None else min(timeout, left)

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            if self._live is not None:
                _shut(self._live)

    def disarm(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed or reset
        sock.shutdown(socket.SHUT_RDWR)


def send_email(request: ExecutionRequest, config: dict[str, Any], secrets: SecretProvider) -> dict[str, Any]:
    """Send one plain-text message. The idem_key goes in Message-ID and X-Idempotency-Key so a
    receiving system could deduplicate, but SMTP itself cannot: the tool is not idempotent.
    The whole SMTP conversation ends at the call's deadline (`_DeadlineSMTP`) → TIMEOUT."""
    # Long unbroken header values (the 64-hex idem_key) must not be folded mid-value.
    msg = EmailMessage(policy=email.policy.default.clone(max_line_length=998))
    msg["From"] = _require(config, "from_addr")
    msg["To"] = request.args["to"]
    msg["Subject"] = request.args["subject"]
    msg["Message-ID"] = f"<{request.idem_key}@tether.invalid>"
    msg["X-Idempotency-Key"] = request.idem_key
    msg.set_content(request.args["body"])
    host, port = _require(config, "smtp_host"), int(_require(config, "smtp_port"))
    smtp = _DeadlineSMTP(time.monotonic() + request.timeout_s)
    try:
        with smtp:
            code, greeting = smtp.connect(host, port)
            if code != 220:
                raise smtplib.SMTPConnectError(code, greeting)
            refused = smtp.send_message(msg)
    except (smtplib.SMTPException, OSError) as exc:  # TimeoutError and the SMTP errors are OSErrors
        # Once DATA went out the server may have taken the message, unless it answered with an
        # error (SMTPResponseException: a reply, so a definite refusal): a cut or silent connection
        # then leaves the outcome unknown. Before DATA nothing can have been sent.
        unknown = smtp.data_sent and not isinstance(exc, smtplib.SMTPResponseException)
        if smtp.expired or isinstance(exc, TimeoutError):
            # Not retryable: the tool is not idempotent.
            raise ToolError("TIMEOUT", f"SMTP did not finish within the tool's {request.tool.timeout_ms} ms "
                                       f"({type(exc).__name__}: {exc})", effect_unknown=unknown) from exc
        raise ToolError("TOOL_ERROR", f"SMTP failed: {type(exc).__name__}: {exc}", effect_unknown=unknown) from exc
    finally:
        smtp.disarm()
    if refused:
        raise ToolError("TOOL_ERROR", f"recipients refused: {sorted(refused)}")
    return {"to": request.args["to"], "message_id": msg["Message-ID"], "sent": True}


BUILTINS: dict[str, Builtin] = {HTTP_GET: http_get, KV_PUT: kv_put, KV_GET: kv_get, SEND_EMAIL: send_email}


class BuiltinExecutor:
    """Runs the built-in tools; the tool's executor config names which one ("builtin")."""

    def __init__(self, builtins: dict[str, Builtin] | None = None) -> None:
        self._builtins = dict(BUILTINS if builtins is None else builtins)

    def execute(self, request: ExecutionRequest, secrets: SecretProvider) -> Any:
        config = _config(request)
        name = config.get("builtin", request.tool.name)
        fn = self._builtins.get(name)
        if fn is None:
            raise ToolError("EXECUTOR_UNAVAILABLE", f"no built-in tool named {name!r}")
        return fn(request, config, secrets)
