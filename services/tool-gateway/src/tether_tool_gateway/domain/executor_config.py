"""Registration-time checks of an 'http', 'mcp' or 'mcp_stdio' tool's executor config (pure: run-api calls them on
RegisterTool; the gateway checks again before each call)."""

from __future__ import annotations

import posixpath
import re
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from tether_security import Redactor

_HANDLE = re.compile(r"secret://[A-Za-z0-9._/-]+")
#: Header values are checked for secret-looking text (the same rules the log redactor uses).
_SECRETS = Redactor()
_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_MAX_ATTEMPTS = 10
#: Query (or fragment) parameters that carry a credential, compared lower-case without '-' and '_': the
#: registered config is copied into the run log (kept forever) and the catalog, so such a URL is refused.
_CREDENTIAL_PARAMS = frozenset({"apikey", "key", "token", "accesstoken", "sig", "signature", "secret", "password",
                                "clientsecret", "auth", "passwd", "pwd", "accesskey", "privatekey", "authtoken"})
#: Parameter names ending so also carry one (`X-Amz-Signature`, `X-Amz-Security-Token`, `sas_token`, `x-api-key`).
_CREDENTIAL_SUFFIXES = ("signature", "token", "secret", "password", "apikey", "credential")
_USE_A_HANDLE = ("send it in a header whose value is a secret://<name> handle instead, or put one in the url's "
                 "path (a webhook's token path)")


def _url_problems(config: dict[str, Any]) -> list[str]:
    url = config.get("url")
    if not isinstance(url, str):
        return ["'url' is required (the tool's endpoint)"]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ["'url' must be an absolute http(s) URL"]
    if parts.username or parts.password:
        return ["'url' must not carry credentials; use a header with a secret:// handle"]
    if len(_HANDLE.findall(url)) != len(_HANDLE.findall(parts.path)):
        return ["a secret:// handle may stand in the 'url' only in its path (e.g. "
                "https://hooks.example/services/secret://team/hook)"]
    problems = _url_credential_problems(url, parts)
    if problems:
        return problems
    allow = config.get("allow_hosts")
    if allow is None:
        return []
    if not isinstance(allow, list) or not all(isinstance(h, str) and h for h in allow):
        return ["'allow_hosts' must be a list of host names"]
    if parts.hostname.lower() not in {h.lower() for h in allow}:
        return [f"the url's host {parts.hostname!r} is not in 'allow_hosts'"]
    return []


def _url_credential_problems(url: str, parts: SplitResult) -> list[str]:
    """A credential in the url's query (or fragment), by its parameter's name or by its shape; never quotes it."""
    params = parse_qsl(parts.query, keep_blank_values=True) + parse_qsl(parts.fragment, keep_blank_values=True)
    names = sorted({name for name, _ in params})
    credentials = [name for name in names if _names_a_credential(name)]
    if credentials:
        which = (f"query parameter {credentials[0]!r} names a credential" if len(credentials) == 1
                 else f"query parameters {', '.join(map(repr, credentials))} name credentials")
        return [f"'url' must not carry credentials: {which}; {_USE_A_HANDLE}"]
    if _secret_in_url(url, parts, [value for _, value in params]):
        return [f"'url' must not carry credentials: it holds what looks like a secret value (in its path, query "
                f"or fragment); {_USE_A_HANDLE}"]
    return []


def _secret_in_url(url: str, parts: SplitResult, values: list[str]) -> bool:
    findings = _SECRETS.findings(_HANDLE.sub("", url))
    if any(not f.kind.startswith("high_entropy") for f in findings):
        return True  # a shape (a Slack webhook, a GitHub token, ...), which may span the path
    if not findings:
        return False
    # The entropy rules read a URL as one base64 run ('/' is a base64 character), so an ordinary path
    # with an id in it would pass for a secret: judge each path segment and query value alone.
    return any(_secret_looking(unquote(piece)) for piece in [*_HANDLE.sub("", parts.path).split("/"), *values])


def _names_a_credential(name: str) -> bool:
    bare = name.lower().replace("-", "").replace("_", "")
    return bare in _CREDENTIAL_PARAMS or bare.endswith(_CREDENTIAL_SUFFIXES)


