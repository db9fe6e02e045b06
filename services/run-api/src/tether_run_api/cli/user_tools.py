"""`tether tools import-mcp` and `tether tools update`: a team's MCP server's tools (streamable HTTP or stdio),
and new versions of a tool."""

from __future__ import annotations

import dataclasses
import json
import shlex
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import unquote

import typer

from tether_api.v1 import tool_service_pb2 as tools_pb, types_pb2 as types_pb
from tether_contracts.records import RiskClass
from tether_run_api.cli.client import CliError
from tether_run_api.domain.catalog import DRAFT_2020_12

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


# -- draft-07 input schemas (the MCP TypeScript SDK) to draft 2020-12 ----------------------------------
#: The dialect zod-to-json-schema, under the MCP TypeScript SDK, declares on every tool's input schema.
DRAFT_07 = frozenset({"http://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-07/schema",
                      "https://json-schema.org/draft-07/schema#", "https://json-schema.org/draft-07/schema"})

# Where draft-07 and 2020-12 disagree (json-schema.org release notes of 2019-09 and 2020-12), a keyword
# whose meaning a rename cannot keep is refused, with why. draft-07 ignores the later keywords, which
# 2020-12 would enforce; the gateway validates as 2020-12 whatever the schema says.
_CHANGED = {
    "dependencies": "split into dependentRequired and dependentSchemas in 2019-09; 2020-12 ignores it",
    "additionalItems": "2020-12 ignores it (tuples are prefixItems, and items is what additionalItems was)",
    "$id": "a draft-07 $id may name a plain-name fragment ($anchor since 2019-09) and starts an embedded "
           "resource whose refs are not rewritten here",
    "$schema": "a $schema inside the schema (only the root's is converted)",
    **{k: "not a draft-07 keyword: draft-07 ignores it, 2020-12 enforces it" for k in (
        "$defs", "dependentRequired", "dependentSchemas", "prefixItems", "unevaluatedProperties",
        "unevaluatedItems", "minContains", "maxContains", "$anchor", "$dynamicRef", "$dynamicAnchor",
        "$recursiveRef", "$recursiveAnchor", "$vocabulary")},
}
_SUBSCHEMA = frozenset({"not", "if", "then", "else", "items", "additionalProperties", "contains", "propertyNames"})
_SUBSCHEMA_MAP = frozenset({"properties", "patternProperties", "definitions"})
_SUBSCHEMA_LIST = frozenset({"allOf", "anyOf", "oneOf"})
#: What may stand beside a draft-07 $ref, which makes its siblings ignored: nothing that validates in 2020-12 either.
_REF_SIBLINGS = frozenset({"title", "description", "default", "examples", "$comment", "readOnly", "writeOnly",
                           "definitions"})


class SchemaNotConvertible(Exception):
    """A draft-07 schema uses `keyword` (at JSON pointer `where`), whose meaning differs in draft 2020-12."""

    def __init__(self, keyword: str, where: str, why: str) -> None:
        super().__init__(f"{keyword!r} at {where or '/'}: {why}")
        self.keyword, self.where, self.why = keyword, where, why


def _token(raw: str) -> str:
    return unquote(raw).replace("~1", "/").replace("~0", "~")


def _rewritten_ref(ref: str, where: str) -> str:
    """`ref` pointing where it did once `definitions` is `$defs`: a token renamed only where it is
    the keyword (a property named "definitions" keeps its name)."""
    if not ref.startswith("#"):
        return ref  # another document: resolved the same in both drafts
    fragment = ref[1:]
    if fragment and not fragment.startswith("/"):
        raise SchemaNotConvertible("$ref", where, f"{ref!r} names a draft-07 $id fragment ($anchor since 2019-09)")
    out, state = [], "schema"
    for raw in fragment.split("/")[1:]:
        token = _token(raw)
        if state == "schema" and token == "definitions":
            out.append("$defs")
            state = "map"
            continue
        out.append(raw)
        if state == "schema":
            state = ("schema" if token in _SUBSCHEMA else "map" if token in _SUBSCHEMA_MAP
                     else "list" if token in _SUBSCHEMA_LIST else "data")
        elif state in ("map", "list"):
            state = "schema"
    return "#" + "".join("/" + t for t in out)


