"""executor_kind 'mcp_stdio': a real MCP server (the SDK's MCPServer) over stdio in the real bubblewrap sandbox,
through the ToolRunner with a real ledger and the real redactor.

Every call starts the server in a fresh sandbox, so each test here is one server start (about
1.5 s of CPU: the SDK's models); the misbehaving servers must each end as a clear tool error.
"""

from __future__ import annotations

import json
import os
import uuid

import anyio
import pytest
import structlog

from tether_contracts.records import RiskClass, ToolSpec
from tether_messaging.blobstore import PostgresBlobStore
from tether_security import Redactor, SecretRegistry, StaticSecretProvider
from tether_security.sandbox import SandboxLimits, SandboxRunner
from tether_tool_gateway.domain.canonical import canonical_json, idem_key_for, sha256_hex
from tether_tool_gateway.execution import Completed, Failed, ToolRunner, Unknown, tool_spec_json
from tether_tool_gateway.executors.mcp_stdio import (
    McpStdioExecutor,
    StdioServer,
    list_mcp_stdio_tools,
    listing_env,
    tool_specs_from_mcp_stdio,
    with_sandboxed_server,
)
from tether_tool_gateway.executors.mcp_tool import McpTool, declared_tools
from tether_tool_gateway.ledger import Intent, Owner
from tether_tool_gateway.ledger.postgres import PostgresLedger
from tether_tool_gateway.mcp_testing import StdioDemoUnavailable, shared_stdio_demo

pytestmark = pytest.mark.integration

SECRET = "tok-5d1e9a7c3b2f48e6a0c4d8b2f6e1a9c7"
GW = Owner("tool-gateway-0", "boot-1")


@pytest.fixture(scope="module")
def demo() -> StdioServer:
    try:
        return shared_stdio_demo()
    except StdioDemoUnavailable as exc:
        pytest.fail(f"the sandbox cannot run the demo server from this checkout: {exc}")


@pytest.fixture(scope="module")
def sandbox() -> SandboxRunner:
    return SandboxRunner()


@pytest.fixture
def env(pg_schema, demo, sandbox):
    """A runner whose 'mcp_stdio' executor may bind the demo's paths (its roots), a real ledger and blob store."""
    from psycopg_pool import ConnectionPool

    pool = ConnectionPool(pg_schema.base_dsn, min_size=1, max_size=4, open=True)
    ledger = PostgresLedger(pool, schema=pg_schema.name)
    ledger.ensure_schema()
    blobs = PostgresBlobStore(pool, schema=pg_schema.name)
    blobs.ensure_schema()
    redactor = Redactor()
    secrets = SecretRegistry(StaticSecretProvider({"team/token": SECRET}), redactor)
    executor = McpStdioExecutor(sandbox, allowed_roots=demo.read_only_paths)
    runner = ToolRunner(ledger=ledger, executors={"mcp_stdio": executor}, blobs=blobs, owner=GW, secrets=secrets,
                        redactor=redactor)

    class Env:
        calls = 0

        def run(self, tool: ToolSpec, args):
            self.calls += 1
            args_json = canonical_json(args)
            intent = Intent(idem_key=idem_key_for("run-s", 1, self.calls), run_id="run-s", tenant_id="t1",
                            partition=0, step=1, call_id=f"1.{self.calls}", tool_name=tool.name,
                            args_json=args_json, args_hash=sha256_hex(args_json),
                            tool_spec_json=tool_spec_json(tool), idempotent=tool.idempotent)
            return runner.run(intent, tool)

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


#: Long enough for a server start on a busy machine; a call that works returns as soon as it is answered.
CALL_TIMEOUT_MS = 90_000


def stdio_tool(server: StdioServer, remote: str, *, timeout_ms: int = CALL_TIMEOUT_MS, **config) -> ToolSpec:
    [spec] = tool_specs_from_mcp_stdio(server, [_declared(remote)], prefix="demo_", timeout_ms=timeout_ms)
    merged = json.loads(spec.executor_config_json) | config
    return spec.model_copy(update={"executor_config_json": json.dumps(merged)})


def _declared(remote: str) -> McpTool:
    return McpTool(remote, f"the demo's {remote}", {"type": "object"})


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


