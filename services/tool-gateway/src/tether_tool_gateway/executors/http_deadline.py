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

The host name is resolved by the backend too, and bounded the same way: socket.getaddrinfo has no
timeout (socket.create_connection, which httpcore uses, would wait for the system resolver however
long it takes, then give each address the full connect timeout), so the lookup runs on a small pool
of daemon threads and the caller stops waiting for it at the deadline (ConnectTimeout); each address
it returns is then tried with the time left. Nothing in the gateway checks resolved addresses (the
egress allowlist is of names and IP literals, docs/policy.md), so connecting to the addresses this
lookup returns is what socket.create_connection did. TLS still verifies the URL's host name: httpcore
takes server_hostname from the request's origin, not from the address connected to.

The deadline is a context variable set around the call (`call_deadline`), not a property of the
client, so the KV store's shared client (one pool for every call) bounds each call by its own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
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


class _Lookups:
    """Host-name lookups on a few daemon threads, so that a caller can stop waiting for one.

    Daemon threads: a lookup that never ends must not hold the process at exit (ThreadPoolExecutor's
    threads are joined then). A lookup whose caller stopped waiting before it started is skipped; one
    that started runs until the system resolver gives up, holding its thread. Threads start on first use."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        with self._lock:
            if not self._started:
                for i in range(self._threads):
                    threading.Thread(target=self._work, name=f"tool-resolve-{i}", daemon=True).start()
                self._started = True
        future: Future[Any] = Future()
        self._queue.put((future, fn))
        return future

    def _work(self) -> None:
        while True:
            future, fn = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who maps it
                future.set_exception(exc)


#: Lookups in flight at once. A lookup normally takes milliseconds; only ones stuck on an unanswering
#: DNS server stay, until the system resolver gives up (resolv.conf's timeout × attempts).
_LOOKUPS = _Lookups(threads=8)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's SyncBackend with every operation bounded by the call's deadline, the host-name lookup
    included."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        # What socket.create_connection does, with the lookup bounded and each address given the time left.
        error: httpcore.ConnectError | httpcore.ConnectTimeout = httpcore.ConnectError(f"{host!r} has no address")
        for address in _addresses(host, port, timeout):
            try:
                # An address literal: create_connection's own lookup of it is answered without DNS.
                stream = self._inner.connect_tcp(address, port, _bounded(timeout, httpcore.ConnectTimeout),
                                                 local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
                continue
            return _DeadlineStream(stream)
        raise error

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _addresses(host: str, port: int, timeout: float | None) -> list[str]:
    """The addresses of `host` as socket.getaddrinfo gives them, in its order, looked up on `_LOOKUPS`
    within min(`timeout`, time left until the deadline): ConnectTimeout past it, ConnectError when
    the name does not resolve. An IP literal is its own address (no lookup, no thread)."""
    wait = _bounded(timeout, httpcore.ConnectTimeout)
    try:
        return lookup_addresses(host, port, wait)
    except TimeoutError as exc:
        raise httpcore.ConnectTimeout(str(exc)) from None
    except OSError as exc:  # socket.gaierror: no such name, no answer
        raise httpcore.ConnectError(str(exc)) from exc


def lookup_addresses(host: str, port: int, wait: float | None) -> list[str]:
    """The addresses of `host` (socket.getaddrinfo, in its order), looked up on `_LOOKUPS` and waited
    for at most `wait` seconds: TimeoutError past it (the lookup is left to finish on its thread),
    OSError when the name does not resolve. For any client whose own connect would look the name up
    unbounded (socket.create_connection: smtplib, httpcore). An IP literal is its own address (no
    lookup, no thread)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return [host]
    # socket.getaddrinfo is looked up when called, as socket.create_connection does.
    lookup = _LOOKUPS.submit(lambda: socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
    try:
        found = lookup.result(timeout=wait)
    except TimeoutError:
        lookup.cancel()
        raise TimeoutError(f"looking up {host!r} did not finish in time") from None
    except OSError as exc:  # socket.gaierror: no such name, no answer
        raise OSError(f"looking up {host!r} failed: {exc}") from exc
    return [sockaddr[0] for *_, sockaddr in found]


#: httpx's default limits (httpx.HTTPTransport's pool).
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)


def deadline_transport(ssl_context: ssl.SSLContext) -> httpx.HTTPTransport:
    """httpx's own transport (no proxies from the environment), its network operations bounded by
    the enclosing `call_deadline`."""
    transport = httpx.HTTPTransport(verify=ssl_context, trust_env=False, limits=_LIMITS)
    # httpx does not take a network backend yet (encode/httpx#3749), so its pool is built again,
    # as httpx builds it, with ours; test_http_deadline.py fails if this stops taking effect.
    # `_pool` is private: if an httpx release renames it, assigning it would add an attribute nobody
    # reads and every call would silently lose its deadline. Refuse to build the transport instead.
    if not isinstance(getattr(transport, "_pool", None), httpcore.ConnectionPool):
        raise RuntimeError(f"httpx {httpx.__version__}: HTTPTransport keeps no httpcore.ConnectionPool in `_pool`; "
                           "the tool calls' deadline cannot be installed (executors/http_deadline.py)")
    transport._pool = httpcore.ConnectionPool(
        ssl_context=ssl_context, max_connections=_LIMITS.max_connections,
        max_keepalive_connections=_LIMITS.max_keepalive_connections, keepalive_expiry=_LIMITS.keepalive_expiry,
        network_backend=_DeadlineBackend())
    return transport
