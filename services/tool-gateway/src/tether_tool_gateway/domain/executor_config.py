"""Registration-time checks of an 'http' or 'mcp' tool's executor config (pure: run-api calls them on RegisterTool)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from tether_security import Redactor

_HANDLE = re.compile(r"secret://[A-Za-z0-9._/-]+")
#: Header values are checked for secret-looking text (the same rules the log redactor uses).
_SECRETS = Redactor()
_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_MAX_ATTEMPTS = 10


def _url_problems(config: dict[str, Any]) -> list[str]:
    url = config.get("url")
    if not isinstance(url, str):
        return ["'url' is required (the tool's endpoint)"]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ["'url' must be an absolute http(s) URL"]
    if parts.username or parts.password:
        return ["'url' must not carry credentials; use a header with a secret:// handle"]
    allow = config.get("allow_hosts")
    if allow is None:
        return []
    if not isinstance(allow, list) or not all(isinstance(h, str) and h for h in allow):
        return ["'allow_hosts' must be a list of host names"]
    if parts.hostname.lower() not in {h.lower() for h in allow}:
        return [f"the url's host {parts.hostname!r} is not in 'allow_hosts'"]
    return []


def _header_problems(config: dict[str, Any]) -> list[str]:
    headers = config.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        return ["'headers' must be an object of strings"]
    problems = []
    for name, value in headers.items():
        if name.lower() == "idempotency-key":
            problems.append("'Idempotency-Key' is set by the gateway (the call's key)")
        # Whatever is left once the handles are taken out must not look like a credential.
        if _SECRETS.findings(_HANDLE.sub("", value)) or (name.lower() in ("authorization", "x-api-key", "cookie")
                                                         and not _HANDLE.search(value)):
            problems.append(f"header {name!r} holds what looks like a secret value; store it in the secret "
                            "store and reference it as secret://<name>")
    return problems


def _int_problem(config: dict[str, Any], key: str, low: int, high: int) -> list[str]:
    value = config.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        return []
    return [f"'{key}' must be an integer from {low} to {high}"]


def executor_config_problems(kind: str, config: dict[str, Any]) -> list[str]:
    """What is wrong with an executor config of kind 'http' or 'mcp' (other kinds: nothing checked here)."""
    if kind not in ("http", "mcp"):
        return []
    problems = _url_problems(config) + _header_problems(config)
    problems += _int_problem(config, "max_response_bytes", 1, _MAX_RESPONSE_BYTES)
    if kind == "http":
        problems += _int_problem(config, "max_attempts", 1, _MAX_ATTEMPTS)
        problems += _int_problem(config, "attempt_timeout_ms", 100, 600_000)
    elif not isinstance(config.get("tool"), str) or not config["tool"]:
        problems.append("'tool' is required (the tool's name on the MCP server)")
    return problems