def _convert(schema: Any, where: str) -> Any:
    if not isinstance(schema, dict):
        return schema  # true/false mean the same in both; anything else registration refuses
    if "$ref" in schema:
        extra = sorted(set(schema) - _REF_SIBLINGS - {"$ref"})
        if extra:
            raise SchemaNotConvertible("$ref", where, f"draft-07 ignores keywords beside $ref, 2020-12 applies "
                                                      f"them: {', '.join(extra)}")
    out: dict[str, Any] = {}
    for key, value in schema.items():
        at = f"{where}/{key.replace('~', '~0').replace('/', '~1')}"
        if key in _CHANGED:
            raise SchemaNotConvertible(key, at, _CHANGED[key])
        if key == "items" and isinstance(value, list):
            raise SchemaNotConvertible(key, at, "an array of schemas (a tuple) is prefixItems in 2020-12, where "
                                                "items applies to every element")
        if key == "$ref" and isinstance(value, str):
            out[key] = _rewritten_ref(value, at)
        elif key in _SUBSCHEMA:
            out[key] = _convert(value, at)
        elif key in _SUBSCHEMA_MAP and isinstance(value, dict):
            out["$defs" if key == "definitions" else key] = {
                name: _convert(sub, f"{at}/{name.replace('~', '~0').replace('/', '~1')}") for name, sub in value.items()}
        elif key in _SUBSCHEMA_LIST and isinstance(value, list):
            out[key] = [_convert(sub, f"{at}/{i}") for i, sub in enumerate(value)]
        else:
            out[key] = value  # a keyword with the same meaning in both, or data (enum, const, default, examples)
    return out


def draft07_to_2020_12(schema: dict[str, Any]) -> dict[str, Any]:
    """A draft-07 schema (one declaring a DRAFT_07 `$schema`) in draft 2020-12, with the same meaning.

    `$schema` becomes 2020-12 and `definitions` `$defs` (with every local `$ref` into them rewritten);
    every other draft-07 keyword means the same in 2020-12 and is kept. Raises SchemaNotConvertible
    for what means something else there: tuple `items`, `additionalItems`, `dependencies`, keywords
    beside `$ref` that validate, `$id`, and keywords added after draft-07 (which draft-07 ignores).
    A schema declaring any other `$schema`, or none, is returned unchanged."""
    if schema.get("$schema") not in DRAFT_07:
        return schema
    converted = _convert({k: v for k, v in schema.items() if k != "$schema"}, "")
    return {"$schema": DRAFT_2020_12, **converted}


def _in_2020_12(where: str, declared: list[McpTool]) -> list[McpTool]:
    """The declared tools with draft-07 input schemas converted and `"type": "object"` at each root
    (`object_schema`: a root `$ref`, as zod writes a named schema, is kept, and validated as
    declared); a CliError names every tool whose schema cannot be, before anything is registered."""
    from tether_tool_gateway.executors.mcp_tool import NotAnObjectSchema, object_schema

    converted, refused = [], []
    for tool in declared:
        dialect = tool.input_schema.get("$schema", DRAFT_2020_12)
        if dialect not in DRAFT_07 and dialect not in (DRAFT_2020_12, DRAFT_2020_12 + "#"):
            refused.append(f"tool {tool.name!r}: its input schema declares $schema {str(dialect)[:200]!r}, "
                           "neither 2020-12 nor draft-07 (which is converted)")
            continue
        try:
            schema = object_schema(draft07_to_2020_12(tool.input_schema))
        except SchemaNotConvertible as exc:
            refused.append(f"tool {tool.name!r}: its draft-07 input schema uses {exc}")
            continue
        except NotAnObjectSchema as exc:
            refused.append(f"tool {tool.name!r}: its input schema {exc}")
            continue
        converted.append(dataclasses.replace(tool, input_schema=schema))
    if refused:
        raise CliError(f"{where} declares input schemas that would mean something else in JSON Schema "
                       "draft 2020-12, the dialect the gateway validates arguments in, or that no arguments "
                       "object could match; nothing was registered. "
                       + "; ".join(refused) + ". Fix them on the server, or leave those tools out with --only")
    return converted


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
        where = f"the stdio server {shlex.join(server)}"
        declared = _in_2020_12(where, _listed(where, lambda: list_mcp_stdio_tools(source, timeout_s=list_timeout_s),
                                              only))
        specs = tool_specs_from_mcp_stdio(source, declared, **classification)
    else:
        if len(server) != 1 or bind or env:
            raise CliError("give one URL (or --stdio and, after --, the command that starts the server); "
                           "--bind and --env are for --stdio")
        url = server[0]
        headers = _pairs(header, "--header")
        listing_headers = {k: v for k, v in headers.items() if "secret://" not in v}
        declared = _in_2020_12(url, _listed(url, lambda: list_mcp_tools(url, headers=listing_headers,
                                                                         timeout_s=list_timeout_s), only))
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
