"""Sync httpx calls bounded by a deadline in every network operation: connect, TLS, every write and every read.

httpx's timeouts bound each socket operation, not the call: a server that drips its headers or
body one byte a second never trips the read timeout, and a read that starts just before the
deadline may still wait a whole read timeout. Sync httpx has no total timeout (encode/httpx#1450:
"the implementation would be in httpcore"), and a timer thread closing the socket does not wake a
read blocked in poll() on Linux. So the bound sits where every read, write and connect passes: an
httpcore network backend (httpcore's public extension point) whose every operation gets
min(its configured timeout, time left until the deadline) and fails with httpcore's own
ReadTimeout/WriteTimeout/ConnectTimeout once none is left. httpx maps these to its
TimeoutException; httpcore closes the connection on the error, so a pooled connection is never
reused half-read.

The deadline is a context variable set around a call (`network_deadline`), not a property of the
client, so one pooled client bounds each call by its own. A request through a proxy taken from the
environment (HTTP(S)_PROXY, with trust_env) does not pass this backend. Used by the tool gateway's
executors (executors/http_deadline.py, which also bounds the host-name lookup) and the planner's
model providers (providers/deadline.py).
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx


@dataclass
class Deadline:
    """A call's deadline (a time.monotonic() value), what it is the deadline of (named in the timeout
    error, e.g. "the tool call"), and whether it, not a configured timeout, bounded the last network
    operation (so a timeout then is the deadline's, not the server's)."""

    at: float
    what: str = "the call"
    cut: bool = False


_DEADLINE: ContextVar[Deadline | None] = ContextVar("tether_network_deadline", default=None)


@contextlib.contextmanager
def network_deadline(at: float, what: str = "the call") -> Iterator[Deadline]:
    """Bound every network operation of the HTTP calls made in this block (through a
    `deadline_transport`) by `at`, a time.monotonic() value. Reading a streamed response's body
    belongs inside the block too."""
    deadline = Deadline(at, what)
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def bounded(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    """min(`timeout`, time left until the enclosing deadline), or `timeout` outside one; raises
    `expired` when no time is left."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline.at - time.monotonic()
    if left <= 0:
        deadline.cut = True
        raise expired(f"{deadline.what}'s deadline passed")
    deadline.cut = timeout is None or left < timeout
    return left if deadline.cut else timeout


class DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every read, write and TLS handshake is bounded by the deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return DeadlineStream(self._inner.start_tls(ssl_context, server_hostname,
                                                    bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


#: Looks up a host's addresses for a connect, within min(timeout, time left): (host, port, timeout) -> addresses,
#: raising httpcore.ConnectTimeout or ConnectError.
Resolver = Callable[[str, int, float | None], list[str]]


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's SyncBackend with connect, TLS, every read and every write bounded by the deadline.

    Given `resolve`, the host name is looked up with it and each address it returns is tried with
    the time left (what socket.create_connection does, whose own lookup has no timeout); without,
    the lookup is left to the system resolver."""

    def __init__(self, resolve: Resolver | None = None) -> None:
        self._inner = httpcore.SyncBackend()
        self._resolve = resolve

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        if self._resolve is None:
            return DeadlineStream(self._inner.connect_tcp(host, port, bounded(timeout, httpcore.ConnectTimeout),
                                                          local_address, socket_options))
        error: httpcore.ConnectError | httpcore.ConnectTimeout = httpcore.ConnectError(f"{host!r} has no address")
        for address in self._resolve(host, port, timeout):
            try:
                # An address literal: create_connection's own lookup of it is answered without DNS.
                stream = self._inner.connect_tcp(address, port, bounded(timeout, httpcore.ConnectTimeout),
                                                 local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
                continue
            return DeadlineStream(stream)
        raise error

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return DeadlineStream(self._inner.connect_unix_socket(path, bounded(timeout, httpcore.ConnectTimeout),
                                                              socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def deadline_transport(*, limits: httpx.Limits, ssl_context: ssl.SSLContext | None = None, trust_env: bool = True,
                       backend: httpcore.NetworkBackend | None = None) -> httpx.HTTPTransport:
    """httpx's own transport, its network operations bounded by the enclosing `network_deadline`
    (through `backend`, by default a DeadlineBackend leaving lookups to the system resolver).

    Raises RuntimeError when this httpx keeps its pool elsewhere: every call would silently lose
    its deadline, so the caller refuses to start instead."""
    ssl_context = ssl_context if ssl_context is not None else httpx.create_ssl_context(trust_env=trust_env)
    transport = httpx.HTTPTransport(verify=ssl_context, trust_env=trust_env, limits=limits)
    # httpx does not take a network backend (encode/httpx#3749), so its pool is built again, as
    # httpx builds it, with ours. `_pool` is private: if an httpx release renames it, assigning it
    # would add an attribute nobody reads.
    if not isinstance(getattr(transport, "_pool", None), httpcore.ConnectionPool):
        raise RuntimeError(f"httpx {httpx.__version__}: HTTPTransport keeps no httpcore.ConnectionPool in `_pool`; "
                           "the network deadline cannot be installed (tether_runtime.deadline)")
    transport._pool = httpcore.ConnectionPool(
        ssl_context=ssl_context, max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        network_backend=backend if backend is not None else DeadlineBackend())
    return transport
