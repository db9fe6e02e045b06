"""Append-only JSONL record of every effect a dev service received, so tests count effects where they land."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class EffectRecorder:
    """Appends one JSON object per line to a file; safe to call from several threads.

    Each record gets `seq` (1-based, continuing after the records already in the file, so a
    restarted service keeps counting) and `ts_ms`. Lines are flushed as written, so a reader
    in another process sees them at once.
    """

    def __init__(self, path: str | os.PathLike[str], service: str) -> None:
        self.path = Path(path)
        self.service = service
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._seq = len(read_records(self.path))
        self._file = self.path.open("a", encoding="utf-8")
        if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            # A torn last line from a writer that died: end it so the next record stands alone.
            self._file.write("\n")
            self._file.flush()

    def record(self, **fields: Any) -> dict[str, Any]:
        """Append one effect and return it as written."""
        with self._lock:
            self._seq += 1
            entry = {"seq": self._seq, "ts_ms": int(time.time() * 1000), "service": self.service, **fields}
            self._file.write(json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n")
            self._file.flush()
            return entry

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records in a JSONL effect file (empty if it does not exist yet).

    A torn last line (the writer died mid-line) is ignored: it never completed as an effect record.
    """
    p = Path(path)
    if not p.exists():
        return []
    out: list[dict[str, Any]] = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
