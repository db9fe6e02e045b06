"""A model call attempt's deadline (CALL_TIMEOUT_S) applied to every socket operation, not only between reads.

httpx's read timeout bounds each read: checked between reads, an attempt could overrun its
deadline by a whole read timeout (a provider that goes quiet just before it). The bound is the
shared network deadline (tether_runtime.deadline, also the tool gateway's): an httpcore network
backend whose every connect, write and read gets min(its configured timeout, time left until the
attempt's deadline). A provider's base URL is configured, so the planner leaves the host-name
lookup to the system resolver (the gateway bounds it too).

The deadline is a context variable set around one attempt (`attempt_deadline`), so one pooled
client bounds each attempt by its own. A request through a proxy taken from the environment
(HTTP(S)_PROXY) does not pass this backend; it keeps the between-reads check of providers/http.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tether_runtime.deadline import Deadline, deadline_transport as _deadline_transport, network_deadline


@contextmanager
def attempt_deadline(at: float) -> Iterator[Deadline]:
    """Bound every network operation of this block's calls (through `deadline_transport`) by `at`;
    the Deadline's `cut` says whether it, not a configured timeout, bounded the last one."""
    with network_deadline(at, "the model call attempt") as deadline:
        yield deadline


def deadline_transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    """httpx's own transport, its network operations bounded by the enclosing `attempt_deadline`
    (raises RuntimeError, so the provider refuses to start, if this httpx cannot take the bound)."""
    return _deadline_transport(limits=limits)
