"""A team's own tools behind the gateway: an HTTP tool service (the dev HTTP sink), a local MCP server, and an
MCP server over stdio that the gateway runs in its sandbox.

The agent calls them through the gateway like any built-in tool; the calls are recorded with their
decisions. The HTTP sink records each request at once and answers 4 s later, so a SIGKILL of the
gateway lands between the effect and its answer: an idempotent tool is re-run with the same
Idempotency-Key (the service can apply it once); a non-idempotent one gets ToolCallOutcomeUnknown.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import (
    RiskClass,
    RunTerminated,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallDenied,
    ToolCallFailed,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
    ToolSpec,
)
from tether_messaging.chain import verify_chain
from tether_messaging.serde import open_payload
from tether_testing.system import SystemConfig, TetherSystem
from tether_tool_gateway.executors.mcp_stdio import StdioServer, list_mcp_stdio_tools, tool_specs_from_mcp_stdio
from tether_tool_gateway.executors.mcp_tool import list_mcp_tools, tool_specs_from_mcp
from tether_tool_gateway.mcp_testing import (
    RunningMcpServer,
    StdioDemoUnavailable,
    shared_stdio_demo,
    start_mcp_server,
)

pytestmark = pytest.mark.e2e

SCENARIOS = Path(__file__).parent / "scenarios"
SINK_DELAY_MS = 6_000  # the window to read the ledger and kill in: ample on a loaded machine
#: The team's token: in the gateway's secret source (environment) only; team_lookup sends it as a header.
SECRET = "tok-e2e-7f3a9c2d5b8e41f6a0c9d7e3b1f5a8c2"
OUTCOMES = (ToolCallCompleted, ToolCallFailed, ToolCallDenied, ToolCallOutcomeUnknown)
ARGS_SCHEMA = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 200}}, "required": ["q"],
               "additionalProperties": False}


def http_tool(name: str, url: str, *, idempotent: bool, headers: dict[str, str] | None = None) -> ToolSpec:
    config = {"url": url, **({"headers": headers} if headers else {})}
    return ToolSpec(name=name, version=1, description=f"The team's {name} service.",
                    args_schema_json=json.dumps(ARGS_SCHEMA), risk_class=RiskClass.WRITE, idempotent=idempotent,
                    untrusted_source=False, executor_kind="http", executor_config_json=json.dumps(config),
                    timeout_ms=20_000)


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[RunningMcpServer]:
    server = start_mcp_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stdio_demo() -> StdioServer:
    """The stdio demo server as the gateway's sandbox runs it (`make setup` installs what it needs)."""
    try:
        return shared_stdio_demo()
    except StdioDemoUnavailable as exc:
        pytest.fail(f"the sandbox cannot run the stdio demo server on this machine: {exc}")


