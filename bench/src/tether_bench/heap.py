"""What a parked run costs each service: the marginal RSS between two park levels, and (optionally) where it goes.

The park phase of `make bench` measures each service process at two levels, N/2 and N parked runs,
and reports the slope between them: the cost of one more parked run, with allocator warm-up, import
caches and connection buffers (paid once, before the first level) left out.

With `TETHER_BENCH_PARK_HEAP=1`, at each level SIGUSR1 makes every service write a heap snapshot
(`tether_runtime.service.install_heap_snapshot_handler`: the first one starts tracemalloc, so the
second holds what was allocated between the levels and is still alive); `heap_growth` diffs the two
by allocation site (the line, and the path to it, innermost frame first), per parked run.
"""

from __future__ import annotations

import json
import os
import signal
import time
import tracemalloc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from tether_runtime.service import heap_snapshot_path


def marginal_kb_per_run(rss_low_kb: Mapping[str, int], rss_high_kb: Mapping[str, int],
                        parked_low: int, parked_high: int) -> dict[str, float | None]:
    """Per service: (RSS at the high level − RSS at the low level) ÷ (runs parked between them), in KiB.
    A service missing from either level (restarted in between) has None; so has every service when no
    run parked between the levels."""
    runs = parked_high - parked_low
    return {name: (round((rss_high_kb[name] - low) / runs, 2) if runs > 0 and name in rss_high_kb else None)
            for name, low in rss_low_kb.items()}


def mb_per_10k(kb_per_run: Mapping[str, float | None]) -> float | None:
    """The services' summed KiB per run as MiB per 10,000 runs (None if any service has no figure).

    A service whose RSS fell between the levels (the allocator returned memory, a buffer shrank)
    counts 0: parked runs cannot cost negative memory, and its drop must not hide another
    service's growth."""
    values = list(kb_per_run.values())
    if not values or any(v is None for v in values):
        return None
    return round(sum(max(0.0, v) for v in values) * 10_000 / 1024, 1)


def consumer_lag(bootstrap: str, groups: Sequence[str], topics: Sequence[str], partitions: int) -> dict[str, int]:
    """Per consumer group: offsets of `topics` not yet committed (high watermark − committed offset,
    summed over partitions; a topic the group never committed on counts as caught up). One offset
    per partition is no backlog: a transactional producer's last commit marker takes an offset
    that no consumer commits past until the next record comes."""
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-lag-{os.getpid()}",
                      "enable.auto.commit": False})
    try:
        high = {(t, p): probe.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
                for t in topics for p in range(partitions)}
        lag = {}
        for group in groups:
            # Reading a group's committed offsets does not join it (nothing is subscribed).
            reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
            try:
                committed = reader.committed([TopicPartition(t, p) for t, p in high], timeout=10)
            finally:
                reader.close()
            lag[group] = sum(max(0, high[(tp.topic, tp.partition)] - tp.offset - 1)
                             for tp in committed if tp.offset >= 0)
        return lag
    finally:
        probe.close()


def request_snapshots(pids: Mapping[str, int], number: int, directory: Path, *,
                      timeout_s: float = 120.0) -> dict[str, Path]:
    """SIGUSR1 each process and wait for its `number`-th snapshot; returns the ones written in time."""
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass  # restarted meanwhile: it has no snapshot at this level
    deadline = time.monotonic() + timeout_s
    wanted = {name: heap_snapshot_path(pid, number, directory) for name, pid in pids.items()}
    while time.monotonic() < deadline and not all(p.exists() for p in wanted.values()):
        time.sleep(0.2)
    return {name: path for name, path in wanted.items() if path.exists()}


def _site(traceback: tracemalloc.Traceback, frames: int) -> str:
    """Innermost frame first, paths shortened to the package (`tether_budget/handlers.py:120`)."""
    shown = []
    for frame in list(traceback)[-frames:][::-1] if traceback else []:
        path = frame.filename
        for marker in ("/site-packages/", "/src/", "/lib/python3"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        shown.append(f"{path}:{frame.lineno}")
    return " <- ".join(shown)


def c_heap_growth(low: Path, high: Path, runs: int) -> dict[str, int] | None:
    """Per run, from the `.malloc.json` beside two snapshots: what the C allocator holds in use
    (tracemalloc's own tables taken out) and keeps free (RSS no object holds: fragmentation,
    buffers given back); None without glibc's numbers."""
    try:
        a, b = (json.loads(p.with_suffix(".malloc.json").read_text()) for p in (low, high))
    except (OSError, ValueError):
        return None
    if a.get("malloc") is None or b.get("malloc") is None:
        return None
    per = max(runs, 1)
    in_use = (b["malloc"]["in_use"] - b["tracemalloc_overhead"]) - (a["malloc"]["in_use"] - a["tracemalloc_overhead"])
    return {"c_in_use_bytes_per_run": round(in_use / per),
            "c_free_bytes_per_run": round((b["malloc"]["free"] - a["malloc"]["free"]) / per)}


def heap_growth(low: Path, high: Path, runs: int, *, top: int = 12, frames: int = 6) -> dict[str, Any]:
    """The traced heap's growth from snapshot `low` to `high`, per run (`runs` parked in between):
    the total and the `top` allocation sites by bytes, each with its innermost `frames` frames.
    tracemalloc's own bookkeeping is excluded; memory outside Python's allocators (librdkafka's
    buffers, C extensions calling malloc directly) is not traced, so RSS grows by at least this."""
    exclude = [tracemalloc.Filter(False, tracemalloc.__file__)]
    before = tracemalloc.Snapshot.load(str(low)).filter_traces(exclude)
    after = tracemalloc.Snapshot.load(str(high)).filter_traces(exclude)
    diffs = after.compare_to(before, "traceback")
    per = max(runs, 1)
    total = sum(d.size_diff for d in diffs)

    def largest(stats: list[tracemalloc.StatisticDiff], depth: int) -> list[dict[str, Any]]:
        return [{"bytes_per_run": round(d.size_diff / per), "blocks_per_run": round(d.count_diff / per, 2),
                 "site": _site(d.traceback, depth)}
                for d in sorted(stats, key=lambda d: d.size_diff, reverse=True)[:top] if d.size_diff > 0]

    return {"traced_bytes_per_run": round(total / per), **(c_heap_growth(low, high, runs) or {}),
            # By the allocating line alone (every path to it summed), then by the path to it.
            "top_lines": largest(after.compare_to(before, "lineno"), 1),
            "top_sites": largest(diffs, frames)}
