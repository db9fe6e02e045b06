"""Memory and time of many parked run states: the loop's state store against keeping every state decoded.

Run: .venv/bin/python libs/messaging/bench/parked_states.py [--runs 100000] [--cache-runs 256]

Each mode runs in a fresh child process, which builds `--runs` run states (a pydantic model of
≈ 5 KB of JSON shaped like a ledger: tool calls, event ids, usage) and keeps them either
`decoded` (a dict of objects per partition, as the loop did before the store) or in a
`StateStore` (what the loop does now), written in batches of 500 as the loop writes committed
batches. It reports the growth of its resident set (VmRSS) while holding them, and for the
store: write rate, a read of a state not in the cache (decode from disk), a read of a cached one,
and a tick's `due` query with every run parked (no timer), all in CPU time of the process (a
shared machine's load does not inflate them; I/O waits are not counted, and the file is in the
OS page cache at these sizes). Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from pydantic import BaseModel, Field

from tether_messaging.processor import PydanticStateCodec
from tether_messaging.statestore import StateStore

PARTITIONS = 6
BATCH = 500


class Call(BaseModel):
    call_id: str
    idem_key: str
    tool_name: str
    args_json: str
    status: str
    observation: str | None = None


class ParkedRun(BaseModel):
    run_id: str
    tenant_id: str
    seq: int
    last_hash: str
    seen_event_ids: list[str] = Field(default_factory=list)
    calls: dict[str, Call] = Field(default_factory=dict)
    deadline_ms: int = 0
    waiting_since_ms: int | None = None


def make_run(i: int) -> ParkedRun:
    calls = {
        f"{s}.0": Call(call_id=f"{s}.0", idem_key=f"{i:08x}{s:056x}", tool_name="send_email",
                       args_json=f'{{"to": "someone@example.com", "subject": "report {s}"}}',
                       status="COMPLETED" if s < 8 else "APPROVAL_PENDING", observation="ok " * 20)
        for s in range(1, 9)
    }
    return ParkedRun(run_id=f"run-{i:08d}", tenant_id=f"t{i % 50}", seq=40, last_hash=f"{i:064x}",
                     seen_event_ids=[f"ev-{i:08d}-{n:04d}-0123456789abcdef" for n in range(40)], calls=calls,
                     deadline_ms=1_700_000_000_000, waiting_since_ms=1_700_000_000_000)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def child(mode: str, runs: int, cache_runs: int) -> dict[str, object]:
    codec = PydanticStateCodec(ParkedRun)
    state_bytes = len(codec.encode(make_run(0)))
    before = rss_kib()
    out: dict[str, object] = {"mode": mode, "runs": runs, "state_bytes": state_bytes}
    if mode == "decoded":
        states: dict[int, dict[str, ParkedRun]] = {}
        for i in range(runs):
            # As the loop kept them: decoded from the changelog bytes on restore.
            states.setdefault(i % PARTITIONS, {})[f"run-{i:08d}"] = codec.decode(codec.encode(make_run(i)))
        out["rss_growth_mb"] = round((rss_kib() - before) / 1024, 1)
        return out
    with tempfile.TemporaryDirectory() as directory:
        store = StateStore(codec, name="bench", directory=directory, cache_runs=cache_runs,
                           wake_at=lambda run: None)  # every run parked: no timer
        started = time.process_time()
        for first in range(0, runs, BATCH):
            batch = [make_run(i) for i in range(first, min(runs, first + BATCH))]
            store.put_many([(i % PARTITIONS, run.run_id, run, None) for i, run in enumerate(batch, first)])
        elapsed = time.process_time() - started
        out["rss_growth_mb"] = round((rss_kib() - before) / 1024, 1)
        out["decoded_in_memory"] = store.decoded_count
        out["disk_mb"] = round(store.path.stat().st_size / 2**20, 1)
        out["put_per_cpu_s_incl_encode"] = round(runs / elapsed)
        cold = [i for i in range(0, runs - cache_runs, max(1, (runs - cache_runs) // 1000))]
        started = time.process_time()
        for i in cold:
            store.get(i % PARTITIONS, f"run-{i:08d}")
        out["get_uncached_cpu_us"] = round((time.process_time() - started) / len(cold) * 1e6, 1)
        started = time.process_time()
        for _ in range(1000):
            store.get((runs - 1) % PARTITIONS, f"run-{runs - 1:08d}")
        out["get_cached_cpu_us"] = round((time.process_time() - started) / 1000 * 1e6, 2)
        started = time.process_time()
        due = sum(len(store.due(p, 2**62)) for p in range(PARTITIONS))
        out["due_query_cpu_ms_all_partitions"] = round((time.process_time() - started) * 1000, 2)
        out["due_runs"] = due
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--cache-runs", type=int, default=256)
    parser.add_argument("--child", choices=["decoded", "store"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.runs, args.cache_runs)))
        return
    for mode in ("store", "decoded"):
        subprocess.run([sys.executable, __file__, "--child", mode, "--runs", str(args.runs),
                        "--cache-runs", str(args.cache_runs)], check=True)


if __name__ == "__main__":
    main()
