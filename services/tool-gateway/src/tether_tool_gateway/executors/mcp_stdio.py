"""Executor for executor_kind 'mcp_stdio': a tool of an MCP server the gateway runs over stdio, in its sandbox.

Config (ToolSpec.executor_config_json):
  command             the server's argv, run inside the sandbox (e.g. ["/opt/mcp/crm/bin/python", "-m", "crm_mcp"])
  tool                the tool's name on the server
  read_only_paths     host paths bound read-only at the same place (the server's code and runtime); each
                      must lie under one of the gateway's MCP stdio roots (TETHER_GATEWAY_MCP_STDIO_ROOTS)
  env                 the server's environment variables; values may hold `secret://name` handles,
                      resolved at execution time and handed to bwrap on a memfd (never on a command line)
  max_response_bytes  a message from the server larger than this fails the call (default 1 MiB)
  limits              sandbox limits to raise or lower (memory_bytes, cpu_seconds, ...; see executor_config)

Each call starts the server in a fresh sandbox (tether_security.SandboxRunner.start: namespaces, no
network, uid 65534, rlimits, seccomp, a wall clock), speaks MCP to it over its stdin/stdout with the
`mcp` SDK's client session, calls `tools/call` once, and kills the sandbox: nothing a call leaves
behind reaches the next. Errors map as for the streamable HTTP executor (mcp_tool.transport_error),
plus what only a process can do: exit before answering (TOOL_ERROR), be killed at the sandbox's CPU
limit (TOOL_ERROR "CPU_LIMIT", not retryable) or fail to start (EXECUTOR_UNAVAILABLE).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import mcp_types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import Client
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.message import SessionMessage
from mcp_types import CallToolResult

from tether_contracts.records import RiskClass, ToolSpec
from tether_security.sandbox import (
    InvalidSandboxRequest,
    SandboxedProcess,
    SandboxExit,
    SandboxLimits,
    SandboxRunner,
    SandboxSetupError,
    SandboxUnavailable,
)
from tether_tool_gateway.domain.errors import ToolError, head_of, tail_of
from tether_tool_gateway.domain.executor_config import executor_config_problems
from tether_tool_gateway.executors.builtin import _config, resolve_secret_handles
from tether_tool_gateway.executors.mcp_tool import (
    DEFAULT_MAX_RESPONSE_BYTES,
    IDEMPOTENCY_META_KEY,
    InvalidServerOutput,
    McpTool,
    OversizedAnswer,
    ServerAnswer,
    call_result,
    declared_tools,
    refusal_error,
    server_refused,
    tool_specs,
    transport_error,
)
from tether_tool_gateway.ports import ExecutionRequest, SecretProvider

EXECUTOR_KIND = "mcp_stdio"
_DEADLINE_MARGIN_S = 0.25
#: The sandbox's own wall clock is a backstop behind the session's deadline (which ends the call first).
_WALL_BACKSTOP_S = 1.0
_READ_CHUNK = 65536
#: Requests a server may send in one session; past this the session ends (INVALID_RESULT).
MAX_SERVER_REQUESTS = 32
#: Notifications (and answers to nothing the client asked) a server may send in one session; past this the
#: session ends (INVALID_RESULT). A server may log or report progress while it works; a session is one call.
MAX_SERVER_NOTIFICATIONS = 1000

T = TypeVar("T")


@dataclass(frozen=True)
class StdioServer:
    """How to start an MCP server over stdio: the server part of an 'mcp_stdio' executor config."""

    command: tuple[str, ...]
    read_only_paths: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # values may hold secret:// handles
    limits: dict[str, int] = field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        """The executor config's server keys (each imported tool adds its "tool")."""
        out: dict[str, Any] = {"command": list(self.command)}
        if self.read_only_paths:
            out["read_only_paths"] = list(self.read_only_paths)
        if self.env:
            out["env"] = dict(self.env)
        if self.limits:
            out["limits"] = dict(self.limits)
        return out

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> StdioServer:
        return cls(command=tuple(config["command"]), read_only_paths=tuple(config.get("read_only_paths", ())),
                   env=dict(config.get("env", {})), limits=dict(config.get("limits", {})))


