"""A loop's per-run states on local disk: a disposable cache of its changelog, with few decoded states in memory.

The changelog topic is the source of truth; this store only makes the owned partitions' latest
states quick to read without keeping them all as Python objects. A run parked for days (on a
human approval) costs a row in an SQLite file here, not memory. What lives in memory is bounded:
the `cache_runs` most recently used decoded states (an LRU; the runs in flight, so the hot path
rarely decodes) and SQLite's page cache (`page_cache_kib`).

Each row carries the run's `wake_at` (when its timer is due, from the processor's
`wake_at_ms(state)`), indexed, so a tick asks for the few runs that are due instead of decoding
every state every second.

The store holds *committed* states only: the loop keeps a batch's changes aside and writes them
here after the transaction commits, so an aborted batch never reaches the store (and needs no
rollback). It is rebuilt from the changelog on every partition assignment and deleted at shutdown;
nothing in it outlives the process.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tether_messaging.processor import StateCodec

#: The processor's timer index function: when the run's timer is due (ms), or None for no timer.
WakeAt = Callable[[Any], int | None]

#: The wake time of every run of a processor without `wake_at_ms`: always due, so its tick sees
#: every run (as it did before the index existed).
ALWAYS_DUE = 0

#: Rows a restore reads (and decodes for their wake time) per round trip: bounds the memory the
#: restore needs, whatever the number of runs.
_RESTORE_PAGE = 500

_SCHEMA = """
CREATE TABLE states (
    partition INTEGER NOT NULL,
    run_id    TEXT    NOT NULL,
    data      BLOB    NOT NULL,
    wake_at   INTEGER,
    PRIMARY KEY (partition, run_id)
);
CREATE INDEX states_due ON states (partition, wake_at, run_id) WHERE wake_at IS NOT NULL;
"""


class StateStore:
    """The committed per-run states of the partitions one loop instance owns.

    Keys are (partition, run id); values are the processor's state objects, stored as the
    bytes of its `StateCodec`. Used by one thread at a time (the loop's).
    """

    def __init__(
        self,
        codec: StateCodec[Any],
        *,
        name: str,
        directory: str | Path | None = None,
        cache_runs: int = 256,
        page_cache_kib: int = 2048,
        wake_at: WakeAt | None = None,
    ) -> None:
        if cache_runs < 1:
            raise ValueError("cache_runs must be at least 1")
        self._codec = codec
        self._name = name
        self._parent = Path(directory) if directory is not None else None
        self._cache_runs = cache_runs
        self._page_cache_kib = page_cache_kib
        self._wake_at = wake_at
        self._decoded: OrderedDict[tuple[int, str], Any] = OrderedDict()
        self._dir: Path | None = None
        self._db: sqlite3.Connection | None = None

    # -- reading -----------------------------------------------------------------------------
    def get(self, partition: int, run_id: str) -> Any | None:
        """The run's committed state, or None. Recently used states come from memory."""
        key = (partition, run_id)
        state = self._decoded.get(key)
        if state is not None:
            self._decoded.move_to_end(key)
            return state
        row = self._conn().execute(
            "SELECT data FROM states WHERE partition = ? AND run_id = ?", key
        ).fetchone()
        if row is None:
            return None
        state = self._codec.decode(row[0])
        self._remember(key, state)
        return state

    def wake_at(self, state: Any) -> int | None:
        """When `state`'s timer is due by the processor's rule (ALWAYS_DUE without one)."""
        if self._wake_at is None:
            return ALWAYS_DUE
        wake = self._wake_at(state)
        return None if wake is None else int(wake)

    def due(self, partition: int, now_ms: int) -> list[tuple[int, str]]:
        """(wake_at, run id) of the partition's runs whose timer is due at `now_ms`, earliest first."""
        rows = self._conn().execute(
            "SELECT wake_at, run_id FROM states WHERE partition = ? AND wake_at IS NOT NULL AND wake_at <= ?"
            " ORDER BY wake_at, run_id",
            (partition, now_ms),
        )
        return [(wake, run_id) for wake, run_id in rows]

    def keys(self, partition: int) -> Iterator[str]:
        """Run ids with a state in the partition (read lazily: there may be very many)."""
        return (run_id for (run_id,) in self._conn().execute(
            "SELECT run_id FROM states WHERE partition = ? ORDER BY run_id", (partition,)
        ))

    def count(self, partition: int | None = None) -> int:
        """Runs with a state, in one partition or in all."""
        if partition is None:
            return self._conn().execute("SELECT count(*) FROM states").fetchone()[0]
        return self._conn().execute("SELECT count(*) FROM states WHERE partition = ?", (partition,)).fetchone()[0]

    @property
    def decoded_count(self) -> int:
        """Decoded states held in memory (never more than `cache_runs`)."""
        return len(self._decoded)

    # -- writing committed states --------------------------------------------------------------
    def put(self, partition: int, run_id: str, state: Any | None, data: bytes | None = None) -> None:
        """Store a committed state (None deletes it). `data` is its encoding, if already made."""
        self.put_many([(partition, run_id, state, data)])

    def delete(self, partition: int, run_id: str) -> None:
        self.put(partition, run_id, None)

    def put_many(self, changes: Iterable[tuple[int, str, Any | None, bytes | None]]) -> None:
        """Store one committed batch's states in one SQLite transaction: (partition, run id,
        state or None, encoding or None)."""
        db = self._conn()
        db.execute("BEGIN")
        try:
            for partition, run_id, state, data in changes:
                key = (partition, run_id)
                if state is None:
                    db.execute("DELETE FROM states WHERE partition = ? AND run_id = ?", key)
                    self._decoded.pop(key, None)
                    continue
                if data is None:
                    data = self._codec.encode(state)
                db.execute(
                    "INSERT OR REPLACE INTO states (partition, run_id, data, wake_at) VALUES (?, ?, ?, ?)",
                    (partition, run_id, data, self.wake_at(state)),
                )
                self._remember(key, state)
        finally:
            # No rollback journal (see `_open`), so no ROLLBACK: a failure here ends the loop,
            # and the next owner rebuilds from the changelog.
            db.execute("COMMIT")

    def forget_decoded(self) -> None:
        """Drop every decoded state: the next read decodes the committed bytes again. The loop
        calls this after an aborted batch, so a state a handler changed in place is not kept."""
        self._decoded.clear()

    def drop_partition(self, partition: int) -> None:
        """Forget a partition (revoked, lost, or about to be restored)."""
        self._conn().execute("DELETE FROM states WHERE partition = ?", (partition,))
        for key in [k for k in self._decoded if k[0] == partition]:
            del self._decoded[key]

    # -- restore -----------------------------------------------------------------------------
    def begin_restore(self, partitions: Iterable[int]) -> None:
        """Empty the partitions and start loading their changelog records (`load`)."""
        for p in partitions:
            self.drop_partition(p)
        self._conn().execute("BEGIN")

    def load(self, partition: int, run_id: str, data: bytes | None) -> None:
        """One changelog record, in changelog order (None = tombstone). Not decoded here: a
        compacted changelog may still hold many superseded records of a run."""
        if data is None:
            self._db.execute("DELETE FROM states WHERE partition = ? AND run_id = ?", (partition, run_id))
        else:
            wake = ALWAYS_DUE if self._wake_at is None else None  # set by `end_restore`
            self._db.execute(
                "INSERT OR REPLACE INTO states (partition, run_id, data, wake_at) VALUES (?, ?, ?, ?)",
                (partition, run_id, data, wake),
            )

    def end_restore(self, partitions: Iterable[int]) -> None:
        """Commit the loaded records and index each run's wake time (decoding each run once)."""
        db = self._conn()
        if self._wake_at is not None:
            for p in partitions:
                after: str | None = None
                while True:
                    if after is None:
                        rows = db.execute(
                            "SELECT run_id, data FROM states WHERE partition = ? ORDER BY run_id LIMIT ?",
                            (p, _RESTORE_PAGE),
                        ).fetchall()
                    else:
                        rows = db.execute(
                            "SELECT run_id, data FROM states WHERE partition = ? AND run_id > ? ORDER BY run_id LIMIT ?",
                            (p, after, _RESTORE_PAGE),
                        ).fetchall()
                    if not rows:
                        break
                    db.executemany(
                        "UPDATE states SET wake_at = ? WHERE partition = ? AND run_id = ?",
                        [(self.wake_at(self._codec.decode(data)), p, run_id) for run_id, data in rows],
                    )
                    after = rows[-1][0]
        db.execute("COMMIT")

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def path(self) -> Path | None:
        """The SQLite file, once opened."""
        return None if self._dir is None else self._dir / "states.sqlite3"

    def close(self) -> None:
        """Close the database and delete its directory (the changelog keeps everything)."""
        self._decoded.clear()
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _remember(self, key: tuple[int, str], state: Any) -> None:
        self._decoded[key] = state
        self._decoded.move_to_end(key)
        while len(self._decoded) > self._cache_runs:
            self._decoded.popitem(last=False)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._open()
        return self._db

    def _open(self) -> sqlite3.Connection:
        # Opened on first use, so a loop that never stores a state creates no file. A fresh
        # directory per store: several loops may share a parent (tests, a configured path),
        # and nothing a previous process left there is ever read.
        if self._parent is not None:
            self._parent.mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix=f"tether-{self._name}-states-", dir=self._parent))
        # isolation_level=None: transactions are explicit (put_many, restore).
        db = sqlite3.connect(self._dir / "states.sqlite3", isolation_level=None, check_same_thread=False)
        # The file is a cache rebuilt from the changelog on every assignment and deleted at
        # shutdown; a crash loses nothing the changelog lacks. So no durability is bought:
        # no rollback journal, no fsync, one connection holding the lock.
        db.execute("PRAGMA journal_mode = OFF")
        db.execute("PRAGMA synchronous = OFF")
        db.execute("PRAGMA locking_mode = EXCLUSIVE")
        # Negative = KiB: the page cache is the store's only memory besides the decoded LRU.
        db.execute(f"PRAGMA cache_size = -{int(self._page_cache_kib)}")
        db.executescript(_SCHEMA)
        return db
