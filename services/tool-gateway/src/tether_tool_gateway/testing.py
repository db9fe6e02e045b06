"""In-memory fakes of the gateway's ports, for unit tests (no sockets, controllable clock)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from tether_tool_gateway.domain.policy import RateAnswer
from tether_tool_gateway.domain.policy_document import RateLimit
from tether_tool_gateway.ledger.port import (
    UNKNOWN_DETAIL,
    Busy,
    CallRecord,
    Claim,
    Completion,
    Execute,
    IdempotencyLedger,
    Intent,
    Owner,
    Resolution,
    ResolutionStatus,
    Resolved,
    TakeoverAction,
    check_same_intent,
    takeover_action,
)


@dataclasses.dataclass
class _Row:
    record: CallRecord
    lease_expires_ms: int


class InMemoryLedger(IdempotencyLedger):
    """The idempotency ledger in a dict behind one lock; `clock_ms` is the ledger's clock."""

    def __init__(self, clock_ms: Callable[[], int] | None = None) -> None:
        self._rows: dict[str, _Row] = {}
        self._lock = threading.Lock()
        self.clock_ms = clock_ms or (lambda: int(time.time() * 1000))

    def ensure_schema(self) -> None:
        return None

    def claim(self, intent: Intent, owner: Owner, lease_ms: int) -> Claim:
        with self._lock:
            now = self.clock_ms()
            row = self._rows.get(intent.idem_key)
            if row is None:
                token = uuid.uuid4().hex
                record = CallRecord(intent, 1, owner, token, None)
                self._rows[intent.idem_key] = _Row(record, now + lease_ms)
                return Execute(record, token, 1, resumed=False)
            check_same_intent(row.record.intent, intent)
            if row.record.resolution is not None:
                return Resolved(row.record, row.record.resolution, by_this_claim=False)
            return self._take_over(row, owner, lease_ms, now, Busy(row.record))

    def _take_over(self, row: _Row, owner: Owner, lease_ms: int, now: int, busy: Claim) -> Claim:
        action = takeover_action(row.record, owner, lease_expired=row.lease_expires_ms <= now)
        if action is TakeoverAction.BUSY:
            return busy
        if action is TakeoverAction.REEXECUTE:
            token = uuid.uuid4().hex
            attempt = row.record.attempt + 1
            row.record = dataclasses.replace(row.record, attempt=attempt, lease_owner=owner, lease_token=token)
            row.lease_expires_ms = now + lease_ms
            return Execute(row.record, token, attempt, resumed=True)
        resolution = Resolution(ResolutionStatus.OUTCOME_UNKNOWN, detail=UNKNOWN_DETAIL)
        row.record = dataclasses.replace(row.record, resolution=resolution)
        return Resolved(row.record, resolution, by_this_claim=True)

    def heartbeat(self, idem_key: str, token: str, lease_ms: int) -> bool:
        with self._lock:
            row = self._rows.get(idem_key)
            if row is None or row.record.lease_token != token or row.record.resolution is not None:
                return False
            row.lease_expires_ms = self.clock_ms() + lease_ms
            return True

    def complete(self, idem_key: str, token: str, resolution: Resolution) -> Completion:
        with self._lock:
            row = self._rows.get(idem_key)
            if row is None:
                return Completion(False, None)
            if row.record.resolution is not None:
                if resolution != row.record.resolution and row.record.late_resolution is None:
                    row.record = dataclasses.replace(row.record, late_resolution=resolution)
                return Completion(False, row.record.resolution)
            if row.record.lease_token != token:
                return Completion(False, None)
            row.record = dataclasses.replace(row.record, resolution=resolution)
            return Completion(True, resolution)

    def sweep(self, owner: Owner, lease_ms: int, partitions: Sequence[int] | None = None, limit: int = 100) -> list[Claim]:
        with self._lock:
            now = self.clock_ms()
            expired = sorted(
                (r for r in self._rows.values()
                 if r.record.resolution is None and r.lease_expires_ms <= now
                 and (partitions is None or r.record.intent.partition in partitions)),
                key=lambda r: r.lease_expires_ms,
            )[:limit]
            return [self._take_over(row, owner, lease_ms, now, Busy(row.record)) for row in expired]

    def get(self, idem_key: str) -> CallRecord | None:
        with self._lock:
            row = self._rows.get(idem_key)
            return None if row is None else row.record


class InMemoryRateLimiter:
    """The RateLimiter port in a dict, with the Redis script's rules (token bucket with
    reservations, idempotent per idem_key); `clock_ms` is the limiter's clock."""

    def __init__(self, clock_ms: Callable[[], int] | None = None, *, max_wait_ms: int = 300_000) -> None:
        self.clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self.max_wait_ms = max_wait_ms
        self._buckets: dict[tuple[str, str], tuple[float, int]] = {}
        self._grants: dict[str, int] = {}
        self._lock = threading.Lock()
        #: Every acquire, for assertions: (tenant, tool, idem_key, answer).
        self.asked: list[tuple[str, str, str, RateAnswer]] = []

    def acquire(self, tenant_id: str, tool_name: str, limit: RateLimit, idem_key: str) -> RateAnswer:
        with self._lock:
            answer = self._acquire(tenant_id, tool_name, limit, idem_key)
            self.asked.append((tenant_id, tool_name, idem_key, answer))
            return answer

    def _acquire(self, tenant_id: str, tool_name: str, limit: RateLimit, idem_key: str) -> RateAnswer:
        now = self.clock_ms()
        at = self._grants.get(idem_key)
        if at is not None:
            return RateAnswer(True, 0) if at <= now else RateAnswer(False, at - now)
        rate = limit.rate_per_s / 1000
        tokens, ts = self._buckets.get((tenant_id, tool_name), (float(limit.capacity), now))
        if now > ts:
            tokens, ts = min(limit.capacity, tokens + (now - ts) * rate), now
        after = tokens - 1
        wait = math.ceil(-after / rate) if after < 0 else 0
        if wait > self.max_wait_ms:
            self._buckets[(tenant_id, tool_name)] = (tokens, ts)
            return RateAnswer(False, max(1, wait - self.max_wait_ms))
        self._buckets[(tenant_id, tool_name)] = (after, ts)
        self._grants[idem_key] = now + wait
        return RateAnswer(True, 0) if wait == 0 else RateAnswer(False, wait)
