"""The built-in tools' argument schemas and default ToolSpecs, in one place (run-api registers them for the demo).

Data only: importing this module pulls in no HTTP or SMTP code. The executor that runs them
is `tether_tool_gateway.executors.builtin.BuiltinExecutor` (executor_kind "builtin"); the
spec's executor_config_json says which built-in and where its service is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tether_contracts.records import RiskClass, ToolSpec

EXECUTOR_KIND = "builtin"

HTTP_GET = "http_get"
KV_PUT = "kv_put"
KV_GET = "kv_get"
SEND_EMAIL = "send_email"
BUILTIN_TOOL_NAMES = (HTTP_GET, KV_PUT, KV_GET, SEND_EMAIL)

_KEY = {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[A-Za-z0-9._:/-]+$"}

HTTP_GET_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "url": {"type": "string", "minLength": 8, "maxLength": 2048, "pattern": "^https?://"},
    },
    "required": ["url"],
    "additionalProperties": False,
}

KV_PUT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"key": _KEY, "value": {"description": "Any JSON value."}},
    "required": ["key", "value"],
    "additionalProperties": False,
}

KV_GET_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {"key": _KEY},
    "required": ["key"],
    "additionalProperties": False,
}

SEND_EMAIL_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "to": {"type": "string", "maxLength": 254, "pattern": "^[^@\\s<>,;]+@[^@\\s<>,;]+\\.[^@\\s<>,;]+$"},
        "subject": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": "^[^\\r\\n]*$"},
        "body": {"type": "string", "maxLength": 20000},
    },
    "required": ["to", "subject", "body"],
    "additionalProperties": False,
}

ARGS_SCHEMAS: dict[str, dict[str, Any]] = {
    HTTP_GET: HTTP_GET_SCHEMA,
    KV_PUT: KV_PUT_SCHEMA,
    KV_GET: KV_GET_SCHEMA,
    SEND_EMAIL: SEND_EMAIL_SCHEMA,
}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def http_get_spec(allow_hosts: Sequence[str], *, max_body_bytes: int = 1024 * 1024, timeout_ms: int = 10_000,
                  version: int = 1, headers: dict[str, str] | None = None) -> ToolSpec:
    """GET a URL on an allowlisted host. Read-only, egress (the URL leaves); its output is untrusted content.

    `headers` are sent with every request; values may reference secrets by handle
    (`{"Authorization": "Bearer secret://news/token"}`), resolved by the gateway at execution time.
    """
    config: dict[str, Any] = {"builtin": HTTP_GET, "allow_hosts": sorted({h.lower() for h in allow_hosts}),
                              "max_body_bytes": max_body_bytes}
    if headers:
        config["headers"] = dict(headers)
    return ToolSpec(
        name=HTTP_GET,
        version=version,
        description="Fetch a web page or JSON document with HTTP GET. Only some hosts are reachable; "
                    "redirects to other hosts are not followed. Returns status, content type and body text.",
        args_schema_json=_json(HTTP_GET_SCHEMA),
        risk_class=RiskClass.READ_ONLY,
        idempotent=True,
        untrusted_source=True,
        executor_kind=EXECUTOR_KIND,
        executor_config_json=_json(config),
        timeout_ms=timeout_ms,
        # A GET sends its URL to the host: a URL the model composed can carry data out (in the
        # query or the path), so on a tainted run it needs a human — unless the policy lets it
        # follow a link the run was given (taint.follow_links, on in the default policy).
        egress=True,
        # The gateway refuses other hosts before the call runs (CONSTRAINT_VIOLATION); the
        # executor checks again, and also refuses redirects to other origins.
        constraints_json=_json({"rules": [{"kind": "egress", "arg": "/url",
                                           "hosts": sorted({h.lower() for h in allow_hosts})}]}),
    )


def kv_put_spec(kv_url: str, *, timeout_ms: int = 10_000, version: int = 1) -> ToolSpec:
    """Write a key in the KV store; the call's idem_key is sent as Idempotency-Key, so it is idempotent.

    Each tenant has its own keys (the executor puts the key under the tenant's id)."""
    return ToolSpec(
        name=KV_PUT,
        version=version,
        description="Store a JSON value under a key in the key-value store (overwrites the key).",
        args_schema_json=_json(KV_PUT_SCHEMA),
        risk_class=RiskClass.WRITE,
        idempotent=True,
        untrusted_source=False,
        # What it stores, later runs read back with kv_get as trusted content: a run that has read
        # untrusted content must not launder it there without a human (it moves data out of the run).
        egress=True,
        executor_kind=EXECUTOR_KIND,
        executor_config_json=_json({"builtin": KV_PUT, "base_url": kv_url.rstrip("/")}),
        timeout_ms=timeout_ms,
    )


def kv_get_spec(kv_url: str, *, timeout_ms: int = 10_000, version: int = 1) -> ToolSpec:
    """Read a key from the KV store."""
    return ToolSpec(
        name=KV_GET,
        version=version,
        description="Read the JSON value stored under a key in the key-value store.",
        args_schema_json=_json(KV_GET_SCHEMA),
        risk_class=RiskClass.READ_ONLY,
        idempotent=True,
        untrusted_source=False,
        executor_kind=EXECUTOR_KIND,
        executor_config_json=_json({"builtin": KV_GET, "base_url": kv_url.rstrip("/")}),
        timeout_ms=timeout_ms,
    )


def send_email_spec(smtp_host: str, smtp_port: int, from_addr: str, *, timeout_ms: int = 15_000,
                    version: int = 1, recipient_domains: Sequence[str] | None = None,
                    recipient_addresses: Sequence[str] = ()) -> ToolSpec:
    """Send an email over SMTP. Irreversible (contacts people), egress, and not idempotent.

    With `recipient_domains` (or `recipient_addresses`), other recipients are refused before the
    call runs (CONSTRAINT_VIOLATION); without, any address may be proposed (a human approves).
    """
    rules = []
    if recipient_domains is not None or recipient_addresses:
        rules.append({"kind": "recipients", "arg": "/to", "domains": sorted(recipient_domains or ()),
                      "addresses": sorted(recipient_addresses)})
    return ToolSpec(
        name=SEND_EMAIL,
        version=version,
        description="Send a plain-text email to one recipient. Needs a human approval before it is sent.",
        args_schema_json=_json(SEND_EMAIL_SCHEMA),
        risk_class=RiskClass.IRREVERSIBLE,
        idempotent=False,
        untrusted_source=False,
        executor_kind=EXECUTOR_KIND,
        executor_config_json=_json({"builtin": SEND_EMAIL, "smtp_host": smtp_host, "smtp_port": smtp_port,
                                    "from_addr": from_addr}),
        timeout_ms=timeout_ms,
        egress=True,
        constraints_json=_json({"rules": rules}) if rules else "{}",
    )


def builtin_tool_specs(*, kv_url: str, smtp_host: str, smtp_port: int, email_from: str,
                       http_allow_hosts: Sequence[str],
                       email_recipient_domains: Sequence[str] | None = None) -> list[ToolSpec]:
    """The default ToolSpecs of every built-in tool, pointing at the given services."""
    return [
        http_get_spec(http_allow_hosts),
        kv_put_spec(kv_url),
        kv_get_spec(kv_url),
        send_email_spec(smtp_host, smtp_port, email_from, recipient_domains=email_recipient_domains),
    ]


RUN_CODE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "code": {"type": "string", "minLength": 1, "maxLength": 100_000},
        "stdin": {"type": "string", "maxLength": 1_000_000},
    },
    "required": ["code"],
    "additionalProperties": False,
}


def sandbox_code_spec(*, name: str = "run_python", interpreter: Sequence[str] = ("/usr/bin/python3",),
                      timeout_ms: int = 30_000, limits: dict[str, Any] | None = None, version: int = 1) -> ToolSpec:
    """Run a script in a fresh bubblewrap sandbox (executor_kind "sandbox"): no network, no secrets,
    a private work dir that vanishes afterwards. It changes nothing outside, so it is READ_ONLY
    and idempotent; its output is what the model's own code printed (not untrusted content)."""
    config: dict[str, Any] = {"interpreter": list(interpreter), "script_arg": "code", "stdin_arg": "stdin"}
    if limits:
        config["limits"] = dict(limits)
    return ToolSpec(
        name=name,
        version=version,
        description=f"Run a {interpreter[0].rsplit('/', 1)[-1]} script in an isolated sandbox without network "
                    "access. Returns exit_code, stdout and stderr; resource limits end runaway scripts.",
        args_schema_json=_json(RUN_CODE_SCHEMA),
        risk_class=RiskClass.READ_ONLY,
        idempotent=True,
        untrusted_source=False,
        executor_kind="sandbox",
        executor_config_json=_json(config),
        timeout_ms=timeout_ms,
    )
