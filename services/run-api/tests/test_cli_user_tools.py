"""`tether tools import-mcp` against a real local MCP server and `tether tools update`, on a run-api with fakes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from tether_run_api import handlers
from tether_run_api.api.server import start_server
from tether_run_api.api.servicers import Services
from tether_run_api.cli import main as cli
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_MEMBER, Principal, hash_api_key
from tether_run_api.testing import FakeApiKeys, FakeCatalog, FakeLedger, FakeLiveEvents, FakePublisher, FakeReadModel
from tether_tool_gateway.mcp_testing import start_mcp_server

KEY = "tk_cli_" + "u" * 30
ME = Principal("acme", "alice", frozenset({ROLE_ADMIN, ROLE_MEMBER}))


@pytest.fixture
def env(monkeypatch) -> Iterator[Services]:
    keys = FakeApiKeys()
    keys.keys[hash_api_key(KEY)] = ME
    services = Services(
        keys=keys, catalog=FakeCatalog(), ledger=FakeLedger(), read_model=FakeReadModel(), live=FakeLiveEvents(),
        publisher=FakePublisher(), limiter=SubmitRateLimiter(100, 100), partitioning=handlers.Partitioning(3),
        stream_policy=handlers.StreamPolicy(block_ms=10, gap_wait_s=0.5, gap_poll_s=0.01),
    )
    server = start_server(services, port=0, workers=4)
    monkeypatch.setenv("TETHER_ADDR", f"127.0.0.1:{server.port}")
    monkeypatch.setenv("TETHER_API_KEY", KEY)
    cli._reset()
    yield services
    cli._reset()
    server.stop(0)


@pytest.fixture
def mcp_server():
    server = start_mcp_server()
    yield server
    server.stop()


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), catch_exceptions=True)


def failure(result) -> str:
    """What a failed command said (main() prints a CliError; the test runner hands it back)."""
    assert result.exit_code != 0
    return result.output + str(result.exception or "")


def tool(name: str) -> dict:
    return json.loads(invoke("--json", "tools", "get", name).stdout)


def test_import_mcp_registers_each_declared_tool_most_restrictive_by_default(env, mcp_server):
    out = invoke("tools", "import-mcp", mcp_server.url, "--prefix", "demo_",
                 "--header", "Authorization=Bearer secret://team/mcp").output
    assert "registered tool demo_add v1 (IRREVERSIBLE)" in out and "demo_shout" in out and "demo_fail" in out
    add = tool("demo_add")
    assert add["risk_class"] == "RISK_CLASS_IRREVERSIBLE" and add["untrusted_source"] and add.get("egress")
    assert not add.get("idempotent")
    assert add["executor_kind"] == "mcp"
    config = json.loads(add["executor_config_json"])
    assert config == {"headers": {"Authorization": "Bearer secret://team/mcp"}, "tool": "add", "url": mcp_server.url}
    assert json.loads(add["args_schema_json"])["required"] == ["a", "b"]
    assert mcp_server.calls == []  # listing runs no tool


def test_import_mcp_with_an_operators_class_and_a_subset(env, mcp_server):
    out = invoke("tools", "import-mcp", mcp_server.url, "--only", "shout", "--risk-class", "read_only",
                 "--idempotent").output
    assert "registered tool shout v1 (READ_ONLY)" in out and "add" not in out
    assert tool("shout")["risk_class"] == "RISK_CLASS_READ_ONLY" and tool("shout")["idempotent"]


def test_import_mcp_from_a_server_that_is_down_says_so(env):
    result = invoke("tools", "import-mcp", "http://127.0.0.1:9/mcp")
    assert "could not list the tools" in failure(result)


def test_update_registers_the_next_version_with_the_changes(env, mcp_server):
    invoke("tools", "import-mcp", mcp_server.url, "--only", "add")
    out = invoke("tools", "update", "add", "--risk-class", "write", "--timeout-ms", "5000").output
    assert "tool add is now v2" in out
    latest = tool("add")
    assert latest["version"] == 2 and latest["risk_class"] == "RISK_CLASS_WRITE" and latest["timeout_ms"] == 5000
    first = json.loads(invoke("--json", "tools", "get", "add", "--version", "1").stdout)
    assert first["risk_class"] == "RISK_CLASS_IRREVERSIBLE"  # runs pinned to v1 keep it


def test_a_secret_value_in_a_header_is_refused_at_registration(env, mcp_server):
    result = invoke("tools", "import-mcp", mcp_server.url, "--only", "add", "--header", "Authorization=Bearer abc")
    assert "secret://" in failure(result)


# -- a stdio server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stdio_demo():
    from tether_tool_gateway.mcp_testing import StdioDemoUnavailable, shared_stdio_demo

    try:
        return shared_stdio_demo()
    except StdioDemoUnavailable as exc:
        pytest.fail(f"the sandbox cannot run the demo server from this checkout: {exc}")


def stdio_args(demo) -> list[str]:
    args = ["--stdio"]
    for path in demo.read_only_paths:
        args += ["--bind", path]
    for name, value in demo.env.items():
        args += ["--env", f"{name}={value}"]
    return args


def test_import_mcp_over_stdio_lists_in_the_sandbox_and_registers_most_restrictive(env, stdio_demo):
    out = invoke("tools", "import-mcp", *stdio_args(stdio_demo), "--env", "DEMO_TOKEN=secret://team/demo",
                 "--list-timeout-s", "120",
                 "--prefix", "sd_", "--only", "add", "--only", "where", "--", *stdio_demo.command).output
    assert "registered tool sd_add v1 (IRREVERSIBLE)" in out and "registered tool sd_where v1" in out, out
    add = tool("sd_add")
    assert add["executor_kind"] == "mcp_stdio" and add["risk_class"] == "RISK_CLASS_IRREVERSIBLE"
    assert add["untrusted_source"] and add.get("egress") and not add.get("idempotent")
    assert json.loads(add["executor_config_json"]) == {
        "command": list(stdio_demo.command), "read_only_paths": list(stdio_demo.read_only_paths),
        "env": {**stdio_demo.env, "DEMO_TOKEN": "secret://team/demo"}, "tool": "add"}
    assert json.loads(add["args_schema_json"])["required"] == ["a", "b"]


def test_import_mcp_over_stdio_of_a_command_that_cannot_run_says_so(env):
    result = invoke("tools", "import-mcp", "--stdio", "--", "/nonexistent/mcp-server")
    assert "could not list the tools of the stdio server /nonexistent/mcp-server" in failure(result)


@pytest.mark.parametrize("args, fragment", [
    (["--stdio", "--header", "X=1", "--", "/bin/true"], "a stdio server runs without network"),
    (["--bind", "/opt", "http://127.0.0.1:9/mcp"], "--bind and --env are for --stdio"),
    (["http://127.0.0.1:9/mcp", "extra"], "give one URL"),
])
def test_import_mcp_refuses_mixed_up_options(env, args, fragment):
    assert fragment in failure(invoke("tools", "import-mcp", *args))
