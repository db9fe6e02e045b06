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


@pytest.mark.parametrize("kind", ["http", "mcp"])
def test_a_url_whose_path_holds_a_secret_handle_passes(kind):
    # A Slack incoming webhook: its token path comes from the secret store at execution time.
    config = {"url": "https://hooks.slack.com/services/secret://slack/incident_hook", "tool": "t"}
    assert executor_config_problems(kind, config) == []


@pytest.mark.parametrize("url", ["https://secret://slack/hook/x", "https://hooks.example/a?to=secret://slack/hook",
                                 "https://hooks.example/a#secret://slack/hook"])
def test_a_secret_handle_elsewhere_in_the_url_is_refused(url):
    [problem] = executor_config_problems("http", {"url": url})
    assert "only in its path" in problem


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


# A registered config is copied into SubmitRun/RunAccepted (the run log, kept forever) and the catalog.
@pytest.mark.parametrize("url", [
    "https://api.example/v1/lookup?api_key=sk_live_4eC39HqLyjWDarjtT1zdp7dc",
    "https://api.example/v1/lookup?q=1&APIKEY=a1b2c3",
    "https://api.example/v1/lookup?Key=abc",
    "https://api.example/v1/lookup?token=t0k3n-value",
    "https://api.example/v1/lookup?access_token=ya29.a0AfH6SMBx",
    "https://api.example/v1/lookup?sig=abc",
    "https://api.example/v1/lookup?signature=abc",
    "https://api.example/v1/lookup?secret=hunter2hunter2",
    "https://api.example/v1/lookup?password=hunter2",
    "https://api.example/v1/lookup?client_secret=abc",
    "https://api.example/v1/lookup?auth=abc",
    "https://api.example/v1/lookup?X-Amz-Security-Token=abc",
    "https://api.example/v1/lookup#access_token=abc",
    # Azure blob SAS: the signature is the last of several ordinary-looking parameters.
    "https://acct.blob.core.windows.net/c/b.json?sv=2022-11-02&ss=b&srt=o&sp=r&se=2030-01-01T00:00:00Z"
    "&spr=https&sig=8yZ0q2kVHcXkP1mD5w7rT9uJ3nL6sB4aE2fG0hI8jK0%3D",
    # A Slack incoming webhook: the token is the path; so are a Telegram bot's and a generic hook's.
    "https://hooks.slack.com/services/T0A1B2C3D/B0E4F5G6H/aBcDeFgHiJkLmNoPqRsTuVwX",
    "https://api.telegram.org/bot123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw/sendMessage",
    "https://tools.example/hooks/Xk9pL2mQ7rT4vW8yZ1bN6cD3fG5hJ0aK/run",
    # A secret-shaped value under an innocent name.
    "https://api.example/v1/lookup?q=ghp_abcdefghijklmnopqrstuvwxyz0123456789",
])
@pytest.mark.parametrize("kind", ["http", "mcp"])
def test_a_credential_in_the_url_is_refused(url, kind):
    problems = executor_config_problems(kind, {"url": url, "tool": "search"})
    assert len(problems) == 1 and problems[0].startswith("'url' must not carry credentials"), problems
    assert "secret://<name>" in problems[0]
    # The refusal names the parameter at most, never its value.
    assert not any(len(v) >= 6 and v in problems[0] for v in _query_values(url))


def _query_values(url: str) -> list[str]:
    from urllib.parse import parse_qsl, urlsplit
    parts = urlsplit(url)
    return [v for _, v in parse_qsl(parts.query) + parse_qsl(parts.fragment)] + parts.path.split("/")


@pytest.mark.parametrize("url", ["https://tools.example/search?q=1&page=2",
                                 "https://tools.example/v2/orders?status=open&limit=50&sort=-created_at",
                                 "https://tools.example/lookup?monkey=banana&keyword=tether",
                                 "https://tools.example/t/3f2a9c1e-5b7d-4e8f-9a0b-1c2d3e4f5a6b/lookup",
                                 "https://tools.example/v1/orders?cursor=eyJwYWdlIjoyfQ%3D%3D"])
def test_an_ordinary_query_string_passes(url):
    assert executor_config_problems("http", {"url": url}) == []


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
