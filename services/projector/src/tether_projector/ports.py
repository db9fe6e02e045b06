"""Ports of the projector: the PostgreSQL read model and the Redis live state, behind small Protocols."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from tether_contracts.base import AvroRecord
from tether_contracts.records import Envelope
from tether_projector.domain.rows import Upsert
from tether_projector.domain.state import RunFold


@dataclass(frozen=True)
class LogEvent:
    """One decoded record of the run event log."""

    envelope: Envelope
    payload: AvroRecord


class ReadModelTx(Protocol):
    """One read-model transaction: everything written in it commits together or not at all."""

    def load_runs(self, run_ids: Sequence[str]) -> dict[str, RunFold]:
        """The stored folds of these runs (absent runs are missing from the result), held
        against concurrent projection of the same runs until the transaction ends. Each is a
        fresh object the caller owns (the batch advances it in place)."""
        ...

    def write(self, writes: Sequence[Upsert]) -> None:
        """Apply row upserts in order."""
        ...


class ReadModel(Protocol):
    """The read-model tables (runs, events, steps, tool_calls, approvals)."""

    def ensure_schema(self) -> None:
        """Create the schema and tables if missing (idempotent)."""
        ...

    def transaction(self) -> AbstractContextManager[ReadModelTx]:
        """A transaction: committed when the block exits normally, rolled back on an exception."""
        ...

    def rows(self, table: str) -> list[dict[str, Any]]:
        """Every row of a table ordered by its key (for checks, dumps and rebuild comparison)."""
        ...


@dataclass(frozen=True)
class LiveUpdate:
    """What one projected (or re-delivered) event shows live: its stream entry and the run's hot state."""

    run_id: str
    tenant_id: str
    seq: int
    #: The stream entry; empty = none (the event is not shown in this run's stream).
    entry: Mapping[str, str]
    hot: Mapping[str, str]
    #: Seq of the fold `hot` was taken from (at or after `seq`); hot state never moves backwards.
    hot_seq: int
    created_at_ms: int
    ended: bool


class LiveState(Protocol):
    """Redis: a run's hot-state hash, its live event stream and the tenant's active-run index.

    Every publish is idempotent: an entry whose seq is not above the stream's last is refused,
    a hot state older than the stored one is ignored, and so is such an update's change to the
    active-runs index and to the keys' lifetime (a late publish of an old owner after a rebalance
    must not put an ended run back into the index).
    """

    def publish(self, updates: Sequence[LiveUpdate]) -> None:
        """Publish updates in order."""
        ...


class ReadModelUnavailable(Exception):
    """PostgreSQL could not be reached or the connection broke; the transaction did not commit."""


class LiveUnavailable(Exception):
    """Redis could not be reached; the read model is already committed, live state lags."""
