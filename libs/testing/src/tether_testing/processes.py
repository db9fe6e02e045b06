"""Real service processes for e2e and durability tests: start `python -m <module>`, wait for /healthz, kill, restart."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


class ServiceFailed(Exception):
    """A service process exited or never became healthy; carries the tail of its log."""

    def __init__(self, name: str, problem: str, log_path: Path) -> None:
        self.name, self.problem, self.log_path = name, problem, log_path
        super().__init__(f"{name}: {problem}; last lines of {log_path}:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join(f"    {line}" for line in text[-lines:]) or "    (empty log)"


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in the process group, from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command name: state, ppid, pgrp.
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(entry.name))
    return members


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, for a server to listen on.

    Picked at random below the kernel's ephemeral range: the ephemeral ports are what outgoing
    connections (many, on a machine running Kafka clients) take as their local port, and a server
    asked to listen on one of those fails to bind.
    """
    high = _ephemeral_low() - 1
    for _ in range(200):
        port = random.randint(min(20000, high - 1000), high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """One service run as a real OS process: `python -m module`, output appended to `log_path`.

    Healthy means `GET http://127.0.0.1:<health_port><health_path>` returns 200. `kill` signals the
    PID (SIGKILL by default: a crash); `restart` starts it again with the same command and env.
    `stop` (also the context-manager exit) always leaves nothing running, children included.
    """

    def __init__(
        self,
        module: str,
        *,
        health_port: int,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        name: str | None = None,
        python: str = sys.executable,
        health_path: str = "/healthz",
        cwd: Path | None = None,
    ) -> None:
        self.module = module
        self.name = name or module
        self.health_url = f"http://127.0.0.1:{health_port}{health_path}"
        self.log_path = Path(log_dir) / f"{self.name}.log"
        self._argv = [python, "-m", module, *args]
        # Unbuffered, so the log holds everything up to the moment of a kill.
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None
        self._swept = True
        self.starts = 0

    # -- state ---------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """PID of the current (or last) incarnation."""
        if self._proc is None:
            raise ServiceFailed(self.name, "was never started", self.log_path)
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit status of the last incarnation (negative: killed by that signal), None while running."""
        return None if self._proc is None else self._proc.poll()

    def log_text(self) -> str:
        """Everything every incarnation wrote to stdout/stderr so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> ServiceProcess:
        """Start the process and return once it is healthy; raise ServiceFailed otherwise."""
        if self.running:
            raise ServiceFailed(self.name, f"already running as pid {self.pid}", self.log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- start #{self.starts}: {' '.join(self._argv)}\n".encode())
            log.flush()
            # Its own session: a signal to the test runner's group never reaches it by accident,
            # and teardown can sweep the whole group (the service's own children).
            self._proc = subprocess.Popen(
                self._argv, env=self._env, cwd=self._cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            self._swept = False
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Poll the health endpoint until it answers 200, the process exits, or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if not self.running:
                raise ServiceFailed(self.name, f"exited with status {self.returncode} before it was healthy",
                                    self.log_path)
            if time.monotonic() > deadline:
                raise ServiceFailed(self.name, f"{self.health_url} did not return 200 within {timeout:.0f}s",
                                    self.log_path)
            time.sleep(0.1)

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int:
        """Send `sig` to the PID and wait for the process to exit; return its exit status."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise ServiceFailed(self.name, "is not running", self.log_path)
        os.kill(proc.pid, sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ServiceFailed(self.name, f"did not exit within {timeout:.0f}s of signal {sig}",
                                self.log_path) from None

    def restart(self, timeout: float = 60.0) -> ServiceProcess:
        """Stop the process if it still runs (SIGTERM), then start a new one with the same command."""
        self.stop()
        return self.start(timeout)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; then sweep its process group. Idempotent."""
        proc = self._proc
        if proc is None or self._swept:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Children the service started (same session and group, pgid == its pid) must not outlive it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._swept = True

    def __enter__(self) -> ServiceProcess:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServiceProcesses:
    """Starts ServiceProcess instances with logs under one directory and stops all of them on `stop_all`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._all: list[ServiceProcess] = []

    def start(self, module: str, *, health_port: int, timeout: float = 60.0, **kwargs) -> ServiceProcess:
        """Start `python -m module` (see ServiceProcess for kwargs) and wait until it is healthy."""
        service = ServiceProcess(module, health_port=health_port, log_dir=self.log_dir, **kwargs)
        self._all.append(service)
        return service.start(timeout)

    def stop_all(self) -> None:
        for service in reversed(self._all):
            service.stop()
        self._all.clear()
