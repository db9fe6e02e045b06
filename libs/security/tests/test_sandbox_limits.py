"""Limits of a whole sandbox against the real bubblewrap: memory no rlimit sees, CPU summed over forks, and
what a failing command's stderr may (and may not) say about a limit."""

from __future__ import annotations

import json
import signal
import textwrap

import pytest

from tether_security.sandbox import SandboxErrorCode, SandboxLimits, SandboxRunner

pytestmark = pytest.mark.integration

PY = ("/usr/bin/python3",)


@pytest.fixture(scope="module")
def runner() -> SandboxRunner:
    r = SandboxRunner(limits=SandboxLimits(wall_seconds=20, cpu_seconds=10, memory_bytes=256 << 20))
    r.probe()
    return r


# Memory written to a memfd (or a SysV segment) and never mapped is in no address space: RLIMIT_AS
# does not count it. Each probe tries to hold 3 × memory_bytes that way and says how much it held.
_UNMAPPED_MEMORY = textwrap.dedent("""
    import ctypes, json, os
    limit_mib = 32
    held = {"memfd": 0, "shm": 0}
    errors = {}
    fds = []
    try:
        for _ in range(4):  # several, each under RLIMIT_FSIZE
            fds.append(os.memfd_create("hold"))
            for _ in range(3 * limit_mib // 4):
                os.write(fds[-1], b"\\1" * (1 << 20))
                held["memfd"] += 1
    except OSError as e:
        errors["memfd"] = e.errno
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    for _ in range(12):  # segments of a quarter of the limit, each mapped alone
        sid = libc.shmget(0, limit_mib << 18, 0o1600)
        if sid < 0:
            errors["shm"] = ctypes.get_errno()
            break
        addr = libc.shmat(sid, None, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            errors["shmat"] = ctypes.get_errno()
            break
        ctypes.memset(addr, 1, limit_mib << 18)
        libc.shmdt(ctypes.c_void_p(addr))  # unmapped: out of the address space, still held
        held["shm"] += limit_mib // 4
    print(json.dumps({"held_mib": held, "errno": errors}))
""")


def test_memory_outside_any_address_space_is_refused(runner: SandboxRunner) -> None:
    result = runner.run_script(_UNMAPPED_MEMORY, interpreter=PY,
                               limits=SandboxLimits(wall_seconds=20, memory_bytes=32 << 20))
    assert result.ok, (result.error_code, result.stderr[-500:])
    out = json.loads(result.stdout)
    # ENOSYS, as from a kernel without the calls: the program may fall back, nothing is held.
    assert out["errno"] == {"memfd": 38, "shm": 38}
    assert out["held_mib"] == {"memfd": 0, "shm": 0}


# Four children, each under the per-process RLIMIT_CPU (2 s), together well over it.
_FORKED_BURNERS = textwrap.dedent("""
    import os, sys, time
    kids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            start = time.process_time()
            while time.process_time() - start < 1.5:
                pass
            os._exit(0)
        kids.append(pid)
    for k in kids:
        os.waitpid(k, 0)
    print("all done", flush=True)
""")
_CPU_LIMIT = SandboxLimits(wall_seconds=30, cpu_seconds=2)


def test_cpu_of_forked_processes_counts_together(runner: SandboxRunner) -> None:
    result = runner.run_script(_FORKED_BURNERS, interpreter=PY, limits=_CPU_LIMIT)
    assert result.error_code is SandboxErrorCode.CPU_LIMIT, (result.error_code, result.cpu_seconds, result.stdout)
    assert result.limit_hit == "cpu"
    assert not result.timed_out
    assert result.killed_by_signal == signal.SIGKILL  # by the parent, not by any one process's RLIMIT_CPU
    assert b"all done" not in result.stdout
    assert result.cpu_seconds >= _CPU_LIMIT.cpu_seconds


def test_a_live_sandbox_is_killed_when_its_processes_together_reach_the_cpu_limit(runner: SandboxRunner) -> None:
    with runner.start(["/usr/bin/python3", "-c", _FORKED_BURNERS], limits=_CPU_LIMIT) as proc:
        end = proc.wait(timeout=25)
    assert end is not None
    assert end.cpu_limit_hit and end.killed, end
    assert not end.timed_out
    assert end.exit_code is None and end.killed_by_signal == signal.SIGKILL
    assert end.cpu_seconds >= _CPU_LIMIT.cpu_seconds


def test_a_live_sandbox_under_the_cpu_limit_ends_by_itself(runner: SandboxRunner) -> None:
    with runner.start(["/bin/sh", "-c", "exit 3"], limits=_CPU_LIMIT) as proc:
        end = proc.wait(timeout=15)
    assert end is not None
    assert (end.exit_code, end.cpu_limit_hit, end.killed) == (3, False, False)


def test_a_limit_named_on_stderr_of_a_normal_exit_is_only_a_hint(runner: SandboxRunner) -> None:
    # A log line is not a limit: the command exited by itself, its output is its result.
    memory = runner.run(["/bin/sh", "-c",
                         "echo 'sort: Cannot allocate memory? no: a log line' >&2; echo useful output; exit 1"])
    assert (memory.error_code, memory.exit_code, memory.limit_hit) == (SandboxErrorCode.NONZERO_EXIT, 1, "memory")
    assert memory.stdout == b"useful output\n"
    forks = runner.run_script("import sys\nprint('partial result')\nsys.exit('BlockingIOError: retried, gave up')\n",
                              interpreter=PY)
    assert (forks.error_code, forks.exit_code, forks.limit_hit) == (SandboxErrorCode.NONZERO_EXIT, 1, "processes")
    assert forks.stdout == b"partial result\n"
    # A MemoryError under RLIMIT_AS is the same: the program met the limit and ended itself.
    handled = runner.run_script("print('before')\nx = bytearray(1 << 30)\n", interpreter=PY,
                                limits=SandboxLimits(wall_seconds=10, memory_bytes=128 << 20))
    assert (handled.error_code, handled.exit_code, handled.limit_hit) == (SandboxErrorCode.NONZERO_EXIT, 1, "memory")
    assert handled.stdout == b"before\n" and b"MemoryError" in handled.stderr


def test_a_command_a_signal_ended_after_an_allocation_failed_hit_the_memory_limit(runner: SandboxRunner) -> None:
    # What a C++ program does when `new` fails under RLIMIT_AS: print, then abort.
    result = runner.run(["/bin/sh", "-c", "echo \"terminate called after throwing an instance of "
                         "'std::bad_alloc'\" >&2; kill -ABRT $$"])
    assert (result.error_code, result.limit_hit) == (SandboxErrorCode.MEMORY_LIMIT, "memory")
    assert result.killed_by_signal == signal.SIGABRT
