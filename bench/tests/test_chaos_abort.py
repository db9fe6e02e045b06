"""`Chaos.abort` leaves no process behind: it waits for a supervisor restart under way, and none begins after it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import tether_bench.chaos as chaos_module
from tether_bench.chaos import Chaos, ChaosSettings
from tether_bench.common import StackSettings


class ExitedProcess:
    running = False
    returncode = 1
    pid = 4242


class SlowRestarts:
    """A system whose one service has exited; a restart takes a while (start, then the health check)."""

    def __init__(self) -> None:
        self.processes = {"planner": ExitedProcess()}
        self.began = threading.Event()
        self.events: list[str] = []

    def restart(self, name: str) -> None:
        self.events.append("restart begins")
        self.began.set()
        time.sleep(0.5)
        self.events.append("restart done")


def test_abort_waits_for_a_supervisor_restart_under_way_and_none_begins_after_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(chaos_module, "SERVICES", {"planner": None})
    chaos = Chaos(ChaosSettings(seed=1, workdir=tmp_path), StackSettings())
    chaos.note = lambda **_entry: None  # type: ignore[method-assign]
    system = chaos.system = SlowRestarts()  # type: ignore[assignment]
    chaos._supervisor = threading.Thread(target=chaos._supervise, daemon=True)
    chaos._supervisor.start()
    assert system.began.wait(5)

    chaos.abort()
    system.events.append("abort returned")  # where main() stops the system
    assert system.events == ["restart begins", "restart done", "abort returned"]
    assert not chaos._supervisor.is_alive()

    # The service is still down (its restart "failed"): after abort nothing restarts it.
    time.sleep(1.2)
    assert system.events.count("restart begins") == 1
