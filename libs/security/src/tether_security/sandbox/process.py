"""A command running inside the sandbox as a live process: pipes to its stdin and stdout, a wall clock, a kill."""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

#: How much of the command's stderr is kept (the end of it) to say why it failed.
STDERR_TAIL_BYTES = 8192
_READ_CHUNK = 65536
# The wrapper chain exits within milliseconds of bwrap; this is how long the watcher waits for
# it after the sandbox's pipes closed before killing it too.
_REAP_GRACE_S = 2.0
# How often a watcher samples the sandbox's tasks and CPU.
TICK_S = 0.05
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class SandboxExit:
    """How a live sandboxed process ended."""

    exit_code: int | None  # the command's exit status; None when it died by a signal or never ran
    killed_by_signal: int | None  # the signal that ended the command (SIGKILL when the parent killed it)
    timed_out: bool  # killed at the wall-clock limit
    killed: bool  # ended by the parent (kill(), close(), or the wall clock), not by itself
    setup_failed: bool  # bubblewrap exited before running the command (stderr says why)
    stderr_tail: bytes  # the last STDERR_TAIL_BYTES of what the command wrote to stderr
    stderr_bytes: int  # how much it wrote to stderr in all
    duration_seconds: float
    # Killed by the parent when the sandbox's processes together had used `cpu_seconds` of CPU
    # (RLIMIT_CPU alone bounds each process, and every fork gets its own allowance).
    cpu_limit_hit: bool = False
    cpu_seconds: float = 0.0  # user+system CPU of the sandbox's processes, sampled every TICK_S


