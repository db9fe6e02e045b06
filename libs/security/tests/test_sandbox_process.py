"""SandboxRunner.start against the real bubblewrap: a live sandboxed process, its pipes, its wall clock and its kill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from tether_security.sandbox import InvalidSandboxRequest, SandboxLimits, SandboxRunner

pytestmark = pytest.mark.integration

SHORT = SandboxLimits(wall_seconds=10, cpu_seconds=5, memory_bytes=512 << 20, max_processes=32)


@pytest.fixture(scope="module")
def runner() -> SandboxRunner:
    r = SandboxRunner(limits=SHORT)
    r.probe()
    return r


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_until_gone(marker: str, within_s: float = 5.0) -> list[int]:
    end = time.monotonic() + within_s
    left = processes_with(marker)
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = processes_with(marker)
    return left


def read_line(fd: int, timeout_s: float = 10.0) -> bytes:
    """Read up to a newline (bounded in time: a test must fail, not hang)."""
    out = bytearray()
    end = time.monotonic() + timeout_s
    os.set_blocking(fd, False)
    while not out.endswith(b"\n"):
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            if time.monotonic() > end:
                raise TimeoutError(f"no line within {timeout_s}s; got {bytes(out)!r}") from None
            time.sleep(0.01)
            continue
        if not chunk:
            break
        out += chunk
    return bytes(out)


def test_a_live_process_talks_over_its_pipes_and_close_kills_it(runner: SandboxRunner) -> None:
    proc = runner.start(["/bin/sh", "-c", "while read -r line; do echo \"got $line\"; done"])
    with proc:
        for word in ("one", "two"):
            os.write(proc.stdin_fd, word.encode() + b"\n")
            assert read_line(proc.stdout_fd) == f"got {word}\n".encode()
        assert proc.exit is None  # still running between messages
    end = proc.exit
    assert end is not None and end.killed and not end.timed_out and end.killed_by_signal == signal.SIGKILL


def test_the_sandbox_is_the_same_as_runs(runner: SandboxRunner) -> None:
    # uid 65534, no network interface but loopback, an empty environment besides PATH/HOME/LANG.
    script = "id -u; cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; env | sort | cut -d= -f1"
    with runner.start(["/bin/sh", "-c", script]) as proc:
        end = proc.wait(10)
        out = os.read(proc.stdout_fd, 65536).decode().split()
    assert end is not None and end.exit_code == 0, end
    assert out[0] == "65534"
    assert out[1] == "lo"
    assert set(out[2:]) <= {"HOME", "LANG", "PATH", "PWD", "SHLVL", "_"}


def test_env_reaches_the_command_and_no_command_line(runner: SandboxRunner) -> None:
    value = f"tok-{uuid.uuid4().hex}"
    with runner.start(["/bin/sh", "-c", "echo \"$TEAM_TOKEN\"; read -r _"], env={"TEAM_TOKEN": value}) as proc:
        assert read_line(proc.stdout_fd) == value.encode() + b"\n"
        # While it runs, no process on the host shows the value in its arguments.
        assert processes_with(value) == []


def test_the_wall_clock_kills_a_silent_command_and_leaves_nothing(runner: SandboxRunner) -> None:
    marker = f"{uuid.uuid4().int % 10**6}.1357"
    script = f"setsid sleep {marker} & sleep {marker}"
    started = time.monotonic()
    with runner.start(["/bin/sh", "-c", script], limits=SandboxLimits(wall_seconds=1)) as proc:
        # The caller blocks on stdout; the watcher's kill at the deadline ends the read with EOF.
        assert os.read(proc.stdout_fd, 100) == b""
        end = proc.wait(10)
    assert time.monotonic() - started < 8
    assert end is not None and end.timed_out and end.killed and end.killed_by_signal == signal.SIGKILL
    assert wait_until_gone(marker) == []


def test_exit_code_and_stderr_tail_of_a_command_that_ends(runner: SandboxRunner) -> None:
    with runner.start(["/bin/sh", "-c", "head -c 20000 /dev/zero | tr '\\0' e >&2; echo last >&2; exit 3"]) as proc:
        end = proc.wait(10)
    assert end is not None and (end.exit_code, end.killed, end.setup_failed) == (3, False, False)
    assert end.stderr_bytes == 20005 and end.stderr_tail.endswith(b"eeelast\n") and len(end.stderr_tail) == 8192


def test_a_command_killed_by_a_signal_inside(runner: SandboxRunner) -> None:
    with runner.start(["/bin/sh", "-c", "kill -SEGV $$"]) as proc:
        end = proc.wait(10)
    assert end is not None and end.killed_by_signal == signal.SIGSEGV and not end.killed


def test_read_only_paths_are_readable_not_writable(runner: SandboxRunner) -> None:
    shared = Path(tempfile.mkdtemp(prefix="tether-sbx-ro-"))
    try:
        shared.chmod(0o755)
        (shared / "server.txt").write_text("served\n")
        (shared / "server.txt").chmod(0o644)
        script = f"cat {shared}/server.txt; echo x > {shared}/new 2>/dev/null || echo refused"
        with runner.start(["/bin/sh", "-c", script], read_only_paths=[str(shared)]) as proc:
            end = proc.wait(10)
            out = os.read(proc.stdout_fd, 1000)
        assert end is not None and end.exit_code == 0
        assert out == b"served\nrefused\n"
        assert not (shared / "new").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_setup_failure_is_reported_as_such(runner: SandboxRunner) -> None:
    with runner.start(["/bin/true"], read_only_paths=[f"/nonexistent-{uuid.uuid4().hex}"]) as proc:
        end = proc.wait(10)
    assert end is not None and end.setup_failed and b"Can't find source path" in end.stderr_tail


def test_kill_from_another_thread_ends_a_blocked_read(runner: SandboxRunner) -> None:
    with runner.start(["/bin/cat"]) as proc:
        threading.Timer(0.3, proc.kill).start()
        assert os.read(proc.stdout_fd, 100) == b""
        end = proc.wait(10)
    assert end is not None and end.killed and not end.timed_out


def test_everything_dies_with_the_parent() -> None:
    marker = f"{uuid.uuid4().int % 10**6}.2468"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from tether_security.sandbox import SandboxLimits, SandboxRunner
        proc = SandboxRunner(limits=SandboxLimits(wall_seconds=60)).start(
            ["/bin/sh", "-c", "setsid sleep {marker} & sleep {marker}"])
        time.sleep(60)
    """)])
    try:
        end = time.monotonic() + 20
        while len(processes_with(f"sleep\0{marker}")) < 2 and time.monotonic() < end and parent.poll() is None:
            time.sleep(0.02)
        assert len(processes_with(f"sleep\0{marker}")) == 2, "the sandboxed sleeps never started"
    finally:
        parent.kill()
        parent.wait()
    assert wait_until_gone(marker) == []


def test_rejects_bad_requests(runner: SandboxRunner) -> None:
    with pytest.raises(InvalidSandboxRequest):
        runner.start([])
    with pytest.raises(InvalidSandboxRequest):
        runner.start("/bin/true")  # type: ignore[arg-type]
    with pytest.raises(InvalidSandboxRequest, match="absolute"):
        runner.start(["/bin/true"], read_only_paths=["relative/path"])
    with pytest.raises(InvalidSandboxRequest, match="name"):
        runner.start(["/bin/true"], env={"BAD-NAME": "x"})