class ServerExited(Exception):
    """The server's process ended (or could not be talked to) before it answered."""


# -- the transport: the SDK's streams over a sandboxed process's pipes --------------------------
class SandboxedStdio:
    """MCP over the stdin/stdout of a sandboxed process: newline-delimited JSON-RPC, as the SDK's stdio_client.

    The SDK's `stdio_client` spawns its own process and cannot pass bwrap the descriptors it
    needs, so this is the same two pipe tasks over a process SandboxRunner started. Unlike the
    SDK it is strict: a message longer than `max_message_bytes` (OversizedAnswer), a line that
    is not a JSON-RPC message (InvalidServerOutput; the protocol allows nothing else on stdout),
    more than MAX_SERVER_REQUESTS requests or MAX_SERVER_NOTIFICATIONS notifications from the server
    (InvalidServerOutput) ends the session at once, and `problem` says which; `answer` keeps the
    server's own JSON-RPC error answer to tools/call, if it sent one. `streams()` is the `Transport`
    to hand to `mcp.Client`; leaving it kills the sandbox.
    """

    def __init__(self, process: SandboxedProcess, *, max_message_bytes: int) -> None:
        self.process = process
        self.max_message_bytes = max_message_bytes
        self.problem: Exception | None = None
        #: A tools/call request was written whole to the server's stdin: from then on it may act on it.
        self.call_sent = False
        #: Requests the server sent us (pings: nothing else is offered to it), up to MAX_SERVER_REQUESTS.
        self.server_requests = 0
        #: Notifications, and answers to no request of ours, the server sent us, up to MAX_SERVER_NOTIFICATIONS.
        self.server_notifications = 0
        self.answer = ServerAnswer()
        self._asked: set[mcp_types.RequestId] = set()  # our requests the server has not answered yet

    @asynccontextmanager
    async def streams(self) -> AsyncIterator[tuple[MemoryObjectReceiveStream[SessionMessage | Exception],
                                                   MemoryObjectSendStream[SessionMessage]]]:
        stdin, stdout = self.process.stdin_fd, self.process.stdout_fd
        os.set_blocking(stdin, False)
        os.set_blocking(stdout, False)
        read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

        async def stdout_reader() -> None:
            async with read_writer:
                buffer = bytearray()
                while True:
                    chunk = await _read(stdout)
                    if not chunk:
                        return  # the server is gone: the session sees its stream end
                    scan_from = len(buffer)
                    buffer += chunk
                    while (newline := buffer.find(b"\n", scan_from)) >= 0:
                        line = bytes(buffer[:newline])
                        del buffer[:newline + 1]
                        scan_from = 0
                        if not line.strip():
                            continue
                        message = self._message(line)
                        if message is None:
                            return
                        await read_writer.send(message)
                    if len(buffer) > self.max_message_bytes:
                        self._fail(OversizedAnswer(f"the MCP server sent a message larger than "
                                                   f"{self.max_message_bytes} bytes"))
                        return

        async def stdin_writer() -> None:
            try:
                async with write_reader:
                    async for message in write_reader:
                        data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                        request = message.message if isinstance(message.message, mcp_types.JSONRPCRequest) else None
                        if request is not None:  # noted first: the answer may be read before the write returns
                            self._asked.add(coerce_request_id(request.id))
                            if request.method == "tools/call":
                                self.answer.call_id = request.id
                        await _write_all(stdin, data.encode())
                        if request is not None and request.method == "tools/call":
                            self.call_sent = True
            except OSError:
                # The server closed its stdin (or died): end the session rather than let a request wait.
                await read_writer.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stdout_reader)
            tg.start_soon(stdin_writer)
            try:
                yield read_stream, write_stream
            finally:
                # One session per sandbox: nothing to wind down gracefully, and the pipes end with it.
                self.process.kill()
                tg.cancel_scope.cancel()

    def _message(self, line: bytes) -> SessionMessage | None:
        """The line as a message, or None when it ends the session (too long, not JSON-RPC, one too many)."""
        if len(line) > self.max_message_bytes:
            self._fail(OversizedAnswer(f"the MCP server sent a message larger than {self.max_message_bytes} bytes"))
            return None
        try:
            message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except ValueError:
            shown = head_of(line)  # whole up to a bound: the runner redacts it, then shortens it
            self._fail(InvalidServerOutput(f"the MCP server wrote a line to stdout that is not a JSON-RPC message "
                                           f"(the protocol allows nothing else there): {shown!r}"))
            return None
        if isinstance(message, mcp_types.JSONRPCRequest):
            # The SDK answers each request from the server in a task of its own, which waits on the
            # server's stdin: a server that floods requests and never reads would grow them (and our
            # memory) without bound. The client declares no sampling, roots or elicitation, so only a
            # few pings are the server's to send.
            self.server_requests += 1
            if self.server_requests > MAX_SERVER_REQUESTS:
                self._fail(InvalidServerOutput(f"too many requests from the server (more than {MAX_SERVER_REQUESTS} "
                                               f"in one session; the gateway offers no sampling, roots or "
                                               f"elicitation)"))
                return None
            return SessionMessage(message)
        if isinstance(message, mcp_types.JSONRPCError) and self.answer.answers_call(message.id):
            self.answer.note(message)
        answered = isinstance(message, (mcp_types.JSONRPCResponse, mcp_types.JSONRPCError)) and \
            message.id is not None and coerce_request_id(message.id) in self._asked
        if answered:
            self._asked.discard(coerce_request_id(message.id))
        else:
            # A notification (or an answer to nothing we asked) costs the SDK a task or a log line
            # each: a server that floods them would keep the session busy until the call's timeout.
            self.server_notifications += 1
            if self.server_notifications > MAX_SERVER_NOTIFICATIONS:
                self._fail(InvalidServerOutput(f"too many notifications from the server (more than "
                                               f"{MAX_SERVER_NOTIFICATIONS} in one session)"))
                return None
        return SessionMessage(message)

    def _fail(self, problem: Exception) -> None:
        if self.problem is None:
            self.problem = problem
        self.process.kill()


