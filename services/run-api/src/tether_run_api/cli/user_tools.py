"""`tether tools import-mcp` and `tether tools update`: a team's MCP server's tools (streamable HTTP or stdio),
and new versions of a tool."""

from __future__ import annotations

import json
import shlex
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from tether_api.v1 import tool_service_pb2 as tools_pb, types_pb2 as types_pb
from tether_contracts.records import RiskClass
from tether_run_api.cli.client import CliError

if TYPE_CHECKING:
    from tether_tool_gateway.executors.mcp_tool import McpTool

_RISK = {"read_only": RiskClass.READ_ONLY, "write": RiskClass.WRITE, "irreversible": RiskClass.IRREVERSIBLE}
_RISK_PB = {RiskClass.READ_ONLY: types_pb.RISK_CLASS_READ_ONLY, RiskClass.WRITE: types_pb.RISK_CLASS_WRITE,
            RiskClass.IRREVERSIBLE: types_pb.RISK_CLASS_IRREVERSIBLE}


def _risk(value: str) -> RiskClass:
    try:
        return _RISK[value.lower().replace("-", "_")]
    except KeyError:
        raise CliError(f"--risk-class must be one of {', '.join(_RISK)}") from None


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"{what} must look like NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _json_file(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CliError(f"{path}: {exc}") from None
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _listed(where: str, listing: Callable[[], list[McpTool]], only: list[str]) -> list[McpTool]:
    """The server's declared tools (those named in `only`, if any); a CliError says why listing failed."""
    try:
        declared = listing()
    except Exception as exc:  # a ToolError or a bad URL: say what the server answered
        raise CliError(f"could not list the tools of {where}: {exc}") from None
    if only:
        missing = set(only) - {t.name for t in declared}
        if missing:
            raise CliError(f"the server has no tools named {sorted(missing)}")
        declared = [t for t in declared if t.name in only]
    return declared


def import_mcp(
    server: Annotated[list[str], typer.Argument(
        metavar="URL | -- COMMAND [ARGS]...",
        help="the MCP server's streamable HTTP endpoint (e.g. http://host:8000/mcp), or with --stdio the "
             "command that starts it, after -- (e.g. -- /opt/mcp/crm/bin/python -m crm_mcp)")],
    stdio: Annotated[bool, typer.Option(help="the server speaks MCP over stdio: the gateway runs the command in "
                                             "its sandbox for each call")] = False,
    bind: Annotated[list[str], typer.Option(
        help="--stdio: a host path bound read-only into the sandbox (the server's code and runtime)")] = [],
    env: Annotated[list[str], typer.Option(
        help="--stdio: NAME=VALUE in the server's environment; put secrets as secret://name")] = [],
    prefix: Annotated[str, typer.Option(help="prefix of the Tether tool names (e.g. crm_)")] = "",
    risk_class: Annotated[str, typer.Option(help="read_only | write | irreversible")] = "irreversible",
    idempotent: Annotated[bool, typer.Option(help="re-running a call is safe")] = False,
    untrusted: Annotated[bool, typer.Option(help="the tools' output is untrusted content")] = True,
    egress: Annotated[bool, typer.Option(help="the tools can move data out or contact people")] = True,
    header: Annotated[list[str], typer.Option(
        help="NAME=VALUE sent on each call; put secrets as secret://name")] = [],
    allow_host: Annotated[list[str], typer.Option(
        help="egress allowlist (default: the URL's host)")] = [],
    only: Annotated[list[str], typer.Option(help="import only these server tool names")] = [],
    timeout_ms: Annotated[int, typer.Option(help="per-call timeout")] = 30_000,
    list_timeout_s: Annotated[float, typer.Option(
        help="how long listing may take (a stdio server starts first)")] = 60.0,
    dry_run: Annotated[bool, typer.Option(help="list what would be registered, register nothing")] = False,
) -> None:
    """List an MCP server's tools (tools/list) and register each with the schema it declares.

    Default: the most restrictive class (IRREVERSIBLE: each call needs a human approval; not
    idempotent: never re-run after a crash; untrusted output) until an operator says otherwise.
    Headers and environment variables holding secret:// handles are left out while listing (only
    the gateway resolves them). A --stdio server is listed by running its command here, in the
    same bubblewrap sandbox the gateway uses (never unsandboxed): run this on a gateway host, where
    the command and the bound paths are."""
    from tether_run_api.cli import main
    from tether_tool_gateway.executors.mcp_stdio import StdioServer, list_mcp_stdio_tools, tool_specs_from_mcp_stdio
    from tether_tool_gateway.executors.mcp_tool import list_mcp_tools, tool_specs_from_mcp

    classification = {"prefix": prefix, "risk_class": _risk(risk_class), "idempotent": idempotent,
                      "untrusted_source": untrusted, "egress": egress, "timeout_ms": timeout_ms}
    if stdio:
        if header or allow_host:
            raise CliError("--header and --allow-host are for a streamable HTTP server; a stdio server runs "
                           "without network (give it secrets with --env NAME=secret://name)")
        source = StdioServer(command=tuple(server), read_only_paths=tuple(bind), env=_pairs(env, "--env"))
        declared = _listed(f"the stdio server {shlex.join(server)}",
                           lambda: list_mcp_stdio_tools(source, timeout_s=list_timeout_s), only)
        specs = tool_specs_from_mcp_stdio(source, declared, **classification)
    else:
        if len(server) != 1 or bind or env:
            raise CliError("give one URL (or --stdio and, after --, the command that starts the server); "
                           "--bind and --env are for --stdio")
        url = server[0]
        headers = _pairs(header, "--header")
        listing_headers = {k: v for k, v in headers.items() if "secret://" not in v}
        declared = _listed(url, lambda: list_mcp_tools(url, headers=listing_headers, timeout_s=list_timeout_s),
                           only)
        specs = tool_specs_from_mcp(url, declared, headers=headers or None, allow_hosts=allow_host or None,
                                    **classification)
    client = None if dry_run else main._client()
    for spec in specs:
        if client is None:
            main.render.console.print(f"would register {spec.name} ({spec.risk_class.value}) ← "
                                      f"{json.loads(spec.executor_config_json)['tool']}")
            continue
        tool = tools_pb.Tool(
            name=spec.name, description=spec.description[:2000], args_schema_json=spec.args_schema_json,
            risk_class=_RISK_PB[spec.risk_class], idempotent=spec.idempotent, untrusted_source=spec.untrusted_source,
            executor_kind=spec.executor_kind, executor_config_json=spec.executor_config_json,
            timeout_ms=spec.timeout_ms, egress=spec.egress, constraints_json=spec.constraints_json)
        t = client.call(client.tools.RegisterTool,
                        tools_pb.RegisterToolRequest(tool=tool, request_id=str(uuid.uuid4()))).tool
        main.render.console.print(f"registered tool {t.name} v{t.version} ({spec.risk_class.value})")
    if not specs:
        main.render.console.print("the server declares no tools")


