"""HTTP calls bounded by the tool call's deadline in every phase: lookup, connect, TLS, request, headers, body.

Every connect, TLS handshake, write and read is bounded by the shared network deadline
(tether_runtime.deadline: an httpcore network backend whose every operation gets min(its
configured timeout, time left until the deadline) and fails with httpcore's own
ReadTimeout/WriteTimeout/ConnectTimeout once none is left). httpx maps these to its
TimeoutException, which the executors already report as TIMEOUT.

What the gateway adds: the host name is resolved by the backend too, and bounded the same way:
socket.getaddrinfo has no timeout (socket.create_connection, which httpcore uses, would wait for the
system resolver however long it takes, then give each address the full connect timeout), so the
lookup runs on a small pool of daemon threads and the caller stops waiting for it at the deadline
(ConnectTimeout); each address it returns is then tried with the time left. Nothing in the gateway
checks resolved addresses (the egress allowlist is of names and IP literals, docs/policy.md), so
connecting to the addresses this lookup returns is what socket.create_connection did. TLS still
verifies the URL's host name: httpcore takes server_hostname from the request's origin, not from the
address connected to.

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
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpcore
import httpx

from tether_runtime.deadline import (
    Deadline,
    DeadlineBackend,
    bounded,
    deadline_transport as _deadline_transport,
    network_deadline,
)


@contextlib.contextmanager
def call_deadline(at: float) -> Iterator[Deadline]:
    """Bound every network operation of the HTTP calls made in this block (through a
    `deadline_transport`) by `at`, a time.monotonic() value. Reading a streamed response's body
    belongs inside the block too."""
    with network_deadline(at, "the tool call") as deadline:
        yield deadline


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


def _addresses(host: str, port: int, timeout: float | None) -> list[str]:
    """The addresses of `host` as socket.getaddrinfo gives them, in its order, looked up on `_LOOKUPS`
    within min(`timeout`, time left until the deadline): ConnectTimeout past it, ConnectError when
    the name does not resolve. An IP literal is its own address (no lookup, no thread)."""
    wait = bounded(timeout, httpcore.ConnectTimeout)
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
    """httpx's own transport (no proxies from the environment), its network operations and host-name
    lookups bounded by the enclosing `call_deadline`; test_http_deadline.py fails if this stops taking
    effect. Raises RuntimeError (the gateway refuses to start) if this httpx cannot take the bound."""
    return _deadline_transport(limits=_LIMITS, ssl_context=ssl_context, trust_env=False,
                               backend=DeadlineBackend(resolve=_addresses))
