"""Tenant limits: the catalog's totals, each partition lane's share, and the approximate admission check at the door.

The budget service keeps the authoritative per-tenant ledger on each partition lane (slots,
queue, spend, token rate: services/budget, domain/tenancy.py). It only talks to Kafka, so it
cannot answer a SubmitRun call; the door (this module) refuses early from an approximate count
— runs the read model shows queued or in progress, plus recent submits not projected yet —
and the budget settles the rare race with RunRejected(TENANT_QUEUE_FULL). docs/tenancy.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tether_contracts.records import TenantLimits
from tether_messaging.partitioner import home_partition
from tether_run_api.domain.errors import BackendUnavailable, FieldViolation, TenantQueueFull

#: The limits split over a tenant's lanes (the spend window is not a quantity: every lane has it whole).
SPLIT_LIMITS = ("max_concurrent_runs", "max_queued_runs", "spend_cap_usd_micros", "tokens_per_minute")


@dataclass(frozen=True)
class TenantPolicy:
    """A tenant's configuration in the catalog: its spread and its limits as totals (0 = no limit)."""

    spread: int = 1
    max_concurrent_runs: int = 0
    max_queued_runs: int = 0
    spend_cap_usd_micros: int = 0
    spend_window_ms: int = 0
    tokens_per_minute: int = 0

    @property
    def capacity(self) -> int | None:
        """Runs the tenant may have in the system at once (running + queued), None = unlimited."""
        if self.max_concurrent_runs <= 0:
            return None
        return self.max_concurrent_runs + max(0, self.max_queued_runs)

    def lanes(self, partitions: int) -> int:
        """How many partition lanes the tenant's runs use: its spread, at most the partition count
        and at most its smallest limit, so every lane's share is at least 1 and the shares add up
        to each total (a lane cannot hold half a run; giving it 1 would raise the tenant's cap).

        Normally the spread itself: the admin use cases refuse limits below the spread. A tenant
        stored before that check keeps its caps by using fewer lanes for its new runs.
        """
        limits = [getattr(self, name) for name in SPLIT_LIMITS if getattr(self, name) > 0]
        return max(1, min([self.spread, partitions, *limits]))


def limits_below_spread(policy: TenantPolicy) -> list[FieldViolation]:
    """A violation for every non-zero limit smaller than the spread: split over the spread's lanes,
    each lane would still hold at least 1, and the tenant would get more than the limit."""
    return [
        FieldViolation(
            name,
            f"{value} is below the tenant's spread {policy.spread}: every lane holds at least 1, so the "
            f"minimum is {policy.spread} (or 0 = no limit); lower the spread or raise the limit",
            reason="LIMIT_BELOW_SPREAD",
        )
        for name in SPLIT_LIMITS
        if 0 < (value := getattr(policy, name)) < policy.spread
    ]


def lane_share(total: int, spread: int, lane: int) -> int:
    """The part of a tenant total that lane `lane` (0-based within the spread) enforces.

    The total is split as evenly as possible, the first lanes taking the remainder; every lane
    gets at least 1 of a non-zero total (a lane with 0 would mean "no limit"), so the shares add
    up to the total only when it is at least the spread (`TenantPolicy.lanes` sees to that).
    """
    if total <= 0:
        return 0
    spread = max(1, spread)
    return max(1, total // spread + (1 if lane < total % spread else 0))


def lane_limits(policy: TenantPolicy, tenant_id: str, partition: int, partitions: int) -> TenantLimits:
    """The TenantLimits a SubmitRun to `partition` carries: this lane's share of every total.

    `partition` must be one of the tenant's `policy.lanes(partitions)` lanes (`partition_for` with that spread).
    """
    spread = policy.lanes(partitions)
    lane = (partition - home_partition(tenant_id, partitions)) % partitions
    return TenantLimits(
        max_concurrent_runs=lane_share(policy.max_concurrent_runs, spread, lane),
        max_queued_runs=lane_share(policy.max_queued_runs, spread, lane),
        spend_cap_usd_micros=lane_share(policy.spend_cap_usd_micros, spread, lane),
        spend_window_ms=max(0, policy.spend_window_ms),
        tokens_per_minute=lane_share(policy.tokens_per_minute, spread, lane),
        spread=spread,
    )


class TenantBacklog(Protocol):
    """How many of a tenant's runs are in the system and not finished (the door's gauge)."""

    def backlog(self, tenant_id: str, submitted_since_ms: int) -> int:
        """Runs of the tenant the read model shows queued or in progress, plus runs submitted at or
        after `submitted_since_ms` that the read model does not show yet. Raises BackendUnavailable."""
        ...


@dataclass
class _Count:
    value: int
    at_ms: int


class AdmissionGate:
    """Refuses a submit with TENANT_QUEUE_FULL when the tenant's backlog is at its capacity.

    The backlog is read at most every `refresh_ms` per tenant; in between, every submit let
    through is added to the cached count, so a burst is counted before the read model sees it.
    If the gauge cannot be read the submit is let through: the budget service enforces the
    limits anyway, this is only the early, synchronous answer.
    """

    def __init__(
        self,
        gauge: TenantBacklog,
        *,
        refresh_ms: int = 250,
        unprojected_window_ms: int = 60_000,
        retry_after_s: float = 2.0,
        on_unavailable: Callable[[str, Exception], None] | None = None,
    ) -> None:
        self.gauge = gauge
        self.refresh_ms = refresh_ms
        self.unprojected_window_ms = unprojected_window_ms
        self.retry_after_s = retry_after_s
        self._on_unavailable = on_unavailable
        self._counts: dict[str, _Count] = {}
        self._lock = threading.Lock()  # gRPC handlers run on a thread pool

    def admit(self, tenant_id: str, policy: TenantPolicy, now_ms: int) -> None:
        """Count one more run for the tenant, or raise TenantQueueFull."""
        capacity = policy.capacity
        if capacity is None:
            return
        with self._lock:
            count = self._counts.get(tenant_id)
            if count is None or now_ms - count.at_ms >= self.refresh_ms:
                try:
                    value = self.gauge.backlog(tenant_id, now_ms - self.unprojected_window_ms)
                except BackendUnavailable as exc:
                    if self._on_unavailable is not None:
                        self._on_unavailable(tenant_id, exc)
                    return
                count = self._counts[tenant_id] = _Count(value, now_ms)
            if count.value >= capacity:
                raise TenantQueueFull(tenant_id, count.value, capacity, self.retry_after_s)
            count.value += 1