@pytest.fixture(scope="module")
def tether_system(kafka_bootstrap: str, pg_dsn: str, redis_url: str, mcp_server: RunningMcpServer,
                  stdio_demo: StdioServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[TetherSystem]:
    """This module's own system; its HTTP sink answers late. The demo tenant also gets the team's tools."""
    gateway_env = {"TETHER_GATEWAY_SECRETS_ENV_PREFIX": "TEAMSECRET_", "TEAMSECRET_TEAM_TOKEN": SECRET}
    # The operator lets stdio tools bind the demo server's files (and nothing else) into their sandbox.
    gateway_env["TETHER_GATEWAY_MCP_STDIO_ROOTS"] = json.dumps(list(stdio_demo.read_only_paths))
    system = TetherSystem(SystemConfig(
        kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, redis_url=redis_url,
        workdir=tmp_path_factory.mktemp("tether-user-tools"), partitions=2, scenarios=[SCENARIOS],
        sink_delay_ms={"http": SINK_DELAY_MS}, extra_env={"tool-gateway": gateway_env},
    ))
    try:
        system.start()
        register_team_tools(system, mcp_server, stdio_demo)
        yield system
    finally:
        system.stop()
        leftovers = [name for name, proc in system.processes.items() if proc.running]
        system.drop_data()
    assert not leftovers, f"processes of the system still running after stop(): {leftovers}"


def register_team_tools(system: TetherSystem, mcp_server: RunningMcpServer, stdio_demo: StdioServer) -> None:
    """The built-in tools plus the team's: three HTTP tools, the MCP server's tools and the stdio server's
    `where` (imported from their tools/list; the operator marks them READ_ONLY, else each call would wait
    for an approval). `where` gets the team's token in its environment, by handle."""
    from tether_run_api import admin
    from tether_run_api.adapters.postgres import PostgresStore, migrate, open_pool
    from tether_tool_gateway.builtin_tools import builtin_tool_specs

    base = system.sink_urls["http"]
    team = [http_tool("team_lookup", f"{base}/team/lookup", idempotent=True,
                      headers={"Authorization": "Bearer secret://team/token"}),
            http_tool("team_note", f"{base}/team/note", idempotent=True),
            http_tool("team_ticket", f"{base}/team/ticket", idempotent=False)]
    team += tool_specs_from_mcp(mcp_server.url, list_mcp_tools(mcp_server.url), prefix="demo_",
                                risk_class=RiskClass.READ_ONLY, egress=False)
    server = StdioServer(command=stdio_demo.command, read_only_paths=stdio_demo.read_only_paths,
                         env={**stdio_demo.env, "DEMO_TOKEN": "secret://team/token"})
    declared = [t for t in list_mcp_stdio_tools(server, timeout_s=120) if t.name == "where"]
    # A server start per call: allow for a busy machine (an answered call returns at once).
    team += tool_specs_from_mcp_stdio(server, declared, prefix="sd_", risk_class=RiskClass.READ_ONLY,
                                      egress=False, timeout_ms=120_000)
    tools = builtin_tool_specs(kv_url=system.sink_urls["kv"], smtp_host="127.0.0.1", smtp_port=system.smtp_port,
                               email_from=system.config.email_from, http_allow_hosts=["127.0.0.1"]) + team
    model = system.config.model
    agent = admin.demo_agent_spec(model.provider, model.name, [t.name for t in tools],
                                  context_window_tokens=model.context_window_tokens)
    pool = open_pool(system.config.pg_dsn, max_size=2)
    try:
        migrate(pool, system.names.run_api_schema)
        admin.bootstrap_demo(PostgresStore(pool, system.names.run_api_schema), tenant_id=system.config.tenant_id,
                             principal_id=system.config.principal_id, approver_id=system.config.approver_id,
                             tools=tools, agent=agent, now_ms=time.time_ns() // 1_000_000,
                             api_key=system.bootstrap.api_key, approver_key=system.bootstrap.approver_key)
    finally:
        pool.close()


def idem_key(run_id: str, step: int, call_index: int) -> str:
    return hashlib.sha256(f"{run_id}\x1f{step}\x1f{call_index}".encode()).hexdigest()


def wait_until(what: str, found: Callable[[], object], runs, timeout_s: float = 90.0, poll_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while not (value := found()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f}s\n{runs.logs()}")
        time.sleep(poll_s)
    return value


def check_log(log) -> list:
    assert [e.seq for e in log] == list(range(1, len(log) + 1)) and verify_chain(log) == []
    return [open_payload(e) for e in log]


def ledger_row(system: TetherSystem, pg_dsn: str, key: str) -> dict | None:
    with psycopg.connect(pg_dsn, row_factory=dict_row) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {}.tool_calls WHERE idem_key = %s").format(
            sql.Identifier(system.names.gateway_schema)), (key,)).fetchone()


def sink_calls(system: TetherSystem, path: str) -> list[dict]:
    return [r for r in system.sink_records("http") if r["path"] == path]


def crash_gateway(system: TetherSystem) -> None:
    status = system.kill("tool-gateway")
    assert status == -9, f"the gateway was not SIGKILLed (exit status {status})"
    system.restart("tool-gateway")


def ledger_text(system: TetherSystem, pg_dsn: str) -> str:
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT * FROM {}.tool_calls").format(
            sql.Identifier(system.names.gateway_schema))).fetchall()
    return repr(rows)


@pytest.mark.timeout(300)
def test_an_agent_uses_a_teams_http_tool_and_mcp_tool(tether_system, mcp_server, runs, event_log, pg_dsn):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-user-tools] Look the order up and add.")
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
    payloads = check_log(event_log.run(run_id))
    def call_of(p) -> str | None:
        return p.call.call_id if isinstance(p, ToolCallRequested) else getattr(p, "call_id", None)

    for call_id, tool in (("1.0", "team_lookup"), ("1.1", "demo_add")):
        # Requested by the model, budgeted, allowed by the policy (its ToolCallAuthorized) and executed.
        trail = [type(p).__name__ for p in payloads if call_of(p) == call_id]
        assert trail == ["ToolCallRequested", "ToolCallBudgeted", "ToolCallAuthorized", "ToolCallCompleted"], \
            (call_id, trail)
        [requested] = [p for p in payloads if isinstance(p, ToolCallRequested) and p.call.call_id == call_id]
        assert requested.call.tool_name == tool
    done = {p.call_id: p for p in payloads if isinstance(p, ToolCallCompleted)}
    assert done["1.0"].tool_name == "team_lookup" and done["1.1"].tool_name == "demo_add"
    # The HTTP service got the validated arguments, POSTed with the call's idempotency key.
    [lookup] = [r for r in sink_calls(system, "/team/lookup") if r["idempotency_key"] == idem_key(run_id, 1, 0)]
    assert lookup["method"] == "POST" and lookup["json"] == {"q": f"order {run_id}"}
    assert json.loads(done["1.0"].result_json)["body"]["echo"]["json"] == {"q": f"order {run_id}"}
    # The MCP server ran tools/call; its result is recorded as untrusted content.
    assert {"tool": "add", "args": {"a": 2, "b": 40}} in mcp_server.calls
    assert done["1.1"].untrusted and json.loads(done["1.1"].result_json)["structured_content"] == {"result": 42}
    assert sorted(p.call_id for p in payloads if isinstance(p, ToolCallBudgeted)) == ["1.0", "1.1"]
    # The secret header reached the service (which echoed it back) and nothing else: not the log of
    # events (the echo was redacted), not the ledger, not the gateway's log.
    assert lookup["authorization"] == f"Bearer {SECRET}"
    assert "[REDACTED" in done["1.0"].result_json
    assert SECRET not in repr(event_log.run(run_id)) and SECRET not in repr(payloads)
    assert SECRET not in ledger_text(system, pg_dsn)
    for name in system.processes:
        log_file = system.log_path(name)
        assert not log_file.exists() or SECRET not in log_file.read_text(errors="replace"), name


