"""The LangGraph peer stops its worker processes when the bench is stopped or the workers overrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

PROCESSES = 2


def stand_in_worker(tmp_path: Path) -> Path:
    """An executable that takes the worker's command line, records its pid and hangs, as a stuck worker would."""
    script = tmp_path / "hung-worker"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, time
        with open({str(tmp_path / "pids")!r}, "a") as fh:
            fh.write(f"{{os.getpid()}}\\n")
        time.sleep(120)
    """))
    script.chmod(0o755)
    return script


def start_bench(tmp_path: Path, overrun_s: float) -> subprocess.Popen[str]:
    """A process that runs the peer as `make bench` does (SIGTERM → SystemExit), the database stubbed."""
    code = textwrap.dedent(f"""
        from pathlib import Path
        import tether_bench.peer_langgraph as peer
        from tether_bench.common import stop_cleanly_on_sigterm
        stop_cleanly_on_sigterm()
        peer.prepare_schema = lambda dsn, schema: None
        peer.drop_schema = lambda dsn, schema: print("schema dropped", flush=True)
        peer.WORKER_OVERRUN_S = {overrun_s!r}
        peer.run_peer(dsn="stub", model_url="stub", kv_url="stub", goal_marker="stub", steps_per_run=5,
                      processes={PROCESSES}, concurrency=4, seconds=0, warmup_s=0,
                      workdir=Path({str(tmp_path)!r}), python={str(stand_in_worker(tmp_path))!r})
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_pids(tmp_path: Path) -> list[int]:
    pids = tmp_path / "pids"
    return [int(line) for line in pids.read_text().split()] if pids.exists() else []


def wait_for_workers(tmp_path: Path, timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(pids := worker_pids(tmp_path)) < PROCESSES:
        assert time.monotonic() < deadline, f"the stand-in workers did not start: {pids}"
        time.sleep(0.05)
    return pids


def still_ours(pid: int, tmp_path: Path) -> bool:
    """The pid runs (not a zombie) and is one of this test's stand-in workers, not a reused pid."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and str(tmp_path).encode() in cmdline


def kill_leftovers(bench: subprocess.Popen[str], tmp_path: Path) -> None:
    bench.kill()
    bench.wait(timeout=30)
    for pid in worker_pids(tmp_path):
        if still_ours(pid, tmp_path):
            os.kill(pid, signal.SIGKILL)


def test_stopping_the_bench_stops_its_workers(tmp_path: Path) -> None:
    bench = start_bench(tmp_path, overrun_s=300.0)
    try:
        pids = wait_for_workers(tmp_path)
        bench.send_signal(signal.SIGTERM)
        stdout, _ = bench.communicate(timeout=30)

        assert bench.returncode == 128 + signal.SIGTERM
        assert "schema dropped" in stdout
        assert [pid for pid in pids if still_ours(pid, tmp_path)] == []
    finally:
        kill_leftovers(bench, tmp_path)


def test_workers_that_overrun_are_stopped(tmp_path: Path) -> None:
    bench = start_bench(tmp_path, overrun_s=3.0)
    try:
        pids = wait_for_workers(tmp_path)
        stdout, stderr = bench.communicate(timeout=30)

        assert "TimeoutExpired" in stderr
        assert "schema dropped" in stdout
        assert [pid for pid in pids if still_ours(pid, tmp_path)] == []
    finally:
        kill_leftovers(bench, tmp_path)
