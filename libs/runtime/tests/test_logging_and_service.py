"""JSON log lines carry service and instance; run() turns a signal into a clean exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tether_runtime.logging import UnknownLogLevel, configure


def _python(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)


def test_log_lines_are_json_with_service_and_instance() -> None:
    result = _python(
        """
        import logging, structlog
        from tether_runtime.logging import configure
        configure("budget", "INFO", instance=2)
        structlog.get_logger().info("run_accepted", run_id="r1")
        structlog.get_logger().debug("hidden")
        logging.getLogger("lib").warning("from stdlib")
        """
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["run_accepted", "from stdlib"]
    assert all(line["service"] == "budget" and line["instance"] == 2 for line in lines)
    assert lines[0]["run_id"] == "r1" and lines[0]["level"] == "info"


@pytest.mark.parametrize("level,shown", [("INFO", ["kept", "slow"]), ("DEBUG", ["kept", "request", "slow"])])
def test_http_clients_log_each_request_only_at_debug(level: str, shown: list[str]) -> None:
    result = _python(
        f"""
        import logging, structlog
        from tether_runtime.logging import configure
        configure("planner", "{level}")
        structlog.get_logger().info("kept")
        logging.getLogger("httpx").info("request")
        logging.getLogger("httpcore.connection").warning("slow")
        """
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [line["event"] for line in lines] == shown
    assert lines[-1]["logger"] == "httpcore.connection" and lines[-1]["level"] == "warning"
    assert all(line["service"] == "planner" and line["timestamp"] for line in lines)


def test_unknown_log_level_is_refused() -> None:
    with pytest.raises(UnknownLogLevel):
        configure("x", "LOUD")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_main_and_exits_zero(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys
            from tether_runtime.service import run
            def main(stop):
                print("started", flush=True)
                stop.wait(60)
                return 0 if stop.is_set() else 3
            raise SystemExit(run(main))
            """
        )],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "started"
    os.kill(proc.pid, sig)
    assert proc.wait(30) == 0


def test_a_failing_main_exits_one() -> None:
    result = _python(
        """
        from tether_runtime.service import run
        def main(stop):
            raise RuntimeError("fenced")
        raise SystemExit(run(main))
        """
    )
    assert result.returncode == 1
    assert "fenced" in result.stdout + result.stderr


def test_sigusr1_starts_tracemalloc_then_snapshots_what_was_allocated_since(tmp_path) -> None:
    import tracemalloc

    from tether_runtime.service import heap_snapshot_path

    code = textwrap.dedent(
        """
        import time, tracemalloc
        from tether_runtime.service import run
        kept = []
        def main(stop):
            kept.append(bytearray(300_000))  # before tracing: in no snapshot
            print("started", flush=True)
            while not tracemalloc.is_tracing() and not stop.is_set():
                time.sleep(0.01)
            kept.extend(bytearray(1000) for _ in range(500))  # ~500 KB after the first snapshot
            print("allocated", flush=True)
            stop.wait(60)
            return 0
        raise SystemExit(run(main))
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("PYTHONTRACEMALLOC", None)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)

    def snapshot(number: int) -> tracemalloc.Snapshot:
        os.kill(proc.pid, signal.SIGUSR1)
        path = heap_snapshot_path(proc.pid, number, tmp_path)
        for _ in range(300):
            if path.exists():
                return tracemalloc.Snapshot.load(str(path))
            time.sleep(0.05)
        raise AssertionError(f"no snapshot {number}")

    def allocated_by_main(snap: tracemalloc.Snapshot) -> int:
        return sum(s.size for s in snap.statistics("lineno") if s.traceback[0].filename == "<string>")

    def wait_for(line: str) -> None:
        # structlog, not configured here, logs to stdout too
        while (got := proc.stdout.readline()) and got.strip() != line:
            pass
        assert got, proc.stderr.read()

    try:
        wait_for("started")
        first = snapshot(1)
        wait_for("allocated")
        second = snapshot(2)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert allocated_by_main(first) < 10_000
    assert 500_000 <= allocated_by_main(second) < 600_000
    c_heap = json.loads(heap_snapshot_path(proc.pid, 2, tmp_path).with_suffix(".malloc.json").read_text())
    assert c_heap["tracemalloc_overhead"] > 0
    assert c_heap["malloc"] is None or c_heap["malloc"]["in_use"] > 0
