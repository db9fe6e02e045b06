"""executor_kind 'mcp': max_response_bytes holds for every answer, also a chunked application/json one.

The server is a few lines of http.server on 127.0.0.1 speaking just enough streamable HTTP MCP
(JSON answers, no SSE) to be called and listed, and sending its answers the way a test asks.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tether_contracts.records import RiskClass, ToolSpec
from tether_tool_gateway.domain.errors import ToolError
from tether_tool_gateway.executors.mcp_tool import McpToolExecutor, list_mcp_tools
from tether_tool_gateway.ports import ExecutionRequest, MappingSecretProvider

MiB = 1024 * 1024


@dataclass
class Answers:
    """How the server answers: the size of the tool's text (and of the listed tool's description), and how it is sent."""

    size: int = 100
    framing: str = "chunked"  # or "content-length"
    gzip: bool = False
    accept_encodings: list[str] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: Any) -> None:
        pass

    def _empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # no standalone SSE stream
        self._empty(405)

    def do_DELETE(self) -> None:
        self._empty(200)

    def do_POST(self) -> None:
        answers = self.server.answers
        answers.accept_encodings.append(self.headers.get("Accept-Encoding", ""))
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "id" not in message:
            self._empty(202)
            return
        method = message["method"]
        if method == "initialize":
            result: dict[str, Any] = {"protocolVersion": message["params"]["protocolVersion"],
                                      "capabilities": {"tools": {}}, "serverInfo": {"name": "cap", "version": "1"}}
            answer: dict[str, Any] = {"result": result}
        elif method == "tools/list":
            tool = {"name": "big", "description": "d" * answers.size, "inputSchema": {"type": "object"}}
            answer = {"result": {"tools": [tool]}}
        elif method == "tools/call":
            answer = {"result": {"content": [{"type": "text", "text": "x" * answers.size}]}}
        else:
            answer = {"error": {"code": -32601, "message": f"no method {method}"}}
        body = json.dumps({"jsonrpc": "2.0", "id": message["id"], **answer}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if answers.gzip:
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip")
        if answers.framing == "content-length":
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(body), 64 * 1024):
            chunk = body[start:start + 64 * 1024]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    answers: Answers

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the gateway hanging up on an oversized answer is the point


@pytest.fixture
def server() -> Iterator[tuple[str, Answers]]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.answers = Answers()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/mcp", srv.answers
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def _call(url: str, **config: Any) -> Any:
    tool = ToolSpec(name="big", version=1, description="d", args_schema_json='{"type":"object"}',
                    risk_class=RiskClass.READ_ONLY, idempotent=True, untrusted_source=True, executor_kind="mcp",
                    executor_config_json=json.dumps({"url": url, "tool": "big", **config}), timeout_ms=20_000)
    request = ExecutionRequest(tool=tool, args={}, idem_key="idem-1", run_id="run-1", tenant_id="t1",
                               call_id="1.0", attempt=1, timeout_s=20.0)
    return McpToolExecutor().execute(request, MappingSecretProvider())


def test_a_chunked_json_answer_past_the_default_cap_is_oversized(server: tuple[str, Answers]) -> None:
    url, answers = server
    answers.size = 6 * MiB
    with pytest.raises(ToolError) as refused:
        _call(url)
    assert refused.value.code == "OVERSIZED_RESULT" and str(MiB) in refused.value.detail
    with pytest.raises(ToolError) as listed:
        list_mcp_tools(url, timeout_s=20)
    assert listed.value.code == "OVERSIZED_RESULT"


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_the_cap_is_the_configured_one_whatever_the_framing(server: tuple[str, Answers], framing: str) -> None:
    url, answers = server
    answers.framing = framing
    answers.size = 48 * 1024  # several chunks, under the cap
    result = _call(url, max_response_bytes=64 * 1024)
    assert result["content"] == [{"type": "text", "text": "x" * answers.size}]
    answers.size = 80 * 1024
    with pytest.raises(ToolError) as refused:
        _call(url, max_response_bytes=64 * 1024)
    assert refused.value.code == "OVERSIZED_RESULT" and str(64 * 1024) in refused.value.detail


def test_a_normal_answer_is_recorded_and_listed(server: tuple[str, Answers]) -> None:
    url, answers = server
    assert _call(url) == {"content": [{"type": "text", "text": "x" * 100}]}
    [tool] = list_mcp_tools(url, timeout_s=20)
    assert tool.name == "big" and tool.description == "d" * 100
    # Answers are asked for uncompressed: the cap counts the bytes on the wire.
    assert answers.accept_encodings and set(answers.accept_encodings) == {"identity"}


def test_a_compressed_answer_is_refused_rather_than_decoded_past_the_cap(server: tuple[str, Answers]) -> None:
    url, answers = server
    answers.gzip = True
    answers.size = 6 * MiB  # about 6 KiB on the wire
    with pytest.raises(ToolError) as refused:
        _call(url)
    assert refused.value.code == "INVALID_RESULT" and "gzip" in refused.value.detail
