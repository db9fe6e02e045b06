"""An MCP-over-HTTP tools/call whose answer the server did not give: the real demo server behind a loopback
proxy that lets the call through (the server runs the tool) and hands the client something else.

The MCP SDK resolves such a call with a JSON-RPC error of its own making (a 502 becomes INTERNAL_ERROR, a
body that is not JSON-RPC PARSE_ERROR, a 202 INVALID_REQUEST), which must not pass for the server's
refusal: for a non-idempotent tool the outcome is unknown, and the call is never run again. A JSON-RPC
error the server itself sends stays a definite failure, whatever its code. Real ToolRunner, PostgreSQL ledger.
"""

from __future__ import annotations

import socket
import threading

import pytest
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND

from tether_messaging.blobstore import PostgresBlobStore
from tether_security import Redactor, SecretRegistry, StaticSecretProvider
from tether_tool_gateway.domain.canonical import canonical_json, idem_key_for, sha256_hex
from tether_tool_gateway.execution import Failed, ToolRunner, Unknown, tool_spec_json
from tether_tool_gateway.executors.mcp_tool import McpTool, McpToolExecutor, tool_specs_from_mcp
from tether_tool_gateway.ledger import Intent, Owner
from tether_tool_gateway.ledger.postgres import PostgresLedger
from tether_tool_gateway.mcp_testing import start_mcp_server

pytestmark = pytest.mark.integration

GW = Owner("tool-gateway-0", "boot-1")

#: What reaches the client instead of the server's answer to tools/call (the server has run the tool).
FORGED = {
    # A load balancer's error page.
    "proxy-502": b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/html\r\ncontent-length: 11\r\n"
                 b"connection: close\r\n\r\n<html>502!!",
    # A 200 that claims JSON and is not JSON-RPC (a captive portal, a misrouted request).
    "garbled-200": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n"
                   b"connection: close\r\n\r\n<html>oops!",
    # An SSE stream whose event is not JSON-RPC.
    "garbled-sse-event": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                         b"event: message\r\ndata: <html>oops!\r\n\r\n",
    # Accepted, and no answer will ever come.
    "202-without-answer": b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
    # The connection closes in the middle of the answer's body.
    "cut-mid-body": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 200\r\n"
                    b"connection: close\r\n\r\n{\"jsonrpc\": \"2.0\", \"id\": ",
}


class ForgingProxy:
    """A loopback TCP proxy in front of `backend_port`: everything passes until the client has sent a
    tools/call on a connection; the backend's answer to it is then replaced by `forged`, and that
    connection closed."""

    def __init__(self, backend_port: int, forged: bytes) -> None:
        self.backend_port = backend_port
        self.forged = forged
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            backend = socket.create_connection(("127.0.0.1", self.backend_port))
            self._sockets += [client, backend]
            seen: list[bytes] = []
            threading.Thread(target=self._up, args=(client, backend, seen), daemon=True).start()
            threading.Thread(target=self._down, args=(client, backend, seen), daemon=True).start()

    def _up(self, client: socket.socket, backend: socket.socket, seen: list[bytes]) -> None:
        try:
            while data := client.recv(65536):
                if b'"tools/call"' in data:
                    seen.append(b"tools/call")
                backend.sendall(data)
        except OSError:
            pass

    def _down(self, client: socket.socket, backend: socket.socket, seen: list[bytes]) -> None:
        try:
            while data := backend.recv(65536):
                if seen:  # the server's answer to tools/call: it ran the tool; the client gets the forgery
                    client.sendall(self.forged)
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    return
                client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        for s in self._sockets:
            s.close()


