"""Registration-time checks of 'http' and 'mcp' executor configs."""

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
