"""Users' own tools (executor_kind 'http' and 'mcp') against real local servers, a real ledger and the real redactor.

The misbehaving tool server is the dev HTTP service (a separate process): /slow, /status/<code>,
/garbage, /huge/<bytes>, /redirect?to=. Every case must end as a clear tool error; nothing hangs.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import structlog
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError as McpToolError

from tether_contracts.records import RiskClass, ToolSpec
from tether_devservices.process import spawn
from tether_messaging.blobstore import PostgresBlobStore
from tether_security import Redactor, SecretRegistry, StaticSecretProvider
from tether_tool_gateway.domain.canonical import canonical_json, idem_key_for, sha256_hex
from tether_tool_gateway.execution import Completed, Failed, ToolRunner, Unknown, tool_spec_json
from tether_tool_gateway.executors.http_tool import HttpToolExecutor
from tether_tool_gateway.executors.mcp_tool import McpTool, McpToolExecutor, list_mcp_tools, tool_specs_from_mcp
from tether_tool_gateway.ledger import Intent, Owner
from tether_tool_gateway.ledger.postgres import PostgresLedger
from tether_tool_gateway.mcp_testing import start_mcp_server

pytestmark = pytest.mark.integration

SECRET = "tok-3b9f0c1e7a5d42c8b6e1f09a7c3d5e2b"
#: A webhook's token path (a Slack incoming webhook's T.../B.../<token>), the service's only credential.
HOOK = "T0A1B2C3D/B0E4F5G6H/aBcDeFgHiJkLmNoPqRsTuVwX"
#: Values that would take the URL elsewhere than the registered host and path, were they spliced in.
BAD_HOOKS = {"bad/query": "T0A1B2C3D?to=elsewhere-aBcDeFgHiJk", "bad/up": "../../admin/aBcDeFgHiJkLmNoP",
             "bad/fragment": "T0A1B2C3D#aBcDeFgHiJkLmNoPqRsT"}
GW = Owner("tool-gateway-0", "boot-1")
ARGS_SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


@pytest.fixture
def http(tmp_path):
    with spawn("http", tmp_path / "http.jsonl") as svc:
        yield svc


@pytest.fixture
def mcp_server():
    server = start_mcp_server()
    yield server
    server.stop()


@pytest.fixture
def env(pg_schema):
    """A runner with the http and mcp executors, a real ledger and blob store, and the secret registry."""
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(pg_schema.base_dsn, min_size=1, max_size=4, open=True)
    ledger = PostgresLedger(pool, schema=pg_schema.name)
    ledger.ensure_schema()
    blobs = PostgresBlobStore(pool, schema=pg_schema.name)
    blobs.ensure_schema()
    redactor = Redactor()
    secrets = SecretRegistry(StaticSecretProvider({"team/token": SECRET, "team/hook": HOOK,
                                                   **BAD_HOOKS}), redactor)
    runner = ToolRunner(ledger=ledger, executors={"http": HttpToolExecutor(), "mcp": McpToolExecutor()},
                        blobs=blobs, owner=GW, secrets=secrets, redactor=redactor)

    class Env:
        def run(self, tool: ToolSpec, args, *, call_index: int = 0):
            args_json = canonical_json(args)
            intent = Intent(idem_key=idem_key_for("run-u", 1, call_index), run_id="run-u", tenant_id="t1",
                            partition=0, step=1, call_id=f"1.{call_index}", tool_name=tool.name,
                            args_json=args_json, args_hash=sha256_hex(args_json),
                            tool_spec_json=tool_spec_json(tool), idempotent=tool.idempotent)
            return intent, runner.run(intent, tool)

        def ledger_text(self) -> str:
            with pool.connection() as conn:
                tables = [r[0] for r in conn.execute(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
                    (pg_schema.name,)).fetchall()]
                return "\n".join(str(conn.execute(f'SELECT * FROM "{pg_schema.name}"."{t}"').fetchall())
                                 for t in tables)

    yield Env()
    runner.close()
    pool.close()


def http_tool(url: str, *, idempotent: bool = False, timeout_ms: int = 5_000, **config) -> ToolSpec:
    return ToolSpec(name="team_lookup", version=1, description="the team's lookup service",
                    args_schema_json=json.dumps(ARGS_SCHEMA), risk_class=RiskClass.READ_ONLY, idempotent=idempotent,
                    untrusted_source=True, executor_kind="http",
                    executor_config_json=json.dumps({"url": url, **config}), timeout_ms=timeout_ms)


# -- the happy path and the idempotency key ------------------------------------------------------
def test_args_are_posted_as_json_with_the_idempotency_key(env, http):
    intent, outcome = env.run(http_tool(f"{http.url}/lookup"), {"q": "tether"})
    assert isinstance(outcome, Completed) and outcome.untrusted
    result = json.loads(outcome.result_json)
    assert result["status"] == 200 and result["body"]["echo"]["json"] == {"q": "tether"}
    [record] = http.records()
    assert record["method"] == "POST" and record["path"] == "/lookup"
    assert record["idempotency_key"] == intent.idem_key


# -- misbehaving tool servers ----------------------------------------------------------------------
def test_a_slow_answer_is_a_timeout(env, http):
    _, outcome = env.run(http_tool(f"{http.url}/slow/30000", timeout_ms=1_500), {"q": "x"})
    # The service got the request (recorded below) and never answered: for a non-idempotent tool the
    # outcome is unknown (a human decides), not a failure the model would simply retry.
    assert isinstance(outcome, Unknown) and outcome.detail.startswith("TIMEOUT:"), outcome
    assert len(http.records()) == 1  # not idempotent: tried once
    _, outcome = env.run(http_tool(f"{http.url}/slow/30000", timeout_ms=1_500, idempotent=True), {"q": "y"},
                         call_index=1)
    assert isinstance(outcome, Failed) and outcome.error_code == "TIMEOUT" and outcome.retryable


def test_garbage_is_an_invalid_result_for_an_idempotent_tool_and_a_completed_call_for_another(env, http):
    _, outcome = env.run(http_tool(f"{http.url}/garbage", idempotent=True), {"q": "x"})
    assert isinstance(outcome, Failed) and outcome.error_code == "INVALID_RESULT" and not outcome.retryable
    assert "not JSON" in outcome.detail
    # A 2xx says the effect took place: a non-idempotent call completes, its result saying why the body
    # is missing (a failure would invite the model to do it again).
    _, outcome = env.run(http_tool(f"{http.url}/garbage"), {"q": "x"}, call_index=1)
    assert isinstance(outcome, Completed), outcome
    result = json.loads(outcome.result_json)
    assert result["status"] == 200 and result["body"] is None
    assert result["body_unreadable"]["code"] == "INVALID_RESULT" and "not JSON" in result["body_unreadable"]["detail"]
    assert len(http.records()) == 2


def test_a_500_is_a_tool_error_retried_only_for_an_idempotent_tool(env, http):
    _, once = env.run(http_tool(f"{http.url}/status/500"), {"q": "x"}, call_index=0)
    assert isinstance(once, Failed) and once.error_code == "TOOL_ERROR" and "HTTP 500" in once.detail
    assert len(http.records()) == 1
    intent, retried = env.run(http_tool(f"{http.url}/status/500", idempotent=True, max_attempts=3,
                                        timeout_ms=20_000), {"q": "x"}, call_index=1)
    assert isinstance(retried, Failed) and retried.error_code == "TOOL_ERROR" and retried.retryable
    later = http.records()[1:]
    assert len(later) == 3 and {r["idempotency_key"] for r in later} == {intent.idem_key}


def test_a_4xx_is_not_retried(env, http):
    _, outcome = env.run(http_tool(f"{http.url}/status/404", idempotent=True), {"q": "x"})
    assert isinstance(outcome, Failed) and "HTTP 404" in outcome.detail and not outcome.retryable
    assert len(http.records()) == 1


def test_fifty_megabytes_is_oversized_for_an_idempotent_tool_and_a_completed_call_for_another(env, http):
    url = f"{http.url}/huge/{50 * 1024 * 1024}"
    _, outcome = env.run(http_tool(url, idempotent=True, max_response_bytes=1024 * 1024), {"q": "x"})
    assert isinstance(outcome, Failed) and outcome.error_code == "OVERSIZED_RESULT" and not outcome.retryable
    _, outcome = env.run(http_tool(url, max_response_bytes=1024 * 1024), {"q": "x"}, call_index=1)
    assert isinstance(outcome, Completed), outcome
    result = json.loads(outcome.result_json)
    assert result["status"] == 200 and result["body"] is None
    assert result["body_unreadable"]["code"] == "OVERSIZED_RESULT"


def test_a_redirect_off_the_allowlist_is_refused(env, http):
    url = f"{http.url}/redirect?to=http://elsewhere.example/steal"
    _, outcome = env.run(http_tool(url), {"q": "x"})
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR"
    assert "elsewhere.example" in outcome.detail and "allowlist" in outcome.detail
    assert len(http.records()) == 1  # the redirect was not followed


def test_an_endpoint_off_the_allowlist_is_never_contacted(env, http):
    _, outcome = env.run(http_tool(f"{http.url}/lookup", allow_hosts=["tools.example"]), {"q": "x"})
    assert isinstance(outcome, Failed) and "not allowed" in outcome.detail
    assert http.records() == []


def test_a_service_that_is_down_is_a_tool_error(env):
    _, outcome = env.run(http_tool("http://127.0.0.1:9/lookup"), {"q": "x"})
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR"


# -- secrets ---------------------------------------------------------------------------------------
def test_a_secret_header_reaches_the_service_and_nothing_else(env, http, capsys):
    with structlog.testing.capture_logs() as logs:
        _, outcome = env.run(http_tool(f"{http.url}/lookup", headers={"Authorization": "Bearer secret://team/token"}),
                             {"q": "x"})
    assert isinstance(outcome, Completed)
    [record] = http.records()
    assert record["authorization"] == f"Bearer {SECRET}"  # it reached the service
    # The service echoed it back; the redactor scrubbed it before it was recorded.
    assert SECRET not in outcome.result_json
    assert SECRET not in env.ledger_text()
    assert SECRET not in json.dumps(logs, default=str)
    out = capsys.readouterr()
    assert SECRET not in out.out and SECRET not in out.err


def test_a_webhook_token_path_from_a_secret_reaches_the_service_and_nothing_else(env, http, capsys):
    # The registered URL holds the handle; the gateway splices the value in at execution time only.
    tool = http_tool(f"{http.url}/services/secret://team/hook")
    assert HOOK not in tool.executor_config_json
    with structlog.testing.capture_logs() as logs:
        _, outcome = env.run(tool, {"q": "x"})
    assert isinstance(outcome, Completed), outcome
    [record] = http.records()
    assert record["path"] == f"/services/{HOOK}"  # it reached the service
    # The service echoed its path back; the redactor scrubbed the value before it was recorded.
    assert HOOK not in outcome.result_json and "[REDACTED" in outcome.result_json
    assert HOOK not in env.ledger_text()
    assert HOOK not in json.dumps(logs, default=str)
    out = capsys.readouterr()
    assert HOOK not in out.out and HOOK not in out.err


@pytest.mark.parametrize("name", sorted(BAD_HOOKS))
def test_a_secret_in_the_url_path_may_only_extend_the_path(env, http, name):
    _, outcome = env.run(http_tool(f"{http.url}/services/secret://{name}"), {"q": "x"})
    assert isinstance(outcome, Failed) and outcome.error_code == "EXECUTOR_UNAVAILABLE", outcome
    assert "may only extend the path" in outcome.detail
    assert BAD_HOOKS[name] not in outcome.detail and "aBcDeFgHiJk" not in outcome.detail
    assert http.records() == []  # never contacted


def test_a_url_secret_that_is_not_configured_is_named_not_guessed(env, http):
    _, outcome = env.run(http_tool(f"{http.url}/services/secret://team/missing"), {"q": "x"})
    assert isinstance(outcome, Failed) and outcome.error_code == "EXECUTOR_UNAVAILABLE"
    assert "secret://team/missing" in outcome.detail and http.records() == []


def pieces(secret: str, n: int = 8) -> set[str]:
    """Every n-character piece of `secret`: none may show, not even the part left of a secret cut in two."""
    return {secret[i:i + n] for i in range(len(secret) - n + 1)}


def shows_a_piece(text: str, secret: str) -> bool:
    return any(p in text for p in pieces(secret))


#: Where the executors used to cut tool text before the runner redacted it (http body, MCP isError text).
OLD_BODY_CUT, OLD_MCP_CUT = 300, 500


@pytest.fixture
def echoing_error_service():
    """A tool service that answers HTTP 500 quoting the bearer token it was sent, starting 20 characters
    before OLD_BODY_CUT: the old cut kept 20 of its 36 characters, which no redaction rule matched."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            token = self.headers.get("Authorization", "").removeprefix("Bearer ")
            body = ("e" * (OLD_BODY_CUT - 21) + " " + token + " was refused").encode()
            self.send_response(500)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="echoing-error-service", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_a_secret_in_an_error_body_is_redacted_before_the_body_is_cut(env, echoing_error_service):
    tool = http_tool(f"{echoing_error_service}/lookup", headers={"Authorization": "Bearer secret://team/token"})
    _, outcome = env.run(tool, {"q": "x"})
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert not shows_a_piece(outcome.detail, SECRET), outcome.detail
    assert "HTTP 500" in outcome.detail and "[REDACTED:" in outcome.detail and "was refused" in outcome.detail
    assert not shows_a_piece(env.ledger_text(), SECRET)