async def _read(fd: int) -> bytes:
    while True:
        try:
            return os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)


async def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            await anyio.wait_writable(fd)


# -- one session with a sandboxed server --------------------------------------------------------
def _with_stderr(error: ToolError, end: SandboxExit | None) -> ToolError:
    """`error` with the server's stderr tail as its tail: whole (the runner redacts it, then keeps its end;
    the server may hold secrets in its environment), less a first line the capture cut."""
    if end is None or not end.stderr_tail:
        return error
    tail = tail_of(end.stderr_tail, cut=end.stderr_bytes > len(end.stderr_tail))
    if not tail:
        return error
    return ToolError(error.code, error.detail + "; stderr: ", error.retryable, effect_unknown=error.effect_unknown,
                     tail=tail)


def _signal_name(number: int | None) -> str:
    try:
        return f"killed by {signal.Signals(number).name}"  # e.g. SIGXCPU: the CPU limit; SIGSEGV: a crash
    except (TypeError, ValueError):
        return f"signal {number}"


def _session_error(exc: BaseException, channel: SandboxedStdio, end: SandboxExit | None, what: str) -> ToolError:
    """Name what ended the session (the transport's finding first, then how the process ended), and
    whether the call may have taken effect: once a tools/call went out, a session that ends without
    the server's answer (it exited, its stdout ended, it wrote what cannot be read) leaves that unknown;
    only the server's own JSON-RPC error answer is a definite refusal."""
    error = _session_error_kind(exc, channel, end, what)
    if channel.call_sent and not server_refused(exc, channel.answer):
        error.effect_unknown = True
    return refusal_error(error, exc, channel.answer)