def _header_problems(config: dict[str, Any]) -> list[str]:
    headers = config.get("headers", {})
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        return ["'headers' must be an object of strings"]
    problems = []
    for name, value in headers.items():
        if name.lower() == "idempotency-key":
            problems.append("'Idempotency-Key' is set by the gateway (the call's key)")
        if _secret_looking(value) or (name.lower() in ("authorization", "x-api-key", "cookie")
                                      and not _HANDLE.search(value)):
            problems.append(f"header {name!r} holds what looks like a secret value; store it in the secret "
                            "store and reference it as secret://<name>")
    return problems


def _int_problem(config: dict[str, Any], key: str, low: int, high: int) -> list[str]:
    value = config.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        return []
    return [f"'{key}' must be an integer from {low} to {high}"]


def _secret_looking(value: str) -> bool:
    # Whatever is left once the handles are taken out must not look like a credential.
    return bool(_SECRETS.findings(_HANDLE.sub("", value)))


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_PATHS = 32
_MAX_ARGS = 64
#: Sandbox limits a stdio server's config may set (e.g. more address space for a JIT runtime), and their caps.
STDIO_LIMIT_CAPS = {
    "memory_bytes": 16 << 30,
    "cpu_seconds": 600,
    "max_processes": 1024,
    "max_open_files": 65536,
    "max_file_bytes": 1 << 30,
    "tmp_bytes": 4 << 30,
    "work_bytes": 4 << 30,
}
_STDIO_KEYS = {"command", "tool", "read_only_paths", "env", "max_response_bytes", "limits"}


def _stdio_problems(config: dict[str, Any]) -> list[str]:
    problems = []
    unknown = sorted(set(config) - _STDIO_KEYS)
    if {"url", "headers", "allow_hosts"} & set(unknown):
        problems.append("a stdio MCP server runs in the gateway's sandbox, which has no network: 'url', 'headers' "
                        "and 'allow_hosts' do not apply (a server that needs the network is registered as "
                        "executor_kind 'mcp', over streamable HTTP)")
    elif unknown:
        problems.append(f"unknown keys {unknown}; an 'mcp_stdio' config has {sorted(_STDIO_KEYS)}")
    command = config.get("command")
    if (not isinstance(command, list) or not command or len(command) > _MAX_ARGS
            or not all(isinstance(a, str) and a and "\x00" not in a for a in command)):
        problems.append(f"'command' is required: the server's argv, a list of 1 to {_MAX_ARGS} non-empty strings")
    elif any("secret://" in a or _secret_looking(a) for a in command):
        problems.append("'command' must not carry secrets (a command line is visible to every user of the host); "
                        "pass them in 'env' as secret://<name> handles")
    paths = config.get("read_only_paths", [])
    if not isinstance(paths, list) or len(paths) > _MAX_PATHS or not all(isinstance(p, str) for p in paths):
        problems.append(f"'read_only_paths' must be a list of at most {_MAX_PATHS} absolute paths")
    else:
        for path in paths:
            if not path.startswith("/") or path == "/" or posixpath.normpath(path) != path or "\x00" in path:
                problems.append(f"read-only path {path!r} must be an absolute, normalized path other than /")
    env = config.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        problems.append("'env' must be an object of strings")
    else:
        for name, value in env.items():
            if not _ENV_NAME.match(name) or "\x00" in value:
                problems.append(f"environment variable {name!r}: the name must be [A-Za-z_][A-Za-z0-9_]*, the value "
                                "without NUL bytes")
            elif _secret_looking(value):
                problems.append(f"environment variable {name!r} holds what looks like a secret value; store it in "
                                "the secret store and reference it as secret://<name>")
    limits = config.get("limits", {})
    if not isinstance(limits, dict):
        problems.append("'limits' must be an object")
    else:
        for name in limits:
            cap = STDIO_LIMIT_CAPS.get(name)
            if cap is None:
                problems.append(f"'limits' may set {sorted(STDIO_LIMIT_CAPS)}, not {name!r}")
            else:
                problems += _int_problem(limits, name, 1, cap)
    return problems


def executor_config_problems(kind: str, config: dict[str, Any]) -> list[str]:
    """What is wrong with an executor config of kind 'http', 'mcp' or 'mcp_stdio' (other kinds: not checked here)."""
    if kind == "mcp_stdio":
        problems = _stdio_problems(config)
        problems += _int_problem(config, "max_response_bytes", 1, _MAX_RESPONSE_BYTES)
        if not isinstance(config.get("tool"), str) or not config["tool"]:
            problems.append("'tool' is required (the tool's name on the MCP server)")
        return problems
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