# -- MCP -------------------------------------------------------------------------------------------
def test_an_mcp_servers_tools_are_listed_and_called_through_the_gateway(env, mcp_server):
    tools = list_mcp_tools(mcp_server.url)
    assert {t.name for t in tools} == {"add", "shout", "fail", "blob"}
    specs = {s.name: s for s in tool_specs_from_mcp(mcp_server.url, tools, prefix="demo_")}
    add = specs["demo_add"]
    # The most restrictive class until an operator says otherwise.
    assert add.risk_class is RiskClass.IRREVERSIBLE and not add.idempotent and add.untrusted_source
    assert json.loads(add.args_schema_json)["required"] == ["a", "b"]
    _, outcome = env.run(add, {"a": 2, "b": 40})
    assert isinstance(outcome, Completed) and outcome.untrusted
    assert json.loads(outcome.result_json)["structured_content"] == {"result": 42}
    _, failed = env.run(specs["demo_fail"], {"reason": "no such order"}, call_index=1)
    assert isinstance(failed, Failed) and failed.error_code == "TOOL_ERROR" and "fail" in failed.detail
    assert [c["tool"] for c in mcp_server.calls] == ["add", "fail"]


def test_an_mcp_server_that_is_down_is_a_tool_error(env):
    tool = ToolSpec(name="gone", version=1, description="d", args_schema_json='{"type":"object"}',
                    risk_class=RiskClass.IRREVERSIBLE, idempotent=False, untrusted_source=True, executor_kind="mcp",
                    executor_config_json=json.dumps({"url": "http://127.0.0.1:9/mcp", "tool": "gone"}),
                    timeout_ms=5_000)
    _, outcome = env.run(tool, {})
    assert isinstance(outcome, Failed) and outcome.error_code in ("TOOL_ERROR", "TIMEOUT")