def _session_error_kind(exc: BaseException, channel: SandboxedStdio, end: SandboxExit | None,
                        what: str) -> ToolError:
    if channel.problem is not None:
        return transport_error(channel.problem, what)
    if end is not None and end.setup_failed:
        return _with_stderr(ToolError("EXECUTOR_UNAVAILABLE", "the sandbox could not start the MCP server"), end)
    if end is not None and (end.cpu_limit_hit or end.killed_by_signal == signal.SIGXCPU):
        # Run again, it would use the same CPU again: the server (or its limits) must change.
        return _with_stderr(ToolError("TOOL_ERROR", f"the MCP server was killed at the sandbox's CPU limit "
                                                    f"(CPU_LIMIT, {end.cpu_seconds:.1f} s used) before it "
                                                    f"answered {what}", retryable=False), end)
    if end is not None and end.timed_out:
        return ToolError("TIMEOUT", f"the MCP server did not answer {what} in time (the sandbox's wall clock)",
                         retryable=True)
    if end is not None and not end.killed:
        how = f"exit code {end.exit_code}" if end.exit_code is not None else _signal_name(end.killed_by_signal)
        return _with_stderr(transport_error(ServerExited(f"the MCP server exited ({how}) before answering"), what),
                            end)
    return transport_error(exc, what)


async def with_sandboxed_server(runner: SandboxRunner, server: StdioServer, env: dict[str, str], *,
                                limits: SandboxLimits, max_message_bytes: int, timeout_s: float, what: str,
                                use: Callable[[Client], Awaitable[T]]) -> T:
    """Start `server` in a fresh sandbox, run `use` on an MCP client session with it, and kill the sandbox.

    `use` only talks to the server (its answer is judged after the session, so no error of the
    tool's own is mistaken for the transport's). Every failure is a ToolError: TIMEOUT,
    OVERSIZED_RESULT, INVALID_RESULT, TOOL_ERROR (the server exited, or a protocol error),
    EXECUTOR_UNAVAILABLE (the sandbox could not start it)."""
    try:
        process = runner.start(list(server.command), limits=limits, read_only_paths=server.read_only_paths, env=env)
    except (SandboxUnavailable, SandboxSetupError, InvalidSandboxRequest, OSError) as exc:
        raise ToolError("EXECUTOR_UNAVAILABLE", f"could not start the MCP server in the sandbox: {exc}") from exc
    channel = SandboxedStdio(process, max_message_bytes=max_message_bytes)
    try:
        with anyio.fail_after(timeout_s):
            async with Client(channel.streams(), read_timeout_seconds=timeout_s) as client:
                return await use(client)
    except ToolError:
        raise
    except Exception as exc:  # transport, protocol (MCPError), the process's end and timeouts alike
        process.kill()
        with anyio.CancelScope(shield=True):
            end = await anyio.to_thread.run_sync(process.wait, 5.0)
        raise _session_error(exc, channel, end, what) from exc
    finally:
        # Shielded: a cancelled caller must not leave the sandbox (or its descriptors) behind.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(process.close)


def _limits(base: SandboxLimits, overrides: dict[str, int], timeout_s: float) -> SandboxLimits:
    return dataclasses.replace(base, **overrides, wall_seconds=timeout_s + _WALL_BACKSTOP_S)


