"""A model call attempt's deadline (CALL_TIMEOUT_S) applied to every socket operation, not only between reads.

httpx's read timeout bounds each read: checked between reads, an attempt could overrun its
deadline by a whole read timeout (a provider that goes quiet just before it). Sync httpx has no
total timeout, and it reads a response body's timeout once per body, so the bound sits where every
read, write and connect passes: an httpcore network backend (httpcore's public extension point)
whose every operation gets min(its configured timeout, time left until the attempt's deadline) and
fails with httpcore's own timeout once none is left. The same technique as the tool gateway's
executors/http_deadline.py (which also bounds the host-name lookup; a provider's base URL is
configured, so the planner leaves the lookup to the system resolver).

The deadline is a context variable set around one attempt (`attempt_deadline`), so one pooled
client bounds each attempt by its own. A request through a proxy taken from the environment
(HTTP(S)_PROXY) does not pass this backend; it keeps the between-reads check of providers/http.py.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx


@dataclass
class Deadline:
    """An attempt's deadline (a time.monotonic() value) and whether it, not a configured timeout,
    bounded the last operation (so a timeout then is the attempt's, not the provider's)."""

    at: float
    cut: bool = False


_DEADLINE: ContextVar[Deadline | None] = ContextVar("tether_planner_attempt_deadline", default=None)


@contextlib.contextmanager
def attempt_deadline(at: float) -> Iterator[Deadline]:
    """Bound every network operation of this block's calls (through `deadline_transport`) by `at`."""
    deadline = Deadline(at)
    token = _DEADLINE.set(deadline)
    try:
        yield deadline
    finally:
        _DEADLINE.reset(token)


def _bounded(timeout: float | None, expired: type[httpcore.TimeoutException]) -> float | None:
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline.at - time.monotonic()
    if left <= 0:
        deadline.cut = True
        raise expired("the model call attempt's deadline passed")
    deadline.cut = timeout is None or left < timeout
    return left if deadline.cut else timeout


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
    """httpcore's SyncBackend with connect, TLS, every read and every write bounded by the deadline."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout),
                                                       local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._inner.connect_unix_socket(path, _bounded(timeout, httpcore.ConnectTimeout),
                                                               socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def deadline_transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    """httpx's own transport, its network operations bounded by the enclosing `attempt_deadline`."""
    transport = httpx.HTTPTransport(limits=limits)
    # httpx does not take a network backend (encode/httpx#3749), so its pool is built again, as
    # httpx builds it, with ours. `_pool` is private: if an httpx release renames it, assigning it
    # would silently drop the deadline, so the provider refuses to start instead.
    pool = getattr(transport, "_pool", None)
    if not isinstance(pool, httpcore.ConnectionPool):
        raise RuntimeError(f"httpx {httpx.__version__}: HTTPTransport keeps no httpcore.ConnectionPool in `_pool`; "
                           "the model calls' deadline cannot be installed (providers/deadline.py)")
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(), max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
        network_backend=_DeadlineBackend())
    return transport
