"""Weighted fair dispatch of slow work across tenants: deficit round-robin in front of the worker pool.

The loop starts work (model calls, tool executions) for every run it handles; a worker pool
fed first-in-first-out lets a tenant with a thousand runs in flight delay a tenant with one
by a thousand work items. Instead each tenant has its own FIFO line, and the lines are served
by deficit round-robin: in every round a tenant may start up to its weight in items (default
1), so a tenant waits at most one round of the other busy tenants, however long their lines
are, and a tenant of weight 3 gets three times the share of one of weight 1 while both wait.
Every item costs one unit: work items are not sized in advance.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class InvalidWeight(ValueError):
    """A tenant weight must be a positive integer."""


class DeficitRoundRobin(Generic[T]):
    """Per-tenant FIFO lines served by weighted deficit round-robin (not thread-safe).

    `push(tenant, item)` adds to the tenant's line; `pop()` returns the next item in fair
    order, or None when every line is empty.
    """

    def __init__(self, weights: Mapping[str, int] | None = None, default_weight: int = 1) -> None:
        self._weights = dict(weights or {})
        for tenant, weight in [*self._weights.items(), ("(default)", default_weight)]:
            if not isinstance(weight, int) or weight < 1:
                raise InvalidWeight(f"weight of {tenant} must be a positive integer, got {weight!r}")
        self._default = default_weight
        self._lines: dict[str, deque[T]] = {}
        self._deficit: dict[str, int] = {}
        self._active: deque[str] = deque()
        self._size = 0

    def weight(self, tenant: str) -> int:
        return self._weights.get(tenant, self._default)

    def __len__(self) -> int:
        return self._size

    def waiting(self) -> dict[str, int]:
        """Items waiting per tenant."""
        return {tenant: len(line) for tenant, line in self._lines.items()}

    def push(self, tenant: str, item: T) -> None:
        line = self._lines.get(tenant)
        if line is None:
            # A tenant that was idle joins at the back of the round with no credit saved up.
            line = self._lines[tenant] = deque()
            self._deficit[tenant] = 0
            self._active.append(tenant)
        line.append(item)
        self._size += 1

    def pop(self) -> T | None:
        if not self._active:
            return None
        tenant = self._active[0]
        if self._deficit[tenant] <= 0:
            self._deficit[tenant] += self.weight(tenant)  # the tenant's turn starts: its quantum
        line = self._lines[tenant]
        item = line.popleft()
        self._size -= 1
        self._deficit[tenant] -= 1
        if not line:
            self._active.popleft()
            del self._lines[tenant], self._deficit[tenant]
        elif self._deficit[tenant] <= 0:
            self._active.rotate(-1)  # turn used up: to the back of the round
        return item


class FairWorkQueue(Generic[T]):
    """A blocking, thread-safe `DeficitRoundRobin` for a pool of worker threads.

    Workers call `get()`, which blocks until an item is due or the queue is closed (then it
    returns None and the worker exits). `close()` drops what is still waiting.
    """

    def __init__(self, weights: Mapping[str, int] | None = None, default_weight: int = 1) -> None:
        self._drr: DeficitRoundRobin[T] = DeficitRoundRobin(weights, default_weight)
        self._cond = threading.Condition()
        self._closed = False

    def put(self, tenant: str, item: T) -> None:
        with self._cond:
            if self._closed:
                return
            self._drr.push(tenant, item)
            self._cond.notify()

    def get(self, timeout: float | None = None) -> T | None:
        """The next item in fair order; None after `close()` (or when `timeout` passes)."""
        with self._cond:
            while not self._closed and not len(self._drr):
                if not self._cond.wait(timeout):
                    return None
            if self._closed:
                return None
            return self._drr.pop()

    def close(self) -> list[T]:
        """Stop handing out items and wake every waiting worker; returns the items dropped."""
        with self._cond:
            self._closed = True
            dropped = []
            while (item := self._drr.pop()) is not None:
                dropped.append(item)
            self._cond.notify_all()
            return dropped

    def __len__(self) -> int:
        with self._cond:
            return len(self._drr)

    def waiting(self) -> dict[str, int]:
        with self._cond:
            return self._drr.waiting()