@pytest.fixture
def env(pg_schema):
    """A runner with the mcp executor, a real ledger and blob store."""
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(pg_schema.base_dsn, min_size=1, max_size=4, open=True)
    ledger = PostgresLedger(pool, schema=pg_schema.name)
    ledger.ensure_schema()
    blobs = PostgresBlobStore(pool, schema=pg_schema.name)
    blobs.ensure_schema()
    redactor = Redactor()
    runner = ToolRunner(ledger=ledger, executors={"mcp": McpToolExecutor()}, blobs=blobs, owner=GW,
                        secrets=SecretRegistry(StaticSecretProvider({}), redactor), redactor=redactor)

    def run(url: str, remote: str, args: dict, *, idempotent: bool = False):
        # As `tether tools import-mcp` registers it: IRREVERSIBLE and, unless said otherwise, not idempotent.
        [spec] = tool_specs_from_mcp(url, [McpTool(remote, remote, {"type": "object"})], idempotent=idempotent,
                                     timeout_ms=30_000)
        args_json = canonical_json(args)
        intent = Intent(idem_key=idem_key_for("run-f", 1, 0), run_id="run-f", tenant_id="t1", partition=0, step=1,
                        call_id="1.0", tool_name=spec.name, args_json=args_json, args_hash=sha256_hex(args_json),
                        tool_spec_json=tool_spec_json(spec), idempotent=spec.idempotent)
        return runner.run(intent, spec)

    yield run
    runner.close()
    pool.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_an_answer_the_server_did_not_give_leaves_a_non_idempotent_calls_outcome_unknown(env, forgery):
    server = start_mcp_server()
    proxy = ForgingProxy(_port(server.url), FORGED[forgery])
    url = f"http://127.0.0.1:{proxy.port}/mcp"
    try:
        outcome = env(url, "add", {"a": 1, "b": 2})
        again = env(url, "add", {"a": 1, "b": 2})  # the same call delivered again (a replay)
    finally:
        proxy.close()
        server.stop()
    # The server did the work; reported as a failure, the model would do it again.
    assert server.calls == [{"tool": "add", "args": {"a": 1, "b": 2}}]
    assert isinstance(outcome, Unknown), outcome
    assert outcome.detail.startswith("TOOL_ERROR:") and "not idempotent" in outcome.detail, outcome.detail
    # A human decides; the gateway never runs it again by itself.
    assert again == outcome


def test_an_answer_the_server_did_not_give_is_a_retryable_failure_for_an_idempotent_tool(env):
    server = start_mcp_server()
    proxy = ForgingProxy(_port(server.url), FORGED["proxy-502"])
    try:
        outcome = env(f"http://127.0.0.1:{proxy.port}/mcp", "add", {"a": 1, "b": 2}, idempotent=True)
    finally:
        proxy.close()
        server.stop()
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR" and outcome.retryable, outcome


def refusing_server(code: int = INTERNAL_ERROR) -> MCPServer:
    server = MCPServer("refuses")

    @server.tool(description="Refuses with a JSON-RPC error (INTERNAL_ERROR: the same code the SDK gives a "
                             "proxy's 502).")
    def charge(amount: int) -> str:
        raise MCPError(code=code, message=f"ledger locked: {amount} was not charged")

    return server


@pytest.mark.parametrize("json_response", [False, True], ids=["sse", "json"])
def test_the_servers_own_json_rpc_error_is_a_definite_failure(env, json_response):
    running = start_mcp_server(refusing_server(), json_response=json_response)
    try:
        outcome = env(running.url, "charge", {"amount": 5})
    finally:
        running.stop()
    # The server said it did not do it: a plain failure, no human needed, for a non-idempotent tool too.
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert "ledger locked: 5 was not charged" in outcome.detail
    assert "the server's JSON-RPC error -32603" in outcome.detail and outcome.retryable


@pytest.mark.parametrize(("code", "retryable"), [(INVALID_PARAMS, False), (METHOD_NOT_FOUND, False),
                                                 (INVALID_REQUEST, False), (-32001, True)])
def test_a_refusal_of_the_request_itself_is_not_worth_another_try(env, code, retryable):
    # Every code was retryable: arguments the server refuses were sent again, to the same refusal.
    running = start_mcp_server(refusing_server(code))
    try:
        outcome = env(running.url, "charge", {"amount": 5}, idempotent=True)
    finally:
        running.stop()
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert f"the server's JSON-RPC error {code}" in outcome.detail and outcome.retryable is retryable