def test_an_mcp_server_off_the_allowlist_is_never_contacted(env, mcp_server):
    [spec] = [s for s in tool_specs_from_mcp(mcp_server.url, list_mcp_tools(mcp_server.url),
                                             allow_hosts=["tools.example"]) if s.name == "add"]
    _, outcome = env.run(spec, {"a": 1, "b": 2})
    assert isinstance(outcome, Failed) and "not allowed" in outcome.detail
    assert mcp_server.calls == []


def test_an_oversized_mcp_answer_is_refused(env, mcp_server):
    [spec] = [s for s in tool_specs_from_mcp(mcp_server.url, list_mcp_tools(mcp_server.url)) if s.name == "blob"]
    config = json.loads(spec.executor_config_json) | {"max_response_bytes": 64 * 1024}
    spec = spec.model_copy(update={"executor_config_json": json.dumps(config)})
    _, small = env.run(spec, {"size": 1000}, call_index=0)
    assert isinstance(small, Completed)
    _, outcome = env.run(spec.model_copy(update={"idempotent": True}), {"size": 2 * 1024 * 1024}, call_index=1)
    assert isinstance(outcome, Failed) and outcome.error_code == "OVERSIZED_RESULT", outcome
    # The server had the call and answered it: for a non-idempotent tool whether it did its work (or
    # reported an error) cannot be read, so a human decides, as for a stdio server.
    _, outcome = env.run(spec, {"size": 2 * 1024 * 1024}, call_index=2)
    assert isinstance(outcome, Unknown) and outcome.detail.startswith("OVERSIZED_RESULT:"), outcome


