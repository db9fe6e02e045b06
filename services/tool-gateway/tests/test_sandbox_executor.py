"""The sandbox executor on the real bubblewrap sandbox: results, limits as tool errors, no network, no secrets."""

from __future__ import annotations

import shutil

import pytest

from tether_security import SandboxLimits, SandboxRunner
from tether_tool_gateway.builtin_tools import sandbox_code_spec
from tether_tool_gateway.domain.errors import ToolError
from tether_tool_gateway.executors.sandbox import SandboxExecutor
from tether_tool_gateway.ports import ExecutionRequest, MappingSecretProvider

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

SECRET = "sk-live-SANDBOX-CANARY-91c2"


def run(code: str, *, limits: dict | None = None, stdin: str | None = None, timeout_ms: int = 20_000,
        runner: SandboxRunner | None = None):
    tool = sandbox_code_spec(timeout_ms=timeout_ms, limits=limits)
    args = {"code": code} if stdin is None else {"code": code, "stdin": stdin}
    request = ExecutionRequest(tool=tool, args=args, idem_key="k" * 64, run_id="r", tenant_id="t", call_id="1.0",
                               attempt=1, timeout_s=timeout_ms / 1000)
    executor = SandboxExecutor(runner or SandboxRunner(limits=SandboxLimits(wall_seconds=15)))
    return executor.execute(request, MappingSecretProvider({"api/key": SECRET}))


def test_a_script_runs_and_its_output_is_the_result():
    out = run("import sys; print(sum(range(10))); print(sys.stdin.read().upper(), file=sys.stderr)", stdin="hi")
    assert out["exit_code"] == 0 and out["stdout"] == "45\n" and out["stderr"] == "HI\n"


def test_a_failing_script_is_a_result_the_model_can_fix():
    out = run("raise SystemExit(3)")
    assert out["exit_code"] == 3


def test_no_network_and_no_secrets_inside():
    out = run("import os, socket\n"
              "print(sorted(os.environ))\n"
              "s = socket.socket()\n"
              "s.settimeout(2)\n"
              "try:\n    s.connect(('1.1.1.1', 80)); print('connected')\n"
              "except OSError as e:\n    print('blocked', e.errno)\n")
    assert "blocked" in out["stdout"] and "connected" not in out["stdout"]
    assert SECRET not in out["stdout"] and "TETHER" not in out["stdout"]


def test_a_script_that_exits_on_a_memory_error_is_a_result_with_the_limit_as_a_hint():
    # It ended by itself (Python raised MemoryError under RLIMIT_AS): its output is kept, and
    # limit_hit tells the model which limit it met.
    out = run("x = bytearray(2 << 30)", limits={"memory_bytes": 256 << 20, "max_processes": 32})
    assert out["exit_code"] == 1 and "MemoryError" in out["stderr"] and out["limit_hit"] == "memory"


def test_a_fork_bomb_that_keeps_forking_is_a_process_limit_tool_error():
    # Its processes stay until the wall clock, so the runner's sampling sees them at the limit.
    with pytest.raises(ToolError) as err:
        run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            limits={"memory_bytes": 256 << 20, "max_processes": 32, "wall_seconds": 4, "cpu_seconds": 60})
    assert err.value.code == "TOOL_ERROR" and "PROCESS_LIMIT" in err.value.detail and not err.value.retryable


def test_a_fork_bomb_that_dies_on_its_first_failed_fork_is_contained_either_way():
    # Each process exits on the BlockingIOError of its first refused fork, so the tree can be gone
    # between two samples of the runner (a CI run saw no peak): then it is a script that exited by
    # itself, non-zero, its output a result with the limit as a hint; if sampled at the limit, a
    # PROCESS_LIMIT tool error. Never a success, never unbounded.
    try:
        out = run("import os\nwhile True:\n    os.fork()", limits={"memory_bytes": 256 << 20, "max_processes": 32})
    except ToolError as err:
        assert err.code == "TOOL_ERROR" and "PROCESS_LIMIT" in err.detail and not err.retryable
    else:
        assert out["exit_code"] != 0 and out["limit_hit"] == "processes" and "BlockingIOError" in out["stderr"], out


def test_an_endless_loop_ends_at_the_wall_clock_before_the_gateway_gives_up():
    with pytest.raises(ToolError) as err:
        run("while True: pass", limits={"cpu_seconds": 60, "wall_seconds": 2}, timeout_ms=10_000)
    assert err.value.code == "TIMEOUT" and "sandbox TIMEOUT" in err.value.detail


def test_without_a_working_sandbox_nothing_runs():
    with pytest.raises(ToolError) as err:
        run("print(1)", runner=SandboxRunner(bwrap="/bin/false"))  # bubblewrap that cannot build anything
    assert err.value.code == "EXECUTOR_UNAVAILABLE"
