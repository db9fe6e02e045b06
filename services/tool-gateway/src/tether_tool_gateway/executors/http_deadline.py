"""HTTP calls bounded by the tool call's deadline in every phase: connect, TLS, request, headers, body.

httpx's timeouts bound each socket operation, not the request: a server that drips its headers
or body one byte a second never trips the read timeout, and a read that starts just before the
deadline may still wait a full read timeout. Sync httpx has no total timeout (encode/httpx#1450:
"the implementation would be in httpcore"), and a timer thread closing the socket does not wake
a read blocked in poll() on Linux. So the bound sits where every read, write and connect passes:
an httpcore network backend (httpcore's public extension point) whose every operation gets
min(its configured timeout, time left until the deadline) and fails with httpcore's own
ReadTimeout/WriteTimeout/ConnectTimeout once none is left. httpx maps these to its
TimeoutException, which the executors already report as TIMEOUT; httpcore closes the connection
on the error, so a pooled connection is never reused half-read.

The deadline is a context variable set around the call (`call_deadline`), not a property of the
client, so the KV store's shared client (one pool for every call) bounds each call by its own.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_DEADLINE: ContextVar[float | None] = ContextVar("tether_tool_call_deadline", default=None)


@contextlib.contextmanager
def call_deadline(at: float) -> Iterator[None]:
    """Bound every network operation of the HTTP calls made in this block (through a
    `deadline_transport`) by `at`, a time.monotonic() value. Reading a streamed response's body
    belongs inside the block too."""
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _bounded(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    """min(`timeout`, time left until the call's deadline); raises `expired` when none is left."""
    at = _DEADLINE.get()
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise expired("the tool call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname,
                                                     _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout),
                                                       local_address, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


#: httpx's default limits (httpx.HTTPTransport's pool).
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)


def deadline_transport(ssl_context: ssl.SSLContext) -> httpx.HTTPTransport:
    """httpx's own transport (no proxies from the environment), its network operations bounded by
    the enclosing `call_deadline`."""
    transport = httpx.HTTPTransport(verify=ssl_context, trust_env=False, limits=_LIMITS)
    # httpx does not take a network backend yet (encode/httpx#3749), so its pool is built again,
    # as httpx builds it, with ours; test_http_deadline.py fails if this stops taking effect.
    transport._pool = httpcore.ConnectionPool(
        ssl_context=ssl_context, max_connections=_LIMITS.max_connections,
        max_keepalive_connections=_LIMITS.max_keepalive_connections, keepalive_expiry=_LIMITS.keepalive_expiry,
        network_backend=_DeadlineBackend())
    return transport