# -- list and call ---------------------------------------------------------------------------------
def test_a_stdio_servers_tools_are_listed_and_called_in_the_sandbox_with_its_secret(env, demo, sandbox, capsys):
    # The team's token goes in the server's environment by handle; listing leaves such variables out.
    server = StdioServer(command=demo.command, read_only_paths=demo.read_only_paths,
                         env={**demo.env, "DEMO_TOKEN": "secret://team/token"})
    assert "DEMO_TOKEN" not in listing_env(server)
    tools = list_mcp_stdio_tools(server, runner=sandbox, timeout_s=CALL_TIMEOUT_MS / 1000)
    assert {t.name for t in tools} == {"add", "shout", "fail", "blob", "where", "crash", "hang"}
    specs = {s.name: s for s in tool_specs_from_mcp_stdio(server, tools, prefix="demo_", timeout_ms=CALL_TIMEOUT_MS)}
    where = specs["demo_where"]
    # The most restrictive class until an operator says otherwise, as for a streamable HTTP server.
    assert where.risk_class is RiskClass.IRREVERSIBLE and not where.idempotent and where.untrusted_source
    assert where.egress and where.executor_kind == "mcp_stdio"
    assert json.loads(where.executor_config_json) == {**server.config(), "tool": "where"}
    assert json.loads(specs["demo_add"].args_schema_json)["required"] == ["a", "b"]
    with structlog.testing.capture_logs() as logs:
        outcome = env.run(where, {})
    assert isinstance(outcome, Completed) and outcome.untrusted, outcome
    facts = json.loads(outcome.result_json)["structured_content"]
    # It ran in the sandbox: uid 65534, bwrap's host name, loopback only.
    assert (facts["uid"], facts["hostname"], facts["interfaces"]) == (65534, "sandbox", ["lo"])
    # It got the secret's value (and echoed it back); the redactor scrubbed it before it was recorded.
    assert facts["env"]["DEMO_TOKEN"].startswith("[REDACTED")
    assert SECRET not in outcome.result_json and SECRET not in env.ledger_text()
    assert SECRET not in json.dumps(logs, default=str)
    out = capsys.readouterr()
    assert SECRET not in out.out and SECRET not in out.err


# -- a tool's own error and misbehaving servers ----------------------------------------------------
def test_an_error_result_is_a_tool_error(env, demo):
    outcome = env.run(stdio_tool(demo, "fail"), {"reason": "no such order"})
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert "'fail' reported an error" in outcome.detail and not outcome.retryable


def test_a_server_that_crashes_mid_call_is_a_tool_error_with_its_stderr_for_an_idempotent_tool(env, demo):
    outcome = env.run(stdio_tool(demo, "crash").model_copy(update={"idempotent": True}), {"code": 3})
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert "exited (exit code 3) before answering" in outcome.detail
    assert "crashing on purpose" in outcome.detail  # the tail of its stderr says why


def test_a_server_that_exits_after_reading_the_call_leaves_a_non_idempotent_calls_outcome_unknown(env, demo):
    # The server had the call (the tool ran, and may have done its work) and exited before answering:
    # reported as a failure, the model would do it again; a human decides, as after a crash mid-call.
    outcome = env.run(stdio_tool(demo, "crash"), {"code": 3})
    assert isinstance(outcome, Unknown), outcome
    assert outcome.detail.startswith("TOOL_ERROR:") and "exited (exit code 3) before answering" in outcome.detail
    assert "crashing on purpose" in outcome.detail and "not idempotent" in outcome.detail


def test_a_secret_in_the_stderr_tail_is_redacted_before_the_tail_is_cut(env):
    # A "server" holding the team's token in its environment writes it to stderr and exits before
    # answering, 20 characters before where the old cut kept the last 600 of the tail: those 20
    # characters of the token matched no redaction rule.
    old_shown = 600
    filler = "z" * (old_shown - 21)
    script = f'printf "%s\\n" "starting" "token $DEMO_TOKEN {filler}" >&2; exit 3'
    server = StdioServer(command=("/bin/sh", "-c", script), env={"DEMO_TOKEN": "secret://team/token"})
    [spec] = tool_specs_from_mcp_stdio(server, [_declared("anything")], timeout_ms=CALL_TIMEOUT_MS)
    outcome = env.run(spec, {})
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert not any(SECRET[i:i + 8] in outcome.detail for i in range(len(SECRET) - 7)), outcome.detail
    assert "exited (exit code 3) before answering; stderr: " in outcome.detail, outcome.detail
    assert "[REDACTED:" in outcome.detail and filler in outcome.detail
    assert not any(SECRET[i:i + 8] in env.ledger_text() for i in range(len(SECRET) - 7))


#: A bare MCP server (no SDK, the system python3) that answers tools/call with a JSON-RPC error (its code
#: in the argv's last argument).
REFUSING_SERVER = """
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("method") == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "refusing", "version": "0"}}
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}), flush=True)
    elif msg.get("method") == "tools/call":
        error = {"code": int(sys.argv[-1]), "message": "refused: bad arguments"}
        print(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "error": error}), flush=True)
"""


