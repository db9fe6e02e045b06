"""The idempotency ledger port: an intent before every execution, a resolution after, leases in between.

Every tool call has one ledger row keyed by its unique idem_key. The row is written as an
*intent* (with a lease) BEFORE the tool runs, and gets exactly one *resolution* (COMPLETED,
FAILED or OUTCOME_UNKNOWN) after. Whoever holds the lease (identified by a fresh token per
claim) is the only one allowed to execute and to resolve; slow executions extend the lease
with heartbeats. An intent whose lease expired (or whose holder was this instance's previous
life) is taken over: an idempotent tool is re-run with the same idem_key, a non-idempotent one
is resolved OUTCOME_UNKNOWN without running again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from tether_contracts.records import BlobRef


class LedgerError(Exception):
    """Base of the ledger's named errors."""


class IntentMismatch(LedgerError):
    """An intent for an existing idem_key names a different tool or arguments (a protocol bug or
    tampering): the call is refused rather than executed under someone else's key."""

    def __init__(self, idem_key: str, field: str) -> None:
        super().__init__(f"idem_key {idem_key} is already recorded with a different {field}")
        self.idem_key = idem_key
        self.field = field


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: a stable instance slot and this process's incarnation (boot id)."""

    instance: str
    boot: str


@dataclass(frozen=True)
class Intent:
    """What is about to be executed; enough to re-execute it from the ledger alone."""

    idem_key: str
    run_id: str
    tenant_id: str
    partition: int
    step: int
    call_id: str
    tool_name: str
    args_json: str
    args_hash: str
    tool_spec_json: str  # the ToolSpec snapshot (Avro JSON datum), for a sweep to re-execute
    idempotent: bool


class ResolutionStatus(StrEnum):
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"


@dataclass(frozen=True)
class Resolution:
    """How a call ended. For COMPLETED, exactly one of `result_json` / `result_ref` is set."""

    status: ResolutionStatus
    result_json: str | None = None
    result_ref: BlobRef | None = None
    untrusted: bool = False
    duration_ms: int = 0
    error_code: str | None = None
    detail: str = ""
    retryable: bool = False


@dataclass(frozen=True)
class CallRecord:
    """A ledger row as read."""

    intent: Intent
    attempt: int
    lease_owner: Owner | None
    lease_token: str | None
    resolution: Resolution | None
    #: A resolution that arrived after the call had been resolved otherwise (e.g. a zombie's
    #: real result after a takeover declared OUTCOME_UNKNOWN), kept for humans and auditors.
    late_resolution: Resolution | None = None


# -- what a claim returns ----------------------------------------------------------------------
@dataclass(frozen=True)
class Execute:
    """The caller holds the lease (`token`) and must execute, then `complete` with the token."""

    record: CallRecord
    token: str
    attempt: int
    resumed: bool  # True when taking over an intent a previous claimant did not resolve


@dataclass(frozen=True)
class Resolved:
    """The call has a resolution: replay it (or, when `by_this_claim`, it was just resolved
    OUTCOME_UNKNOWN by this claim). Nothing is executed."""

    record: CallRecord
    resolution: Resolution
    by_this_claim: bool


@dataclass(frozen=True)
class Busy:
    """Another live claimant holds an unexpired lease: do not execute; look again later."""

    record: CallRecord


Claim = Execute | Resolved | Busy


@dataclass(frozen=True)
class Completion:
    """What `complete` did: `recorded` if our resolution was written; `resolution` is the
    call's resolution now (ours, or an earlier one), or None if another claimant holds it."""

    recorded: bool
    resolution: Resolution | None


class TakeoverAction(StrEnum):
    BUSY = "BUSY"
    REEXECUTE = "REEXECUTE"
    UNKNOWN = "UNKNOWN"


def takeover_action(record: CallRecord, owner: Owner, lease_expired: bool) -> TakeoverAction:
    """What a claimant may do with an unresolved intent: the one rule both adapters share."""
    held = record.lease_owner
    previous_life = held is not None and held.instance == owner.instance and held.boot != owner.boot
    if not (lease_expired or previous_life or held is None):
        return TakeoverAction.BUSY
    return TakeoverAction.REEXECUTE if record.intent.idempotent else TakeoverAction.UNKNOWN


UNKNOWN_DETAIL = (
    "the gateway recorded an intent to run this non-idempotent tool but no result "
    "(it stopped while the tool was running); the effect may or may not have happened"
)


def check_same_intent(existing: Intent, new: Intent) -> None:
    """Raise `IntentMismatch` if `new` is not the intent already recorded under its key."""
    for name in ("run_id", "tool_name", "args_hash"):
        if getattr(existing, name) != getattr(new, name):
            raise IntentMismatch(new.idem_key, name)


# -- the port ----------------------------------------------------------------------------------
class IdempotencyLedger(Protocol):
    """The idempotency ledger. Every method is atomic and safe to call from many threads and
    many gateway instances at once; leases use the ledger's own clock."""

    def ensure_schema(self) -> None:
        """Create the ledger's storage if missing (idempotent; called at start-up)."""
        ...

    def claim(self, intent: Intent, owner: Owner, lease_ms: int) -> Claim:
        """Before executing: record the intent (first time) and take its lease, or report the
        existing resolution, or that another claimant holds it, or take over an expired /
        previous-life intent (idempotent → Execute again, attempt+1; else → Resolved
        OUTCOME_UNKNOWN). Raises `IntentMismatch` if the key is recorded for another call."""
        ...

    def heartbeat(self, idem_key: str, token: str, lease_ms: int) -> bool:
        """Extend the lease held with `token`; False if it is no longer held (taken over or resolved)."""
        ...

    def complete(self, idem_key: str, token: str, resolution: Resolution) -> Completion:
        """Record the resolution if `token` still holds the lease and none is recorded yet."""
        ...

    def sweep(self, owner: Owner, lease_ms: int, partitions: Sequence[int] | None = None, limit: int = 100) -> list[Claim]:
        """Take over unresolved intents whose lease expired (in `partitions`, or all): each is
        returned as Execute (idempotent: the caller must re-run it) or Resolved(OUTCOME_UNKNOWN).
        Concurrent sweeps never return the same intent twice."""
        ...

    def get(self, idem_key: str) -> CallRecord | None:
        """The row for `idem_key`, if any."""
        ...