def update(
    name: str,
    risk_class: Annotated[str | None, typer.Option(help="read_only | write | irreversible")] = None,
    idempotent: Annotated[bool | None, typer.Option("--idempotent/--not-idempotent")] = None,
    untrusted: Annotated[bool | None, typer.Option("--untrusted/--trusted")] = None,
    egress: Annotated[bool | None, typer.Option("--egress/--no-egress")] = None,
    timeout_ms: Annotated[int | None, typer.Option(help="per-call timeout")] = None,
    description: Annotated[str | None, typer.Option(help="shown to the model")] = None,
    executor_config: Annotated[Path | None, typer.Option(help="JSON file: the new executor config")] = None,
    constraints: Annotated[Path | None, typer.Option(help="JSON file: the new argument constraints")] = None,
    args_schema: Annotated[Path | None, typer.Option(help="JSON file: the new argument schema")] = None,
) -> None:
    """Register the next version of a tool: the latest version with the given changes.

    Runs already running keep the version they started with (their snapshot); new runs get this one."""
    from tether_run_api.cli import main

    client = main._client()
    tool = client.call(client.tools.GetTool, tools_pb.GetToolRequest(name=name, version=0)).tool
    for field in ("version", "disabled", "create_time", "created_by"):
        tool.ClearField(field)
    if risk_class is not None:
        tool.risk_class = _RISK_PB[_risk(risk_class)]
    for field, value in (("idempotent", idempotent), ("untrusted_source", untrusted), ("egress", egress),
                         ("timeout_ms", timeout_ms), ("description", description),
                         ("executor_config_json", _json_file(executor_config)),
                         ("constraints_json", _json_file(constraints)), ("args_schema_json", _json_file(args_schema))):
        if value is not None:
            setattr(tool, field, value)
    t = client.call(client.tools.RegisterTool,
                    tools_pb.RegisterToolRequest(tool=tool, request_id=str(uuid.uuid4()))).tool
    main.render.console.print(f"tool {t.name} is now v{t.version}")
