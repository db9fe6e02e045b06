"""An MCP-over-HTTP tools/call whose connection fails, through a real TCP proxy in front of a real MCP server,
the ToolRunner and a real ledger: a cut after the request reached the server leaves a non-idempotent call's
outcome unknown; a connection never made is a plain failure."""

from __future__ import annotations

import socket
import threading

import pytest

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


class Proxy:
    """A loopback TCP proxy in front of `backend_port` that breaks the MCP exchange in one of two ways.

    "cut": forwards everything until the client has sent a tools/call, then, when the backend's answer
    to it arrives, closes the client's connection instead of passing the answer on (the server did the work).
    "refuse": answers the session's first request (the client's discovery or initialize), then stops
    listening and has the client close its connection, so tools/call finds nothing to connect to.
    """

    def __init__(self, backend_port: int, mode: str) -> None:
        self.backend_port = backend_port
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self.listener]
        self.listener_closed = False
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
                if self.mode == "cut" and b"tools/call" in seen:
                    client.shutdown(socket.SHUT_RDWR)
                    client.close()
                    return
                if self.mode == "refuse" and not self.listener_closed and data.startswith(b"HTTP/1.1 "):
                    # The answer to the session's first request: nothing listens any more by the time the
                    # client reads it, and it tells the client to close this connection after it, so the
                    # next request (tools/call) must connect, and cannot.
                    self.listener.close()
                    self.listener_closed = True
                    status, rest = data.split(b"\r\n", 1)
                    data = status + b"\r\nconnection: close\r\n" + rest
                client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self._sockets:
            s.close()


@pytest.fixture
def backend():
    server = start_mcp_server()
    yield server
    server.stop()


@pytest.fixture
def runner(pg_schema):
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(pg_schema.base_dsn, min_size=1, max_size=4, open=True)
    ledger = PostgresLedger(pool, schema=pg_schema.name)
    ledger.ensure_schema()
    blobs = PostgresBlobStore(pool, schema=pg_schema.name)
    blobs.ensure_schema()
    redactor = Redactor()
    runner = ToolRunner(ledger=ledger, executors={"mcp": McpToolExecutor()}, blobs=blobs, owner=GW,
                        secrets=SecretRegistry(StaticSecretProvider({}), redactor), redactor=redactor)
    yield runner
    runner.close()
    pool.close()


def call_add(runner: ToolRunner, url: str, *, idempotent: bool = False):
    # As `tether tools import-mcp` registers it: IRREVERSIBLE and not idempotent unless an operator says so.
    [spec] = tool_specs_from_mcp(url, [McpTool("add", "adds", {"type": "object"})], timeout_ms=30_000)
    spec = spec.model_copy(update={"idempotent": idempotent})
    args_json = canonical_json({"a": 1, "b": 2})
    intent = Intent(idem_key=idem_key_for("run-c", 1, 0), run_id="run-c", tenant_id="t1", partition=0, step=1,
                    call_id="1.0", tool_name=spec.name, args_json=args_json, args_hash=sha256_hex(args_json),
                    tool_spec_json=tool_spec_json(spec), idempotent=spec.idempotent)
    return runner.run(intent, spec)


def test_a_connection_cut_after_the_server_ran_the_call_leaves_a_non_idempotent_calls_outcome_unknown(
        runner, backend):
    proxy = Proxy(int(backend.url.rsplit(":", 1)[1].split("/")[0]), "cut")
    try:
        outcome = call_add(runner, f"http://127.0.0.1:{proxy.port}/mcp")
    finally:
        proxy.close()
    # The server did the work; reported as a failure, the model would do it again.
    assert backend.calls == [{"tool": "add", "args": {"a": 1, "b": 2}}]
    assert isinstance(outcome, Unknown), outcome
    assert outcome.detail.startswith("TOOL_ERROR:") and "RemoteProtocolError" in outcome.detail
    assert "not idempotent" in outcome.detail


def test_a_tools_call_that_could_not_connect_is_a_plain_failure(runner, backend):
    proxy = Proxy(int(backend.url.rsplit(":", 1)[1].split("/")[0]), "refuse")
    try:
        outcome = call_add(runner, f"http://127.0.0.1:{proxy.port}/mcp")
    finally:
        proxy.close()
    assert backend.calls == []
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert "ConnectError" in outcome.detail and outcome.retryable