class CuttingProxy:
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
                    # shutdown, not only close: a close leaves the socket listening while _accept waits in it.
                    self.listener.shutdown(socket.SHUT_RDWR)
                    self.listener_closed = True
                    status, rest = data.split(b"\r\n", 1)
                    data = status + b"\r\nconnection: close\r\n" + rest
                client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self._sockets:
            s.close()



def _add_through(proxy: CuttingProxy) -> ToolSpec:
    # As `tether tools import-mcp` registers it: IRREVERSIBLE and not idempotent.
    [spec] = tool_specs_from_mcp(f"http://127.0.0.1:{proxy.port}/mcp", [McpTool("add", "adds", {"type": "object"})],
                                 timeout_ms=30_000)
    return spec


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def test_an_mcp_connection_cut_after_the_server_ran_the_call_leaves_a_non_idempotent_calls_outcome_unknown(
        env, mcp_server):
    proxy = CuttingProxy(_port(mcp_server.url), "cut")
    try:
        _, outcome = env.run(_add_through(proxy), {"a": 1, "b": 2})
    finally:
        proxy.close()
    # The server did the work; reported as a failure, the model would do it again.
    assert mcp_server.calls == [{"tool": "add", "args": {"a": 1, "b": 2}}]
    assert isinstance(outcome, Unknown), outcome
    assert outcome.detail.startswith("TOOL_ERROR:") and "RemoteProtocolError" in outcome.detail
    assert "not idempotent" in outcome.detail


