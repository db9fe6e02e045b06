"""Row writes the projection produces: keyed upserts that set columns, so applying them twice is harmless."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: Key columns of every read-model table (the PostgreSQL primary keys).
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id",),
    "events": ("run_id", "seq"),
    "steps": ("run_id", "step"),
    "tool_calls": ("run_id", "call_id"),
    "approvals": ("approval_id",),
}

#: Columns every write of a table must carry besides the key: PostgreSQL checks NOT NULL on the
#: proposed row before ON CONFLICT resolves to an update, so even a partial upsert needs them.
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("tenant_id", "status", "created_at_ms", "updated_at_ms", "last_seq", "last_hash", "state"),
    "events": ("tenant_id", "event_id", "event_type", "recorded_at_ms", "producer", "payload", "hash", "prev_hash"),
    "steps": ("tenant_id",),
    "tool_calls": ("tenant_id", "step"),
    "approvals": ("tenant_id",),
}


@dataclass(frozen=True)
class Json:
    """A value stored as JSON (PostgreSQL jsonb): dicts, lists, strings, numbers, booleans, None."""

    value: Any


@dataclass(frozen=True)
class Upsert:
    """Create the row `key` if absent and set `values` on it.

    With `only_insert`, an existing row is left untouched (the events table: a log entry never
    changes). Columns not named keep their value (or their default on a new row), so several
    partial upserts of one row compose in order.
    """

    table: str
    key: tuple[Any, ...]
    values: Mapping[str, Any]
    only_insert: bool = False

    def __post_init__(self) -> None:
        if self.table not in TABLE_KEYS:
            raise ValueError(f"unknown read-model table {self.table!r}")
        if len(self.key) != len(TABLE_KEYS[self.table]):
            raise ValueError(f"{self.table} key needs {TABLE_KEYS[self.table]}, got {self.key!r}")
        missing = [c for c in REQUIRED_COLUMNS[self.table] if c not in self.values]
        if missing:
            raise ValueError(f"{self.table} write lacks required columns {missing}")

    def row(self) -> dict[str, Any]:
        """Key columns and values as one mapping."""
        return {**dict(zip(TABLE_KEYS[self.table], self.key, strict=True)), **self.values}


def merge(writes: Iterable[Upsert]) -> list[Upsert]:
    """Collapse writes to the same row into one, later values winning, first-seen order kept.

    Applying the merged list leaves exactly the rows that applying `writes` one by one leaves,
    because every write only sets columns (no increments in SQL): this lets a batch of events
    go to the database in a few statements.
    """
    merged: dict[tuple[str, tuple[Any, ...]], Upsert] = {}
    for w in writes:
        k = (w.table, w.key)
        prev = merged.get(k)
        if prev is None:
            merged[k] = w
        elif prev.only_insert != w.only_insert:
            # Not expressible as one statement; the projection never mixes them on a table.
            raise ValueError(f"{w.table} row {w.key!r} written both insert-only and as an upsert")
        elif w.only_insert:
            continue  # the first insert wins; later inserts of the same log entry are no-ops
        else:
            merged[k] = Upsert(w.table, w.key, {**prev.values, **w.values}, only_insert=False)
    return list(merged.values())
