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


def test_sigusr1_writes_a_heap_snapshot_when_tracemalloc_traces(tmp_path) -> None:
    import tracemalloc

    from tether_runtime.service import heap_snapshot_path

    code = textwrap.dedent(
        """
        import tracemalloc
        from tether_runtime.service import run
        # As PYTHONTRACEMALLOC=3 would, but after the imports (tracing them is slow).
        tracemalloc.start(3)
        kept = []
        def main(stop):
            kept.extend(bytearray(1000) for _ in range(500))  # ~500 KB still referenced
            print("started", flush=True)
            stop.wait(60)
            return 0
        raise SystemExit(run(main))
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "started"
        os.kill(proc.pid, signal.SIGUSR1)
        path = heap_snapshot_path(proc.pid, 1, tmp_path)
        for _ in range(300):
            if path.exists():
                break
            time.sleep(0.05)
        assert path.exists(), proc.stderr
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    stats = tracemalloc.Snapshot.load(str(path)).statistics("lineno")
    assert sum(s.size for s in stats if "<string>" in s.traceback[0].filename) >= 500_000


def test_without_tracemalloc_sigusr1_is_left_alone() -> None:
    result = _python(
        """
        import signal
        from tether_runtime.service import install_heap_snapshot_handler
        print(install_heap_snapshot_handler(), signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)
        """
    )
    assert result.stdout.strip() == "False True", result.stderr
