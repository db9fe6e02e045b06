"""In-memory fakes of the gateway's ports, for unit tests (no sockets, controllable clock)."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Sequence

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
