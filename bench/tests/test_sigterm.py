"""SIGTERM stops make bench / make chaos through their cleanup (services stopped, namespace dropped)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path


def test_sigterm_runs_the_finally_blocks(tmp_path: Path) -> None:
    marker = tmp_path / "cleaned"
    code = textwrap.dedent(f"""
        import time
        from tether_bench.common import stop_cleanly_on_sigterm
        stop_cleanly_on_sigterm()
        try:
            print("ready", flush=True)
            time.sleep(60)
        finally:
            open({str(marker)!r}, "w").write("stopped what it started")
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert marker.read_text() == "stopped what it started"