class SandboxedProcess:
    """A command in a fresh sandbox (SandboxRunner.start), alive until it exits, is killed, or runs out of time.

    `stdin_fd` and `stdout_fd` are the parent's ends of the command's pipes (blocking; the caller
    may make them non-blocking); stderr is drained by a watcher thread that keeps its tail. The
    same thread enforces the wall clock: at `wall_seconds` after the start it kills the sandbox,
    whatever the caller is doing; and, given `cpu_seconds`, the CPU of all the sandbox's processes
    together, sampled every TICK_S (`exit.cpu_limit_hit`). `kill()` kills the whole sandbox (the
    wrapper chain and bwrap share one process group, and bwrap's death takes every process of its
    PID namespace). Use it as a context manager, or call `close()`: that kills what is left and
    releases every descriptor, on success, error and cancellation alike.
    """

    def __init__(self, popen: subprocess.Popen[bytes], *, status_fd: int, argv: tuple[str, ...],
                 wall_seconds: float, started: float, cpu_seconds: float | None = None,
                 namespace_hops: int = 1) -> None:
        if popen.stdin is None or popen.stdout is None or popen.stderr is None:
            raise ValueError("the sandboxed process must be started with pipes on stdin, stdout and stderr")
        self.argv = argv
        self._popen = popen
        self._stdin = popen.stdin
        self._stdout = popen.stdout
        self._stderr = popen.stderr
        self._status_fd = status_fd
        self._started = started
        self._deadline = started + wall_seconds
        self._cpu_seconds = cpu_seconds
        self._namespace_hops = namespace_hops
        self._cpu_exceeded = False
        self._lock = threading.Lock()
        self._reaped = False
        self._killed = False
        self._timed_out = False
        self._exit: SandboxExit | None = None
        self._done = threading.Event()
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name=f"sandbox-watch-{popen.pid}", daemon=True)
        self._watcher.start()

    @property
    def pid(self) -> int:
        """The host PID of the sandbox's outermost process (the leader of its process group)."""
        return self._popen.pid

    @property
    def stdin_fd(self) -> int:
        return self._stdin.fileno()

    @property
    def stdout_fd(self) -> int:
        return self._stdout.fileno()

    @property
    def exit(self) -> SandboxExit | None:
        """How it ended, once it has (and its processes are reaped); None while it runs."""
        return self._exit

    def kill(self) -> None:
        """SIGKILL every process of the sandbox. Safe from any thread, and after the end (then a no-op)."""
        with self._lock:
            if self._reaped:
                return  # the process group may be gone and its id reused: never signal it again
            self._killed = True
            try:
                os.killpg(self._popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> SandboxExit | None:
        """Block until the sandbox is gone (None if `timeout` passes first)."""
        self._done.wait(timeout)
        return self._exit

    def close(self) -> SandboxExit | None:
        """Kill what is left of the sandbox, wait for it, and close the pipes. Idempotent."""
        self.kill()
        self._watcher.join(timeout=_REAP_GRACE_S + 5)
        if not self._closed:
            self._closed = True
            for pipe in (self._stdin, self._stdout):
                try:
                    pipe.close()
                except OSError:
                    pass  # a write end whose reader is gone may fail to flush; nothing is lost
        return self._exit

    def __enter__(self) -> SandboxedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the watcher -----------------------------------------------------------------------------

    def _watch(self) -> None:
        tail = bytearray()
        stderr_total = 0
        status = bytearray()
        sel = selectors.DefaultSelector()
        sel.register(self._stderr, selectors.EVENT_READ, "stderr")
        sel.register(self._status_fd, selectors.EVENT_READ, "status")
        pid_ns: int | None = None
        cpu_ticks: dict[int, int] = {}
        try:
            # Both pipes end when bwrap and everything in its namespace are gone.
            while sel.get_map():
                now = time.monotonic()
                if now >= self._deadline and not self._killed:
                    self._timed_out = True
                    self.kill()
                if self._cpu_seconds is not None and not self._killed:
                    if pid_ns is None and json_documents(bytes(status)):
                        # bwrap has forked the sandbox's init: the wrapper chain is stable now.
                        pid_ns = sandbox_pid_namespace(self._popen.pid, hops=self._namespace_hops)
                    if pid_ns is not None:
                        sample_namespace(pid_ns, cpu_ticks)
                        if sum(cpu_ticks.values()) / CLK_TCK >= self._cpu_seconds:
                            self._cpu_exceeded = True
                            self.kill()
                if self._killed:
                    timeout = 1.0
                else:
                    timeout = max(0.0, self._deadline - now)
                    if self._cpu_seconds is not None:
                        timeout = min(timeout, TICK_S)
                for key, _ in sel.select(timeout=timeout):
                    fd = key.fd
                    try:
                        chunk = os.read(fd, _READ_CHUNK)
                    except OSError as exc:
                        if exc.errno == errno.EINTR:
                            continue
                        chunk = b""
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data == "status":
                        status += chunk
                    else:
                        stderr_total += len(chunk)
                        tail += chunk
                        del tail[:-STDERR_TAIL_BYTES]
            rc = self._reap()
        finally:
            sel.close()
            self._stderr.close()
            os.close(self._status_fd)
        self._exit = _exit_of(rc, bytes(status), killed=self._killed, timed_out=self._timed_out,
                              cpu_exceeded=self._cpu_exceeded, stderr_tail=bytes(tail), stderr_bytes=stderr_total,
                              duration=time.monotonic() - self._started, cpu=sum(cpu_ticks.values()) / CLK_TCK)
        self._done.set()

    def _reap(self) -> int:
        reap_by = time.monotonic() + _REAP_GRACE_S
        while True:
            with self._lock:
                rc = self._popen.poll()
                if rc is not None:
                    self._reaped = True
                    return rc
            if time.monotonic() > reap_by:
                self.kill()
            time.sleep(0.01)


def _exit_of(rc: int, status: bytes, *, killed: bool, timed_out: bool, cpu_exceeded: bool, stderr_tail: bytes,
             stderr_bytes: int, duration: float, cpu: float) -> SandboxExit:
    exit_doc = next((d["exit-code"] for d in json_documents(status) if "exit-code" in d), None)
    exit_code: int | None = None
    sig: int | None = None
    setup_failed = False
    if exit_doc is not None:  # the command ended by itself (bwrap reports it before it exits)
        if 128 < exit_doc < 128 + 65:
            sig = exit_doc - 128  # bwrap reports a command killed by signal N as 128+N, as shells do
        else:
            exit_code = exit_doc
    elif rc < 0:
        sig = -rc  # killed (by the parent) before the command ended
    else:
        setup_failed = True  # bwrap gave up before the command started
    # A kill that came after the command had ended by itself (bwrap had reported its status) did not end it.
    ended_by_itself = exit_doc is not None
    return SandboxExit(exit_code=exit_code, killed_by_signal=sig, timed_out=timed_out and not ended_by_itself,
                       killed=killed and not ended_by_itself,
                       setup_failed=setup_failed, stderr_tail=stderr_tail, stderr_bytes=stderr_bytes,
                       duration_seconds=duration, cpu_limit_hit=cpu_exceeded and not ended_by_itself,
                       cpu_seconds=cpu)


def sandbox_pid_namespace(root_pid: int, *, hops: int) -> int | None:
    """Inode of the sandbox's PID namespace: that of bwrap's init, `hops` first-children below `root_pid`.

    bwrap's own JSON status cannot say: it runs inside the wrapper's PID namespace and cannot
    see itself in the host's /proc.
    """
    pid = root_pid
    try:
        for _ in range(hops):
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = f.read().split()
            if not children:
                return None
            pid = int(children[0])
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def sample_namespace(pid_ns_inode: int, cpu_ticks: dict[int, int]) -> int:
    """Count tasks (threads included, as RLIMIT_NPROC counts them) in a PID namespace; note each process's CPU.

    `cpu_ticks` keeps the last utime+stime seen per process, so CPU of processes that have since
    exited still counts (processes that live and die between two samples are missed).
    """
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry.name}/ns/pid").st_ino != pid_ns_inode:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the task exited while we looked
        # Fields after the parenthesised command name: state is field 3, num_threads field 20,
        # utime/stime fields 14/15 (1-based, as in proc(5)).
        rest = stat[stat.rfind(b")") + 2:].split()
        total += int(rest[17])
        cpu_ticks[int(entry.name)] = int(rest[11]) + int(rest[12])
    return total


def json_documents(raw: bytes) -> list[dict]:
    """bwrap's --json-status-fd writes several JSON objects back to back."""
    docs: list[dict] = []
    decoder = json.JSONDecoder()
    text = raw.decode(errors="replace")
    i = 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        try:
            doc, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # a partial document at the end: the rest has not arrived yet
        if isinstance(doc, dict):
            docs.append(doc)
    return docs
