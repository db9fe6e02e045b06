"""JSON log lines carry service and instance; run() turns a signal into a clean exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

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
