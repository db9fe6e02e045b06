"""Registration-time checks of 'http', 'mcp' and 'mcp_stdio' executor configs."""

from __future__ import annotations

import pytest

from tether_tool_gateway.domain.executor_config import executor_config_problems

URL = "https://tools.example/lookup"


def test_a_config_with_secret_handles_passes():
    config = {"url": URL, "headers": {"Authorization": "Bearer secret://team/token", "X-Team": "payments"},
              "max_response_bytes": 1024, "max_attempts": 3}
    assert executor_config_problems("http", config) == []
    assert executor_config_problems("mcp", {"url": URL, "tool": "search"}) == []


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer abc"},
                                     {"X-Token": "sk-proj-a8f7d9s6f5a4s3d2f1g0h9j8k7l6"}])
def test_a_secret_value_in_a_header_is_refused(headers):
    [problem] = executor_config_problems("http", {"url": URL, "headers": headers})
    assert "secret://" in problem


@pytest.mark.parametrize("config, fragment", [
    ({}, "'url' is required"),
    ({"url": "ftp://tools.example/x"}, "absolute http(s)"),
    ({"url": "https://user:pw@tools.example/x"}, "credentials"),
    ({"url": URL, "allow_hosts": ["other.example"]}, "not in 'allow_hosts'"),
    ({"url": URL, "headers": {"Idempotency-Key": "x"}}, "set by the gateway"),
    ({"url": URL, "max_attempts": 0}, "'max_attempts'"),
    ({"url": URL, "max_response_bytes": "big"}, "'max_response_bytes'"),
])
def test_bad_http_configs_are_refused(config, fragment):
    assert any(fragment in p for p in executor_config_problems("http", config))


def test_an_mcp_config_names_the_servers_tool():
    assert executor_config_problems("mcp", {"url": URL}) == ["'tool' is required (the tool's name on the MCP server)"]


def test_other_kinds_are_not_checked_here():
    assert executor_config_problems("builtin", {}) == []


# -- mcp_stdio ---------------------------------------------------------------------------------------
STDIO = {"command": ["/opt/mcp/crm/bin/python", "-m", "crm_mcp"], "tool": "find_customer",
         "read_only_paths": ["/opt/mcp/crm"], "env": {"CRM_TOKEN": "secret://crm/token", "CRM_REGION": "eu"},
         "max_response_bytes": 65536, "limits": {"memory_bytes": 2 << 30}}


def test_a_stdio_config_with_secret_handles_in_env_passes():
    assert executor_config_problems("mcp_stdio", STDIO) == []
    assert executor_config_problems("mcp_stdio", {"command": ["/usr/bin/python3", "-m", "x"], "tool": "t"}) == []


@pytest.mark.parametrize("change, fragment", [
    ({"command": None}, "'command' is required"),
    ({"command": []}, "'command' is required"),
    ({"command": "/opt/mcp/crm/bin/python -m crm_mcp"}, "'command' is required"),
    ({"command": ["/opt/x", "--token", "secret://crm/token"]}, "must not carry secrets"),
    ({"command": ["/opt/x", "--token=sk-proj-a8f7d9s6f5a4s3d2f1g0h9j8k7l6"]}, "must not carry secrets"),
    ({"env": {"CRM_TOKEN": "ghp_abcdefghijklmnopqrstuvwxyz0123456789"}}, "looks like a secret value"),
    ({"env": {"BAD-NAME": "x"}}, "[A-Za-z_][A-Za-z0-9_]*"),
    ({"env": ["CRM_TOKEN"]}, "'env' must be an object"),
    ({"read_only_paths": ["opt/mcp"]}, "absolute, normalized"),
    ({"read_only_paths": ["/opt/mcp/../../etc"]}, "absolute, normalized"),
    ({"read_only_paths": ["/"]}, "absolute, normalized"),
    ({"read_only_paths": "/opt/mcp"}, "'read_only_paths' must be a list"),
    ({"limits": {"wall_seconds": 60}}, "'limits' may set"),
    ({"limits": {"memory_bytes": 1 << 40}}, "'memory_bytes' must be an integer"),
    ({"url": "http://tools.example/mcp"}, "no network"),
    ({"allow_hosts": ["api.example"]}, "no network"),
    ({"workdir": "/tmp"}, "unknown keys ['workdir']"),
    ({"max_response_bytes": 0}, "'max_response_bytes'"),
    ({"tool": ""}, "'tool' is required"),
])
def test_bad_stdio_configs_are_refused(change, fragment):
    config = {k: v for k, v in (STDIO | change).items() if v is not None}
    problems = executor_config_problems("mcp_stdio", config)
    assert any(fragment in p for p in problems), problems