@pytest.mark.parametrize(("code", "retryable"), [(-32602, False), (-32603, True)])
def test_a_call_the_server_refuses_with_a_json_rpc_error_is_a_failure_whatever_the_tool(env, code, retryable):
    # The server's own answer to the call says it did not do it: a plain failure, no human needed. Invalid
    # params would be refused again (it was retryable); an internal error may pass.
    server = StdioServer(command=("/usr/bin/python3", "-c", REFUSING_SERVER, str(code)))
    [spec] = tool_specs_from_mcp_stdio(server, [_declared("anything")], timeout_ms=CALL_TIMEOUT_MS)
    outcome = env.run(spec, {})
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert "refused: bad arguments" in outcome.detail and f"the server's JSON-RPC error {code}" in outcome.detail
    assert outcome.retryable is retryable


#: A bare MCP server's start (the system python3, no SDK): it answers the handshake and stops reading
#: at the tools/call; what follows is the server's misbehaviour.
UNTIL_THE_CALL = """
import json, os, sys, time
out = sys.stdout.buffer
def send(o): out.write(json.dumps(o).encode() + b"\\n"); out.flush()
while True:
    msg = json.loads(sys.stdin.readline())
    if msg.get("method") == "server/discover":
        send({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": "Method not found"}})
    elif msg.get("method") == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "bare", "version": "0"}}
        send({"jsonrpc": "2.0", "id": msg["id"], "result": result})
    elif msg.get("method") == "tools/call":
        break
"""

#: Three processes that spin: together they reach the sandbox's CPU limit long before any of them
#: reaches its own RLIMIT_CPU.
CPU_BURNING_SERVER = UNTIL_THE_CALL + """
for _ in range(3):
    if os.fork() == 0:
        while True:
            pass
os.wait()
"""


def test_a_server_killed_at_the_sandboxs_cpu_limit_is_a_cpu_limit_error_not_retried(env):
    server = StdioServer(command=("/usr/bin/python3", "-c", CPU_BURNING_SERVER), limits={"cpu_seconds": 2})
    [spec] = tool_specs_from_mcp_stdio(server, [_declared("anything")], timeout_ms=CALL_TIMEOUT_MS)
    outcome = env.run(spec.model_copy(update={"idempotent": True}), {})
    # Run again, it would burn the same CPU again: not retryable, and it says which limit.
    assert isinstance(outcome, Failed) and outcome.error_code == "TOOL_ERROR", outcome
    assert "CPU limit" in outcome.detail and "CPU_LIMIT" in outcome.detail and not outcome.retryable


#: Pings without end, never reading stdin again.
PING_FLOODING_SERVER = UNTIL_THE_CALL + """
out.write(b"".join(b'{"jsonrpc":"2.0","id":%d,"method":"ping"}\\n' % (10**6 + i) for i in range(5000)))
out.flush()
time.sleep(600)
"""


def test_a_server_that_floods_requests_ends_the_session_at_once(env):
    # Each request from the server was answered by an SDK task of its own, waiting on the server's
    # full stdin: the gateway's memory grew with the flood until the call's timeout.
    server = StdioServer(command=("/usr/bin/python3", "-c", PING_FLOODING_SERVER))
    [spec] = tool_specs_from_mcp_stdio(server, [_declared("anything")], timeout_ms=30_000)
    outcome = env.run(spec.model_copy(update={"idempotent": True}), {})
    assert isinstance(outcome, Failed) and outcome.error_code == "INVALID_RESULT", outcome
    assert "too many requests from the server" in outcome.detail


#: Log notifications without end (or answers to requests nobody sent), never reading stdin again.
FLOODING_SERVERS = {
    "notifications": UNTIL_THE_CALL + """
line = b'{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":"working"}}\\n'
while True:
    out.write(line * 1000)
    out.flush()
""",
    "stray-answers": UNTIL_THE_CALL + """
while True:
    out.write(b"".join(b'{"jsonrpc":"2.0","id":%d,"result":{}}\\n' % (10**6 + i) for i in range(1000)))
    out.flush()
""",
}


