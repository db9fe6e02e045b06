"""A small MCP server (the SDK's MCPServer, formerly FastMCP) for tests and demos: over streamable HTTP on
127.0.0.1, or over stdio in the gateway's sandbox (`python -m tether_tool_gateway.mcp_testing`)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from mcp.server.mcpserver import MCPServer

if TYPE_CHECKING:  # not imported at run time: the sandboxed stdio server has only this module and the SDK
    import uvicorn

    from tether_security.sandbox import SandboxRunner
    from tether_tool_gateway.executors.mcp_stdio import StdioServer


@dataclass
class RunningMcpServer:
    """A server on a background thread; `calls` records every tools/call it ran, in order."""

    url: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)


def demo_server(calls: list[dict[str, Any]]) -> MCPServer:
    """A server with `add(a, b)`, `shout(text)`, `fail(reason)` (which raises) and `blob(size)`."""
    server = MCPServer("tether-demo")

    @server.tool(description="Add two integers.")
    def add(a: int, b: int) -> int:
        calls.append({"tool": "add", "args": {"a": a, "b": b}})
        return a + b

    @server.tool(description="Upper-case a text.")
    def shout(text: str) -> str:
        calls.append({"tool": "shout", "args": {"text": text}})
        return text.upper()

    @server.tool(description="Always fails with the given reason.")
    def fail(reason: str) -> str:
        calls.append({"tool": "fail", "args": {"reason": reason}})
        raise ValueError(reason)

    @server.tool(description="Answer `size` bytes of text.")
    def blob(size: int) -> str:
        calls.append({"tool": "blob", "args": {"size": size}})
        return "x" * size

    return server


def stdio_demo_server() -> MCPServer:
    """`demo_server`'s tools, plus `where()` (facts of the process's surroundings: inside the sandbox, uid
    65534, host name "sandbox", loopback only; and its DEMO_* environment) and two that misbehave as only a
    process can: `crash(code)` exits mid-call, `hang(seconds)` does not answer. Run as a program with
    DEMO_BANNER set, it first prints that banner to stdout, the classic mistake that breaks the protocol
    (the SDK keeps a tool's own prints off the wire while it serves; nothing protects what comes before)."""
    server = demo_server([])

    @server.tool(description="Where the server runs: uid, host name, network interfaces, DEMO_* variables.")
    def where() -> dict[str, Any]:
        return {"uid": os.getuid(), "hostname": socket.gethostname(),
                "interfaces": sorted(name for _, name in socket.if_nameindex()),
                "env": {k: v for k, v in os.environ.items() if k.startswith("DEMO_")}}

    @server.tool(description="Exit the server process with `code` before answering.")
    def crash(code: int) -> str:
        sys.stderr.write(f"crashing on purpose with exit code {code}\n")
        sys.stderr.flush()
        os._exit(code)

    @server.tool(description="Wait `seconds` before answering.")
    async def hang(seconds: float) -> str:
        await anyio.sleep(seconds)
        return "woke up"

    return server


class StdioDemoUnavailable(RuntimeError):
    """The sandbox cannot run the stdio demo server from this checkout (the message says why)."""


#: The interpreter inside the sandbox: the host's /usr is all the sandbox has of the system.
SANDBOX_PYTHON = "/usr/bin/python3"
# One session of what a client sends (initialize, tools/list, tools/call), so a warm-up run of the
# server imports, and compiles, most of what a real session needs.
_WARM_UP_SESSION = [
    {"jsonrpc": "2.0", "id": 1, "method": "initialize",
     "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                "clientInfo": {"name": "warm-up", "version": "0"}}},
    {"jsonrpc": "2.0", "method": "notifications/initialized"},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
    {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "add", "arguments": {"a": 1, "b": 2}}},
]


def _reachable_by_sandbox_user(path: Path) -> bool:
    """Whether uid 65534 (the sandbox's user, as which bubblewrap binds paths) can reach `path`."""
    return all(d.stat().st_mode & 0o001 for d in (path, *path.parents))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # same file, same mode: no data copied
    except OSError:
        shutil.copy2(src, dst)  # another filesystem


def _mirror(src: Path, site: Path, into: Path) -> tuple[Path, Path]:
    """A copy of what the demo server imports (this module, the venv's packages) where uid 65534 can reach it."""
    package = into / "src" / "tether_tool_gateway"
    package.mkdir(parents=True)
    for name in ("__init__.py", "mcp_testing.py"):
        _link_or_copy(str(src / "tether_tool_gateway" / name), str(package / name))
    shutil.copytree(site, into / "site-packages", symlinks=True, copy_function=_link_or_copy)
    return into / "src", into / "site-packages"


def prepare_stdio_demo(runner: SandboxRunner, workdir: Path) -> StdioServer:
    """How the gateway's sandbox runs `stdio_demo_server` from this checkout, made ready to start fast.

    The sandbox has the host's /usr, so the server runs on the system python3 with this venv's
    packages and this package's source bound read-only (mirrored into `workdir` by hard links
    when uid 65534 cannot reach the checkout). The venv's packages carry no bytecode (uv installs
    none), and compiling the SDK at every start costs seconds: one warm-up run, in the sandbox,
    writes it into `workdir`, which later runs read through PYTHONPYCACHEPREFIX. `workdir` is an
    empty directory the caller made (and removes), on a path uid 65534 can reach. Raises
    StdioDemoUnavailable when this machine cannot do it (no python3 of this minor version in /usr);
    RuntimeError when the warm-up fails."""
    from tether_security.sandbox import SandboxLimits
    from tether_tool_gateway.executors.mcp_stdio import StdioServer

    version = ".".join(map(str, sys.version_info[:2]))
    if not os.access(SANDBOX_PYTHON, os.X_OK):
        raise StdioDemoUnavailable(f"{SANDBOX_PYTHON} is missing")
    probe = runner.run([SANDBOX_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    if probe.stdout.decode().strip() != version:
        raise StdioDemoUnavailable(f"{SANDBOX_PYTHON} is Python {probe.stdout.decode().strip() or '?'}, "
                                   f"this venv's packages are for {version}")
    src = Path(__file__).resolve().parents[1]
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    workdir = workdir.resolve()
    workdir.chmod(0o755)
    if not (_reachable_by_sandbox_user(src) and _reachable_by_sandbox_user(site)):
        src, site = _mirror(src, site, workdir / "mirror")
    pycache = workdir / "pycache"
    pycache.mkdir()
    command = (SANDBOX_PYTHON, "-m", "tether_tool_gateway.mcp_testing")
    env = {"PYTHONPATH": f"{src}:{site}"}
    session = "".join(json.dumps(m) + "\n" for m in _WARM_UP_SESSION).encode()
    # Generous limits: compiling the SDK takes seconds of CPU, many more of wall clock on a busy machine.
    warm = runner.run(list(command), workdir=pycache, stdin=session, read_only_paths=[str(src), str(site)],
                      env={**env, "PYTHONPYCACHEPREFIX": "/sandbox"},
                      limits=SandboxLimits(wall_seconds=300, cpu_seconds=120))
    # Only its exit status is checked: the server stops at the end of its stdin, possibly before it
    # answered the last requests (their modules are compiled by then, or on the first real call).
    if not warm.ok:
        raise RuntimeError(f"the demo server did not run in the sandbox ({warm.error_code}): "
                           f"{warm.stderr[-1000:].decode(errors='replace')}")
    return StdioServer(command=command, read_only_paths=(str(src), str(site), str(pycache)),
                       env={**env, "PYTHONPYCACHEPREFIX": str(pycache), "PYTHONDONTWRITEBYTECODE": "1"})


_SHARED_DEMO: list[StdioServer] = []
_SHARED_DEMO_LOCK = threading.Lock()


def shared_stdio_demo() -> StdioServer:
    """`prepare_stdio_demo` once per process (the warm-up costs seconds; every test may share its bytecode);
    its directory is removed when the process exits."""
    import atexit

    from tether_security.sandbox import SandboxRunner

    with _SHARED_DEMO_LOCK:
        if not _SHARED_DEMO:
            workdir = Path(tempfile.mkdtemp(prefix="tether-mcp-stdio-"))
            atexit.register(shutil.rmtree, workdir, ignore_errors=True)
            _SHARED_DEMO.append(prepare_stdio_demo(SandboxRunner(), workdir))
        return _SHARED_DEMO[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_mcp_server(server: MCPServer | None = None, *, calls: list[dict[str, Any]] | None = None,
                     timeout_s: float = 20.0, json_response: bool = False) -> RunningMcpServer:
    """Serve `server` (default: `demo_server`) at http://127.0.0.1:<port>/mcp until `stop()`; answers come
    as SSE streams, or with `json_response` as application/json bodies."""
    import uvicorn

    calls = [] if calls is None else calls
    server = server or demo_server(calls)
    port = _free_port()
    app = server.streamable_http_app(streamable_http_path="/mcp", json_response=json_response)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, name="mcp-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            uv.should_exit = True
            raise RuntimeError("the MCP test server did not start")
        time.sleep(0.05)
    return RunningMcpServer(url=f"http://127.0.0.1:{port}/mcp", calls=calls, _server=uv, _thread=thread)


if __name__ == "__main__":
    if os.environ.get("DEMO_BANNER"):
        print(os.environ["DEMO_BANNER"], flush=True)
    stdio_demo_server().run("stdio")
