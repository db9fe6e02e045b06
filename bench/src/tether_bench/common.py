"""Shared pieces of the bench and the chaos run: stack settings, statistics, the machine, RSS, the stack."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO = Path(__file__).resolve().parents[3]
STACK_SCRIPT = REPO / "deploy" / "local" / "stack.py"

#: Event types of the run event log (the `event_type` of the envelope).
RUN_ACCEPTED = "tether.v1.RunAccepted"
RUN_REJECTED = "tether.v1.RunRejected"
RUN_COMPLETED = "tether.v1.RunCompleted"
RUN_TERMINATED = "tether.v1.RunTerminated"
STEP_GRANTED = "tether.v1.StepGranted"
MODEL_CALL_COMPLETED = "tether.v1.ModelCallCompleted"
MODEL_CALL_FAILED = "tether.v1.ModelCallFailed"
TOOL_CALL_REQUESTED = "tether.v1.ToolCallRequested"
TOOL_CALL_BUDGETED = "tether.v1.ToolCallBudgeted"
TOOL_CALL_COMPLETED = "tether.v1.ToolCallCompleted"
TOOL_CALL_FAILED = "tether.v1.ToolCallFailed"
TOOL_CALL_DENIED = "tether.v1.ToolCallDenied"
TOOL_CALL_OUTCOME_UNKNOWN = "tether.v1.ToolCallOutcomeUnknown"
APPROVAL_REQUESTED = "tether.v1.ApprovalRequested"
APPROVAL_DECIDED = "tether.v1.ApprovalDecided"
TERMINAL_TYPES = frozenset({RUN_COMPLETED, RUN_TERMINATED, RUN_REJECTED})


class BenchError(Exception):
    """The bench or the chaos run could not do what it set out to do; the message says what."""


class StackSettings(BaseSettings):
    """Where the stack is: the same TETHER_* variables every service and test reads (fixed names)."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    kafka_bootstrap: str = Field("127.0.0.1:9092", validation_alias=AliasChoices("TETHER_KAFKA_BOOTSTRAP"))
    pg_dsn: str = Field("postgresql://tether@127.0.0.1:5432/tether", validation_alias=AliasChoices("TETHER_PG_DSN"))
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias=AliasChoices("TETHER_REDIS_URL"))
    state_dir: Path = Field(REPO / ".state", validation_alias=AliasChoices("TETHER_STATE_DIR"))
    #: Set, the services write the registry's wire format (they inherit it); the log readers need it too.
    schema_registry_url: str | None = Field(None, validation_alias=AliasChoices("TETHER_SCHEMA_REGISTRY_URL"))


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (a supervisor's or a user's `kill`) raise SystemExit, so the `finally` blocks
    that stop the services and drop the namespace run; its default action ends the process on the
    spot and leaves every service, sink and model server it started running."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by the nearest-rank method; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def rss_kb(pid: int) -> int:
    """Resident set size of a process in KiB, from /proc/<pid>/status (VmRSS); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0


def cpu_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) a process has used, in seconds, from /proc/<pid>/stat;
    None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    # Fields after the parenthesised command name (which may contain spaces): utime, stime are 14, 15.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU time the whole machine spent not idle (all CPUs), in seconds, from /proc/stat."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    guest = sum(values[8:10])  # already counted in user / nice
    return (sum(values) - idle - guest) / os.sysconf("SC_CLK_TCK")


class CpuProbe:
    """CPU seconds each named process (and the whole machine) used between `start` and `stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self._start: dict[str, float | None] = {}
        self._stop: dict[str, float | None] = {}
        #: Wall clock (ms) of `start` and `stop`: count the steps of the same window.
        self.window_ms: tuple[float, float] = (0.0, 0.0)

    def _read(self) -> dict[str, float | None]:
        values: dict[str, float | None] = {name: cpu_s(pid) for name, pid in self.pids.items()}
        values["machine"] = machine_busy_s()
        return values

    def start(self) -> None:
        self._start = self._read()
        self.window_ms = (time.time() * 1000, self.window_ms[1])

    def stop(self) -> None:
        self._stop = self._read()
        self.window_ms = (self.window_ms[0], time.time() * 1000)

    def used_s(self) -> dict[str, float]:
        """Per name, the CPU seconds used in the window (processes that died in it are left out)."""
        return {name: after - self._start[name] for name, after in self._stop.items()
                if after is not None and self._start.get(name) is not None}


def loadavg() -> tuple[float, float, float]:
    with open("/proc/loadavg") as fh:
        one, five, fifteen = fh.read().split()[:3]
    return float(one), float(five), float(fifteen)


def machine() -> dict[str, object]:
    """What the numbers were measured on: CPUs, memory, the load at this moment."""
    mem_kb = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "mem_gib": round(mem_kb / 1024 / 1024, 1),
            "loadavg_1_5_15": loadavg(), "python": sys.version.split()[0]}


class LoadSampler:
    """Samples the 1-minute load average while a phase runs (the machine may be shared)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(loadavg()[0])

    def summary(self) -> dict[str, float | None]:
        return {"min": rounded(min(self.samples, default=None)), "max": rounded(max(self.samples, default=None)),
                "mean": rounded(sum(self.samples) / len(self.samples) if self.samples else None)}


class StackControl:
    """Stops and starts a component of the local stack by the PID its state dir recorded (deploy/local/stack.py).

    Only a broker or database that this state dir started is touched: `down` of a component the
    state dir did not start reports "not running", which is an error here (never a silent no-op).
    """

    def __init__(self, state_dir: Path, python: str = "python3") -> None:
        self.state_dir = state_dir
        self.python = python

    def _stack(self, *args: str) -> dict:
        env = {**os.environ, "TETHER_STATE_DIR": str(self.state_dir)}
        done = subprocess.run([self.python, str(STACK_SCRIPT), *args, "--json"], env=env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=300)
        try:
            report = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            raise BenchError(f"stack.py {' '.join(args)} printed no JSON (exit {done.returncode}): "
                             f"{done.stdout}{done.stderr}") from None
        if done.returncode != 0:
            raise BenchError(f"stack.py {' '.join(args)} failed: {report.get('error') or done.stderr}")
        return report

    def pid(self, component: str) -> int | None:
        info = self._stack("status", component)[component]
        return info.get("pid") if info.get("state") == "running" else None

    def require_ours(self, component: str) -> int:
        """The PID of the component this state dir started; BenchError if it did not start one."""
        pid = self.pid(component)
        if pid is None:
            raise BenchError(f"{component} was not started from {self.state_dir} (make up with this TETHER_STATE_DIR); "
                             "chaos restarts only a server its own stack started")
        return pid

    def restart(self, component: str, *, down_s: float = 0.0) -> dict[str, float]:
        """Stop the component (by its recorded PID), wait `down_s`, start it again; returns timings."""
        began = time.monotonic()
        stopped = self._stack("down", component)[component]
        if not stopped.get("stopped"):
            raise BenchError(f"{component}: stack.py down stopped nothing (not started from {self.state_dir})")
        stop_s = time.monotonic() - began
        time.sleep(down_s)
        started = self._stack("up", component)[component]
        return {"pid_before": stopped["pid"], "pid_after": started["pid"], "stop_s": round(stop_s, 2),
                "down_s": round(time.monotonic() - began, 2)}