@pytest.mark.parametrize("flood", sorted(FLOODING_SERVERS))
def test_a_server_that_floods_notifications_ends_the_session_at_once(env, flood):
    # Each notification cost the SDK a task (each stray answer a log line): the flood kept the session
    # busy until the call's timeout.
    server = StdioServer(command=("/usr/bin/python3", "-c", FLOODING_SERVERS[flood]))
    [spec] = tool_specs_from_mcp_stdio(server, [_declared("anything")], timeout_ms=30_000)
    outcome = env.run(spec.model_copy(update={"idempotent": True}), {})
    assert isinstance(outcome, Failed) and outcome.error_code == "INVALID_RESULT", outcome
    assert "too many notifications from the server" in outcome.detail
    # The call had gone out: for a non-idempotent tool whether it did its work is unknown.
    outcome = env.run(spec, {})
    assert isinstance(outcome, Unknown) and outcome.detail.startswith("INVALID_RESULT:"), outcome


def test_garbage_on_stdout_is_an_invalid_result(env, demo):
    tool = stdio_tool(demo, "add", env={**demo.env, "DEMO_BANNER": "demo server 1.0 starting..."})
    outcome = env.run(tool, {"a": 1, "b": 2})
    assert isinstance(outcome, Failed) and outcome.error_code == "INVALID_RESULT", outcome
    assert "not a JSON-RPC message" in outcome.detail and "demo server 1.0 starting..." in outcome.detail


def test_a_server_that_hangs_is_killed_at_the_timeout(env, demo):
    marker = f"hang-{uuid.uuid4().hex[:12]}"
    # An extra argument the server ignores marks its processes, to look for leftovers.
    tool = stdio_tool(demo, "hang", timeout_ms=3_000, command=[*demo.command, marker])
    outcome = env.run(tool, {"seconds": 600})
    # The server had the call and never answered; the tool is not idempotent: unknown, for a human.
    assert isinstance(outcome, Unknown) and outcome.detail.startswith("TIMEOUT:"), outcome
    assert processes_with(marker) == []  # the sandbox died with the call


def test_a_huge_answer_is_oversized(env, demo):
    tool = stdio_tool(demo, "blob", max_response_bytes=64 * 1024)
    outcome = env.run(tool.model_copy(update={"idempotent": True}), {"size": 2 * 1024 * 1024})
    assert isinstance(outcome, Failed) and outcome.error_code == "OVERSIZED_RESULT", outcome
    assert "larger than 65536 bytes" in outcome.detail
    # The answer to a call the server had cannot be read: for a non-idempotent tool, whether it did its
    # work (or reported an error) is unknown.
    outcome = env.run(tool, {"size": 2 * 1024 * 1024})
    assert isinstance(outcome, Unknown) and outcome.detail.startswith("OVERSIZED_RESULT:"), outcome


# -- what never starts a server --------------------------------------------------------------------
def test_a_path_outside_the_gateways_roots_is_refused(env, demo):
    outside = StdioServer(command=demo.command, read_only_paths=(*demo.read_only_paths, "/etc"), env=demo.env)
    outcome = env.run(stdio_tool(outside, "add"), {"a": 1, "b": 2})
    assert isinstance(outcome, Failed) and outcome.error_code == "EXECUTOR_UNAVAILABLE", outcome
    assert "'/etc' is not under the gateway's MCP stdio roots" in outcome.detail


def test_a_sandbox_that_cannot_start_the_server_is_executor_unavailable(env, demo):
    missing = f"{demo.read_only_paths[-1]}/no-such-dir"  # under a root, but not there
    outcome = env.run(stdio_tool(demo, "add", read_only_paths=[*demo.read_only_paths, missing]), {"a": 1, "b": 2})
    assert isinstance(outcome, Failed) and outcome.error_code == "EXECUTOR_UNAVAILABLE", outcome
    assert "could not start the MCP server" in outcome.detail and "Can't find source path" in outcome.detail


def test_a_config_the_registry_would_refuse_is_not_run(env, demo):
    outcome = env.run(stdio_tool(demo, "add", allow_hosts=["api.example"]), {"a": 1, "b": 2})
    assert isinstance(outcome, Failed) and outcome.error_code == "EXECUTOR_UNAVAILABLE", outcome
    assert "no network" in outcome.detail


def test_a_cancelled_session_leaves_no_sandbox_behind(sandbox):
    # A "server" that reads but never answers: the session waits on its first request until cancelled.
    marker = f"mute-{uuid.uuid4().hex[:12]}"
    mute = StdioServer(command=("/bin/sh", "-c", "cat >/dev/null; true", marker))

    async def session_cancelled_by_its_caller() -> bool:
        with anyio.move_on_after(1.0) as scope:
            await with_sandboxed_server(sandbox, mute, {}, limits=SandboxLimits(wall_seconds=60),
                                        max_message_bytes=1024, timeout_s=60, what="tools/list", use=declared_tools)
        return scope.cancelled_caught

    assert anyio.run(session_cancelled_by_its_caller)
    assert processes_with(marker) == []
