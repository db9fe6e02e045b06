"""Process lifecycle: a stop event set by SIGTERM/SIGINT, a clean exit code, and heap snapshots on SIGUSR1."""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import os
import signal
import tempfile
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger("tether_runtime.service")


def install_stop_handlers(stop: threading.Event) -> None:
    """Set `stop` on SIGTERM and SIGINT (must be called from the main thread)."""

    def _handler(signum: int, _frame: object) -> None:
        log.info("stop_requested", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def heap_snapshot_path(pid: int, number: int, directory: str | Path | None = None) -> Path:
    """Where the `number`-th (1, 2, ...) heap snapshot of process `pid` is written."""
    return Path(directory or tempfile.gettempdir()) / f"tether-heap-{pid}-{number}.tracemalloc"


#: Frames kept per allocation when SIGUSR1 starts tracemalloc (PYTHONTRACEMALLOC=<n> sets its own).
HEAP_TRACE_FRAMES = 8


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_stats() -> dict[str, int] | None:
    """glibc's view of the C heap (mallinfo2), in bytes: `in_use` (malloc'd and not freed, the
    mmapped chunks included), `free` (freed but kept by the allocator: RSS that no object holds),
    `mmapped`. None where the C library has no mallinfo2 (musl, glibc < 2.33, not Linux)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks, "mmapped": info.hblkhd}


def install_heap_snapshot_handler(frames: int = HEAP_TRACE_FRAMES) -> None:
    """SIGUSR1 writes a tracemalloc snapshot of the Python heap to `heap_snapshot_path` (in the
    temp directory: ``TMPDIR``), after a full garbage collection, so what it holds is what is
    still referenced, and beside it (``.malloc.json``) the C allocator's `malloc_stats`. A
    diagnostic for finding what grows (the bench's park phase uses it:
    TETHER_BENCH_PARK_HEAP); compare two with ``Snapshot.load(b).compare_to(Snapshot.load(a), ...)``.

    If tracemalloc is not tracing yet, the first SIGUSR1 starts it (`frames` frames per
    allocation): that snapshot is (nearly) empty, and each later one holds what was allocated
    after the first and is still alive. ``PYTHONTRACEMALLOC=<frames>`` traces from start-up
    instead (the whole heap, but imports then run many times slower). Until a SIGUSR1 comes,
    nothing is traced and nothing costs anything."""
    numbers = itertools.count(1)

    def _handler(_signum: int, _frame: object) -> None:
        gc.collect()
        if not tracemalloc.is_tracing():
            tracemalloc.start(frames)
        path = heap_snapshot_path(os.getpid(), next(numbers))
        partial = path.with_suffix(".partial")
        tracemalloc.take_snapshot().dump(str(partial))
        # Beside it, what the C allocator holds (tracemalloc's own tables are part of `in_use`).
        c_heap = {"malloc": malloc_stats(), "tracemalloc_overhead": tracemalloc.get_tracemalloc_memory()}
        path.with_suffix(".malloc.json").write_text(json.dumps(c_heap))
        partial.rename(path)  # readers never see a half-written snapshot
        log.info("heap_snapshot_written", path=str(path),
                 traced_mb=round(tracemalloc.get_traced_memory()[0] / 2**20, 1))

    signal.signal(signal.SIGUSR1, _handler)


def run(main: Callable[[threading.Event], int | None], *, stop: threading.Event | None = None) -> int:
    """Run `main(stop)` with signal handlers installed; returns the process exit code.

    `main` returns when `stop` is set (exit 0) or raises; an exception is logged and turns
    into exit code 1 so the supervisor restarts the process. Use as
    ``raise SystemExit(run(main))``.
    """
    stop = stop or threading.Event()
    install_stop_handlers(stop)
    install_heap_snapshot_handler()
    try:
        code = main(stop)
    except Exception:
        log.exception("service_failed")
        return 1
    log.info("service_stopped", exit_code=code or 0)
    return int(code or 0)
