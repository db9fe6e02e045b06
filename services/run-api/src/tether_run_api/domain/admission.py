"""Admission backpressure: a token bucket per tenant on submits, with an explicit clock."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tether_run_api.domain.errors import RateLimited


@dataclass
class _Bucket:
    tokens: float
    at_s: float


class SubmitRateLimiter:
    """Lets each tenant submit `rate_per_s` runs per second with bursts up to `burst`.

    In-process state: with N run-api replicas a tenant gets up to N times the rate, which is
    the intended trade (no shared counter on the submit path); the budget service's tenant
    concurrency cap is the hard limit.
    """

    def __init__(self, rate_per_s: float, burst: int) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be positive and burst at least 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()  # gRPC handlers run on a thread pool

    def admit(self, tenant_id: str, now_s: float) -> None:
        """Take one token for the tenant, or raise RateLimited with the wait until the next one."""
        with self._lock:
            self._admit(tenant_id, now_s)

    def _admit(self, tenant_id: str, now_s: float) -> None:
        b = self._buckets.get(tenant_id)
        if b is None:
            b = self._buckets[tenant_id] = _Bucket(tokens=float(self.burst), at_s=now_s)
        elapsed = max(0.0, now_s - b.at_s)
        b.tokens = min(float(self.burst), b.tokens + elapsed * self.rate_per_s)
        b.at_s = now_s
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return
        raise RateLimited(tenant_id, (1.0 - b.tokens) / self.rate_per_s, self.rate_per_s)