@pytest.mark.timeout(300)
def test_an_agent_uses_a_teams_mcp_stdio_tool_run_in_the_sandbox(tether_system, stdio_demo, runs, event_log,
                                                                  pg_dsn):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-user-tools-stdio] Where does the team's server run?")
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
    payloads = check_log(event_log.run(run_id))
    # Requested by the model, budgeted, allowed by the policy (its ToolCallAuthorized) and executed.
    trail = [type(p).__name__ for p in payloads
             if (p.call.call_id if isinstance(p, ToolCallRequested) else getattr(p, "call_id", None)) == "1.0"]
    assert trail == ["ToolCallRequested", "ToolCallBudgeted", "ToolCallAuthorized", "ToolCallCompleted"], trail
    [done] = [p for p in payloads if isinstance(p, ToolCallCompleted)]
    assert done.tool_name == "sd_where" and done.untrusted
    # The server ran inside the gateway's sandbox: uid 65534, bwrap's host name, loopback only.
    facts = json.loads(done.result_json)["structured_content"]
    assert (facts["uid"], facts["hostname"], facts["interfaces"]) == (65534, "sandbox", ["lo"])
    # Its environment had the team's token (it echoed it back: redacted before it was recorded), and
    # the token is nowhere else: not the log of events, not the ledger, not a process's log.
    assert facts["env"]["DEMO_TOKEN"].startswith("[REDACTED")
    assert SECRET not in repr(event_log.run(run_id)) and SECRET not in ledger_text(system, pg_dsn)
    for name in system.processes:
        log_file = system.log_path(name)
        assert not log_file.exists() or SECRET not in log_file.read_text(errors="replace"), name


@pytest.mark.timeout(300)
def test_an_idempotent_http_tool_killed_mid_call_is_applied_once(tether_system, runs, event_log, pg_dsn):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-user-tools-note] Take a note.")
    key = idem_key(run_id, 1, 0)
    wait_until("the note did not reach the service",
               lambda: [r for r in sink_calls(system, "/team/note") if r["idempotency_key"] == key], runs)
    row = ledger_row(system, pg_dsn, key)
    assert row is not None and row["status"] is None, f"the call already has a result: {row}"
    crash_gateway(system)  # the service has the request; the gateway was still waiting for its answer
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_COMPLETED, runs.logs()
    payloads = check_log(event_log.run(run_id))
    assert [(p.call_id, p.tool_name) for p in payloads if isinstance(p, OUTCOMES)] == [("1.0", "team_note")]
    # Re-run by the successor with the same key: one effect for a service that deduplicates by it.
    notes = [r for r in sink_calls(system, "/team/note") if r["json"] == {"q": f"note {run_id}"}]
    assert len(notes) == 2 and {r["idempotency_key"] for r in notes} == {key}, notes
    assert ledger_row(system, pg_dsn, key)["attempt"] == 2


@pytest.mark.timeout(300)
def test_a_non_idempotent_http_tool_killed_mid_call_has_an_unknown_outcome(tether_system, runs, event_log, pg_dsn):
    system = tether_system
    run_id = system.client.submit("[scenario:e2e-user-tools-ticket] File a ticket.")
    key = idem_key(run_id, 1, 0)
    events = system.client.follow(run_id, timeout_s=240)
    wait_until("the ticket did not reach the service",
               lambda: [r for r in sink_calls(system, "/team/ticket") if r["idempotency_key"] == key], runs)
    row = ledger_row(system, pg_dsn, key)
    assert row is not None and row["status"] is None, f"the call already has a result: {row}"
    crash_gateway(system)
    ask = json.loads(next(e for e in events if e.event_type == "tether.v1.ApprovalRequested").payload_json)
    assert ask["reasons"] == ["OUTCOME_UNKNOWN"] and ask["call_id"] == "1.0", ask
    system.approver.decide(ask["approval_id"], ask["args_hash"], approve=False, comment="ticket not found")
    list(events)
    run = runs.wait_for_end(run_id)
    assert run.status == runs_pb.RUN_STATUS_TERMINATED, runs.logs()
    payloads = check_log(event_log.run(run_id))
    assert [type(p).__name__ for p in payloads if isinstance(p, OUTCOMES)] == ["ToolCallOutcomeUnknown"]
    assert isinstance(payloads[-1], RunTerminated) and payloads[-1].reason_code == "OUTCOME_UNKNOWN"
    # Never re-run: the service saw the ticket exactly once.
    assert len([r for r in sink_calls(system, "/team/ticket") if r["idempotency_key"] == key]) == 1
    assert ledger_row(system, pg_dsn, key)["status"] == "OUTCOME_UNKNOWN"
