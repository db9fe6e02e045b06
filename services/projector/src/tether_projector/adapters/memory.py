"""In-memory fakes of the read model and the live state, for unit tests (same semantics, no sockets)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tether_projector.domain.rows import TABLE_KEYS, Json, Upsert
from tether_projector.domain.state import RunFold
from tether_projector.ports import LiveUnavailable, LiveUpdate, ReadModelUnavailable


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Json) else value


class _MemTx:
    def __init__(self, tables: dict[str, dict[tuple[Any, ...], dict[str, Any]]]) -> None:
        self.tables = tables

    def load_runs(self, run_ids: Sequence[str]) -> dict[str, RunFold]:
        runs = self.tables["runs"]
        return {r: RunFold.model_validate(runs[(r,)]["state"]) for r in run_ids if (r,) in runs}

    def write(self, writes: Sequence[Upsert]) -> None:
        for w in writes:
            table = self.tables[w.table]
            existing = table.get(w.key)
            if existing is None:
                table[w.key] = {k: copy.deepcopy(_plain(v)) for k, v in w.row().items()}
            elif not w.only_insert:
                existing.update({k: copy.deepcopy(_plain(v)) for k, v in w.values.items()})


class InMemoryReadModel:
    """ReadModel fake: tables as dicts keyed like the PostgreSQL primary keys.

    Set `fail_next` to make the next transaction fail with `ReadModelUnavailable` before it commits.
    """

    def __init__(self) -> None:
        self.tables: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {t: {} for t in TABLE_KEYS}
        self.fail_next = 0
        self.commits = 0

    def ensure_schema(self) -> None:
        pass

    @contextmanager
    def transaction(self) -> Iterator[_MemTx]:
        staged = copy.deepcopy(self.tables)
        yield _MemTx(staged)
        if self.fail_next:
            self.fail_next -= 1
            raise ReadModelUnavailable("injected failure before commit")
        self.tables = staged
        self.commits += 1

    def rows(self, table: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(self.tables[table][k]) for k in sorted(self.tables[table])]


@dataclass
class InMemoryLiveState:
    """LiveState fake with Redis's semantics: streams refuse entries at or below their last seq,
    hot state only moves forwards (an older one touches neither index nor TTL), ended runs leave
    the tenant index and get the ended TTL."""

    hot: dict[str, dict[str, str]] = field(default_factory=dict)
    streams: dict[str, list[tuple[str, dict[str, str]]]] = field(default_factory=dict)
    active: dict[str, dict[str, int]] = field(default_factory=dict)
    ttl: dict[str, str] = field(default_factory=dict)
    unavailable: bool = False
    live_ttl_s: int = 30 * 24 * 3600

    def publish(self, updates: Sequence[LiveUpdate]) -> None:
        if self.unavailable:
            raise LiveUnavailable("injected outage")
        for u in updates:
            stream = self.streams.setdefault(u.run_id, [])
            top = int(stream[-1][0].split("-")[0]) if stream else 0
            if u.entry and u.seq > top:
                stream.append((f"{u.seq}-0", dict(u.entry)))
            current = int(self.hot.get(u.run_id, {}).get("last_seq", "0"))
            if u.hot_seq > current:
                self.hot[u.run_id] = dict(u.hot)
            if u.hot_seq < current:
                continue  # an older state than the stored one changes neither the index nor the TTL
            index = self.active.setdefault(u.tenant_id, {})
            if u.ended:
                index.pop(u.run_id, None)
                self.ttl[u.run_id] = "ended"
            else:
                index[u.run_id] = u.created_at_ms
                for run_id, created in list(index.items()):
                    if created < u.created_at_ms - self.live_ttl_s * 1000:
                        del index[run_id]
                self.ttl[u.run_id] = "live"