class McpStdioExecutor:
    """Calls one tool of an MCP server over stdio, the server run in a fresh sandbox for each call."""

    def __init__(self, runner: SandboxRunner, *, allowed_roots: Sequence[str] = ()) -> None:
        self._runner = runner
        # Resolved once: a read-only path is allowed when its real location lies under one of these.
        self._roots = tuple(os.path.realpath(r) for r in allowed_roots)

    def execute(self, request: ExecutionRequest, secrets: SecretProvider) -> Any:
        config = _config(request)
        problems = executor_config_problems(EXECUTOR_KIND, config)
        if problems:
            raise ToolError("EXECUTOR_UNAVAILABLE", "invalid executor config: " + "; ".join(problems))
        server = StdioServer.from_config(config)
        self._check_paths(server.read_only_paths)
        if not isinstance(request.args, dict):
            raise ToolError("TOOL_ERROR", "MCP tool arguments must be a JSON object")
        # Secret values exist only in this call's sandbox environment (the registry has taught the redactor each one).
        env = resolve_secret_handles(server.env, secrets)
        timeout = max(0.1, request.timeout_s - _DEADLINE_MARGIN_S)
        limits = _limits(self._runner.limits, server.limits, timeout)
        remote = config["tool"]
        max_bytes = config.get("max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES)

        async def call(client: Client) -> CallToolResult:
            return await client.call_tool(remote, request.args, meta={IDEMPOTENCY_META_KEY: request.idem_key})

        result = anyio.run(lambda: with_sandboxed_server(
            self._runner, server, env, limits=limits, max_message_bytes=max_bytes, timeout_s=timeout,
            what=f"tools/call {remote!r}", use=call))
        return call_result(remote, result)

    def _check_paths(self, paths: Sequence[str]) -> None:
        for path in paths:
            real = os.path.realpath(path)
            if not any(real == root or real.startswith(root.rstrip("/") + "/") for root in self._roots):
                roots = ", ".join(self._roots) or "none configured"
                raise ToolError("EXECUTOR_UNAVAILABLE",
                                f"read-only path {path!r} is not under the gateway's MCP stdio roots ({roots}; "
                                "TETHER_GATEWAY_MCP_STDIO_ROOTS)")


# -- listing and registering a stdio server's tools ---------------------------------------------
def listing_env(server: StdioServer) -> dict[str, str]:
    """The server's environment for listing its tools outside the gateway: variables holding a
    secret:// handle are left out (only the gateway resolves secrets)."""
    return {k: v for k, v in server.env.items() if "secret://" not in v}


def list_mcp_stdio_tools(server: StdioServer, *, runner: SandboxRunner | None = None,
                         timeout_s: float = 30.0) -> list[McpTool]:
    """The tools a stdio server declares (every page of tools/list), the server run in the sandbox.

    Runs the command here, in the same sandbox the gateway uses (never unsandboxed: without
    bubblewrap this raises ToolError EXECUTOR_UNAVAILABLE); read-only paths are those of the
    config, not checked against the gateway's roots (the gateway checks them at each call)."""
    try:
        runner = runner or SandboxRunner()
    except SandboxUnavailable as exc:
        raise ToolError("EXECUTOR_UNAVAILABLE", f"no sandbox to list the server's tools in: {exc}") from exc
    limits = _limits(runner.limits, server.limits, timeout_s)
    return anyio.run(lambda: with_sandboxed_server(
        runner, server, listing_env(server), limits=limits, max_message_bytes=DEFAULT_MAX_RESPONSE_BYTES,
        timeout_s=timeout_s, what="tools/list", use=declared_tools))


def tool_specs_from_mcp_stdio(server: StdioServer, tools: Sequence[McpTool], *, prefix: str = "",
                              risk_class: RiskClass = RiskClass.IRREVERSIBLE, idempotent: bool = False,
                              untrusted_source: bool = True, egress: bool = True, timeout_ms: int = 30_000,
                              max_response_bytes: int | None = None, constraints: dict[str, Any] | None = None,
                              version: int = 1) -> list[ToolSpec]:
    """One ToolSpec (executor_kind 'mcp_stdio') per declared tool, in the most restrictive class by default
    (IRREVERSIBLE, not idempotent, untrusted output, egress), as for a streamable HTTP server."""
    config = server.config()
    if max_response_bytes is not None:
        config["max_response_bytes"] = max_response_bytes
    return tool_specs(tools, executor_kind=EXECUTOR_KIND, server_config=config, prefix=prefix,
                      risk_class=risk_class, idempotent=idempotent, untrusted_source=untrusted_source, egress=egress,
                      timeout_ms=timeout_ms, constraints=constraints, version=version)
