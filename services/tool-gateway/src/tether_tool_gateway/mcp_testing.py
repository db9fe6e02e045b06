"""A small MCP server (the SDK's MCPServer, formerly FastMCP) over streamable HTTP on 127.0.0.1, for tests and demos."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_mcp_server(server: MCPServer | None = None, *, calls: list[dict[str, Any]] | None = None,
                     timeout_s: float = 20.0) -> RunningMcpServer:
    """Serve `server` (default: `demo_server`) at http://127.0.0.1:<port>/mcp until `stop()`."""
    calls = [] if calls is None else calls
    server = server or demo_server(calls)
    port = _free_port()
    app = server.streamable_http_app(streamable_http_path="/mcp")
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
