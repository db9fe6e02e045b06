"""Executor for executor_kind 'sandbox': a script the model wrote, run in a fresh bubblewrap sandbox.

The sandbox (tether_security.SandboxRunner) has no network, a read-only system, a private
size-capped work dir and /tmp, uid 65534, an empty environment (no secrets), rlimits on CPU,
memory, processes and file size, and a wall clock the parent enforces. The script's exit status
and output are the result (a non-zero exit is a result the model can act on, with `limit_hit`
naming a limit its stderr mentions, e.g. a MemoryError it met and exited on); a limit the sandbox
enforced (time, CPU, memory, processes, output) or a signal is a tool error.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tether_security import (
    InvalidSandboxRequest,
    SandboxErrorCode,
    SandboxLimits,
    SandboxRunner,
    SandboxSetupError,
    SandboxUnavailable,
)
from tether_tool_gateway.domain.errors import ToolError, tail_of
from tether_tool_gateway.ports import ExecutionRequest, SecretProvider

#: The sandbox must give up before the gateway's own timeout for the tool does.
_WALL_MARGIN_S = 1.0
_LIMIT_FIELDS = {f.name for f in dataclasses.fields(SandboxLimits)}


class SandboxExecutor:
    """Runs `args[<script_arg>]` with the config's `interpreter` (e.g. ["/usr/bin/python3"]).

    Config (ToolSpec.executor_config_json): `interpreter` (argv list, default /bin/sh -eu),
    `script_arg` (default "code"), `stdin_arg` (optional), `limits` (SandboxLimits fields).
    """

    def __init__(self, runner: SandboxRunner) -> None:
        self._runner = runner

    def execute(self, request: ExecutionRequest, secrets: SecretProvider) -> Any:
        try:
            config = json.loads(request.tool.executor_config_json)
        except json.JSONDecodeError as exc:
            raise ToolError("EXECUTOR_UNAVAILABLE", f"executor_config_json is not JSON: {exc.msg}") from exc
        overrides = config.get("limits", {})
        unknown = set(overrides) - _LIMIT_FIELDS
        if unknown:
            raise ToolError("EXECUTOR_UNAVAILABLE", f"unknown sandbox limits {sorted(unknown)}")
        limits = dataclasses.replace(self._runner.limits, **overrides)
        wall = max(1.0, min(limits.wall_seconds, request.timeout_s - _WALL_MARGIN_S))
        limits = dataclasses.replace(limits, wall_seconds=wall)
        script = request.args.get(config.get("script_arg", "code"))
        if not isinstance(script, str):
            raise ToolError("TOOL_ERROR", "the script argument must be a string")
        stdin_arg = config.get("stdin_arg")
        stdin = request.args.get(stdin_arg, "").encode() if stdin_arg else None
        interpreter = tuple(config.get("interpreter", ("/bin/sh", "-eu")))
        try:
            result = self._runner.run_script(script, interpreter=interpreter, stdin=stdin, limits=limits)
        except (SandboxUnavailable, SandboxSetupError) as exc:
            # Never run unsandboxed: the call fails and says why.
            raise ToolError("EXECUTOR_UNAVAILABLE", f"sandbox unavailable: {exc}") from exc
        except InvalidSandboxRequest as exc:
            raise ToolError("TOOL_ERROR", f"invalid sandbox request: {exc}") from exc
        if result.error_code is None or result.error_code is SandboxErrorCode.NONZERO_EXIT:
            out = {
                "exit_code": result.exit_code,
                "stdout": result.stdout.decode("utf-8", errors="replace"),
                "stderr": result.stderr.decode("utf-8", errors="replace"),
                "stdout_truncated": result.stdout_truncated,
                "stderr_truncated": result.stderr_truncated,
                "duration_ms": int(result.duration_seconds * 1000),
            }
            if result.limit_hit:
                # Only a hint (read from stderr): the script may have met a limit and exited on it itself,
                # so the model should make it use less rather than just run it again.
                out["limit_hit"] = result.limit_hit
            return out
        code = "TIMEOUT" if result.error_code is SandboxErrorCode.TIMEOUT else "TOOL_ERROR"
        detail = (f"sandbox {result.error_code.value}"
                  + (f" (limit: {result.limit_hit})" if result.limit_hit else "")
                  + (f", signal {result.killed_by_signal}" if result.killed_by_signal else ""))
        # The stderr tail whole: the runner redacts it, then keeps its end.
        tail = tail_of(result.stderr, cut=False)
        # Re-running code that hit a limit hits it again; the model should change the code.
        raise ToolError(code, detail + ("; stderr: " if tail else ""), retryable=False, tail=tail)