def test_an_mcp_tools_call_that_could_not_connect_is_a_plain_failure(env, mcp_server):
    proxy = CuttingProxy(_port(mcp_server.url), "refuse")
    try:
        _, outcome = env.run(_add_through(proxy), {"a": 1, "b": 2})
    finally:
        proxy.close()
    assert mcp_server.calls == []
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert "ConnectError" in outcome.detail and outcome.retryable


def test_a_secret_in_an_mcp_error_is_redacted_before_the_text_is_cut(env):
    # The server reports an error quoting its own credential (the one the gateway sends it), placed so
    # that the old cut of the error text fell 20 characters into it.
    prefix = "Error executing tool refuse: "  # how the SDK words a ToolError raised by a tool
    server = MCPServer("quotes-its-key")

    @server.tool(description="Always refuses, quoting the key it was given.")
    def refuse() -> str:
        raise McpToolError("e" * (OLD_MCP_CUT - len(prefix) - 21) + " " + SECRET + " was refused")

    running = start_mcp_server(server)
    try:
        [spec] = tool_specs_from_mcp(running.url, [McpTool("refuse", "refuses", {"type": "object"})],
                                     headers={"Authorization": "Bearer secret://team/token"})
        _, outcome = env.run(spec, {})
    finally:
        running.stop()
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert not shows_a_piece(outcome.detail, SECRET), outcome.detail
    assert f"reported an error: {prefix}" in outcome.detail and "was refused" in outcome.detail
    assert not shows_a_piece(env.ledger_text(), SECRET)
