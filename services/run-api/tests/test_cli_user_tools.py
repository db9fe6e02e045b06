"""`tether tools import-mcp` against a real local MCP server (draft-07 input schemas converted to 2020-12) and
`tether tools update`, on a run-api with fakes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from jsonschema import Draft7Validator
from mcp.server.mcpserver import MCPServer
from mcp_types import Tool as McpToolInfo, methods as mcp_methods
from typer.testing import CliRunner

from tether_contracts.records import RiskClass, ToolSpec
from tether_run_api import handlers
from tether_run_api.api.server import start_server
from tether_run_api.api.servicers import Services
from tether_run_api.cli import main as cli, user_tools
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_MEMBER, Principal, hash_api_key
from tether_run_api.testing import FakeApiKeys, FakeCatalog, FakeLedger, FakeLiveEvents, FakePublisher, FakeReadModel
from tether_tool_gateway.domain.policy import validate_args
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


# -- a TypeScript MCP server: draft-07 input schemas ---------------------------------------------------
DRAFT_07 = "http://json-schema.org/draft-07/schema#"
#: What zod-to-json-schema (the MCP TypeScript SDK) declares: draft-07, reused objects under `definitions`.
TICKET = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "requester": {"$ref": "#/definitions/person", "description": "who asks"},
        "watchers": {"type": "array", "items": {"$ref": "#/definitions/person"}},
        "labels": {"type": "object", "properties": {"definitions": {"type": "string"}},
                   "additionalProperties": {"$ref": "#/properties/labels/properties/definitions"}},
        "priority": {"type": "string", "enum": ["low", "high"]},
    },
    "required": ["title", "requester"],
    "additionalProperties": False,
    "definitions": {"person": {"type": "object", "properties": {"email": {"type": "string", "pattern": "@"}},
                               "required": ["email"], "additionalProperties": False}},
    "$schema": DRAFT_07,
}
#: draft-07 schemas that mean something else in 2020-12, nested where a server puts them.
REORDER = {"type": "object", "$schema": DRAFT_07, "properties": {"lines": {
    "type": "array", "items": [{"type": "string"}, {"type": "integer"}], "additionalItems": False}}}
REFUND = {"type": "object", "$schema": DRAFT_07, "properties": {"amount": {"type": "number"}},
          "dependencies": {"amount": ["approval_code"]}}
LEGACY = {"type": "object", "$schema": "http://json-schema.org/draft-04/schema#"}  # not converted: refused


class TypeScriptLikeServer(MCPServer):
    """Declares the given input schemas as they are, like an MCP server built on the TypeScript SDK."""

    def __init__(self, schemas: dict[str, dict]) -> None:
        super().__init__("ts-like")
        self.schemas = schemas

    async def list_tools(self) -> list[McpToolInfo]:
        return [McpToolInfo(name=name, description=f"the {name} tool", input_schema=schema)
                for name, schema in self.schemas.items()]


@pytest.fixture
def ts_server():
    server = start_mcp_server(TypeScriptLikeServer({"create_ticket": TICKET, "reorder": REORDER,
                                                    "refund": REFUND, "legacy": LEGACY}))
    yield server
    server.stop()


def _verdicts(schema_json: str, instances: list[dict]) -> list[bool]:
    spec = ToolSpec(name="t", version=1, description="d", args_schema_json=schema_json, risk_class=RiskClass.WRITE,
                    idempotent=False, untrusted_source=True, executor_kind="mcp")
    return [validate_args(spec, json.dumps(i)) is None for i in instances]


TICKET_CALLS = [
    {"title": "t", "requester": {"email": "a@x"}},
    {"title": "t", "requester": {"email": "a@x"}, "watchers": [{"email": "b@x"}], "priority": "high"},
    {"title": "t", "requester": {}},  # the referenced definition's `required`
    {"title": "t", "requester": {"email": "a@x"}, "watchers": [{"email": "b@x", "name": "B"}]},  # nested, by $ref
    {"title": "t", "requester": {"email": "nope"}},
    {"title": "t", "requester": {"email": "a@x"}, "labels": {"definitions": "x", "team": 3}},
    {"title": "", "requester": {"email": "a@x"}},
    {"title": "t", "requester": {"email": "a@x"}, "extra": 1},
]


def test_import_mcp_converts_a_draft_07_schema_to_2020_12_with_the_same_meaning(env, ts_server):
    # Since 42eca13 run-api refuses a $schema other than 2020-12, so every tool of a TypeScript MCP
    # server failed to import. Its schema now registers in 2020-12 (definitions as $defs, the refs
    # into them rewritten) and the gateway decides every call as draft-07 would have.
    out = invoke("tools", "import-mcp", ts_server.url, "--only", "create_ticket").output
    assert "registered tool create_ticket v1 (IRREVERSIBLE)" in out, out
    stored = tool("create_ticket")["args_schema_json"]
    schema = json.loads(stored)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "definitions" not in schema and schema["$defs"] == TICKET["definitions"]
    assert schema["properties"]["requester"] == {"$ref": "#/$defs/person", "description": "who asks"}
    assert schema["properties"]["watchers"]["items"] == {"$ref": "#/$defs/person"}
    # A property named "definitions" is not the keyword: neither it nor the ref to it is renamed.
    assert schema["properties"]["labels"]["additionalProperties"] == {
        "$ref": "#/properties/labels/properties/definitions"}
    as_draft_07 = [Draft7Validator(TICKET).is_valid(i) for i in TICKET_CALLS]
    assert as_draft_07 == [True, True, False, False, False, False, False, False]
    assert _verdicts(stored, TICKET_CALLS) == as_draft_07


def test_import_mcp_refuses_draft_07_schemas_whose_meaning_changed_naming_tool_and_keyword(env, ts_server):
    result = invoke("tools", "import-mcp", ts_server.url)
    said = failure(result)
    assert "tool 'reorder'" in said and "'items' at /properties/lines/items" in said, said
    assert "tool 'refund'" in said and "'dependencies' at /dependencies" in said
    assert "tool 'legacy'" in said and "draft-04" in said
    assert "create_ticket" not in said and "nothing was registered" in said and "--only" in said
    assert env.catalog.tools == {}  # not even the tool that converts: the import is all or nothing
    assert invoke("tools", "import-mcp", ts_server.url, "--only", "refund", "--dry-run").exit_code != 0


#: zod's named output (`zodToJsonSchema(schema, "Ticket")`): the root only refers to a definition, no root "type".
NAMED_TICKET = {
    "$ref": "#/definitions/Ticket",
    "definitions": {"Ticket": {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "@"},
                       "cc": {"type": "array", "items": {"$ref": "#/definitions/Ticket"}}},
        "required": ["email"],
        "additionalProperties": False,
    }},
    "$schema": DRAFT_07,
}
NAMED_CALLS = [{"email": "a@x"}, {"email": "a@x", "cc": [{"email": "b@x"}]}, {}, {"email": "nope"},
               {"email": "a@x", "extra": 1}, {"email": "a@x", "cc": [{"email": "b@x", "extra": 1}]}]


@pytest.fixture
def unchecked_listing(monkeypatch):
    """The Python SDK's server refuses to send an input schema without a root "type" (its own result
    model), which servers on other SDKs send and the client reads: let tools/list through as declared."""
    checked = mcp_methods.serialize_server_result

    def as_declared(method, version, data, **kwargs):
        return dict(data) if method == "tools/list" else checked(method, version, data, **kwargs)

    monkeypatch.setattr(mcp_methods, "serialize_server_result", as_declared)


def test_import_mcp_keeps_a_named_schema_whose_root_is_a_ref_and_validates_calls_as_declared(env,
                                                                                           unchecked_listing):
    # The root had no "type": "object", so the import registered {"type": "object"}: any arguments passed.
    running = start_mcp_server(TypeScriptLikeServer({"named_ticket": NAMED_TICKET}))
    try:
        out = invoke("tools", "import-mcp", running.url).output
    finally:
        running.stop()
    assert "registered tool named_ticket v1 (IRREVERSIBLE)" in out, out
    stored = tool("named_ticket")["args_schema_json"]
    schema = json.loads(stored)
    assert schema["type"] == "object" and schema["required"] == ["email"] and "$ref" not in schema
    assert schema["properties"]["cc"]["items"] == {"$ref": "#/$defs/Ticket"}  # draft-07's definitions, converted
    as_draft_07 = [Draft7Validator(NAMED_TICKET).is_valid(i) for i in NAMED_CALLS]
    assert as_draft_07 == [True, True, False, False, False, False]
    assert _verdicts(stored, NAMED_CALLS) == as_draft_07


def test_import_mcp_refuses_a_schema_no_arguments_object_can_match(env, unchecked_listing):
    running = start_mcp_server(TypeScriptLikeServer({
        "lookup": {"$ref": "#/definitions/Id", "definitions": {"Id": {"type": "string"}}, "$schema": DRAFT_07},
        "fine": {"type": "object"}}))
    try:
        said = failure(invoke("tools", "import-mcp", running.url))
    finally:
        running.stop()
    assert "tool 'lookup'" in said and "matches no JSON object" in said and "'string'" in said, said
    assert "nothing was registered" in said and "fine" not in said
    assert env.catalog.tools == {}


# -- the conversion, keyword by keyword ---------------------------------------------------------------
@pytest.mark.parametrize("schema, converted", [
    ({"$schema": DRAFT_07 + "", "type": "object", "properties": {"a": {"type": "string", "format": "email"}}},
     {"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}),
    ({"$schema": "http://json-schema.org/draft-07/schema", "type": "object",
      "allOf": [{"$ref": "#/definitions/a"}], "definitions": {"a": {"definitions": {"b": {"type": "integer"}},
                                                                    "properties": {"x": {"$ref": "#/definitions/a/definitions/b"}}}}},
     {"type": "object", "allOf": [{"$ref": "#/$defs/a"}],
      "$defs": {"a": {"$defs": {"b": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/a/$defs/b"}}}}}),
    ({"$schema": DRAFT_07, "type": "object", "properties": {"n": {"exclusiveMinimum": 0, "const": 3,
                                                                  "default": {"definitions": 1, "$ref": "#/x"}}}},
     {"type": "object", "properties": {"n": {"exclusiveMinimum": 0, "const": 3,
                                             "default": {"definitions": 1, "$ref": "#/x"}}}}),  # data stays data
])
def test_a_draft_07_schema_that_means_the_same_is_rewritten(schema, converted):
    assert user_tools.draft07_to_2020_12(schema) == {"$schema": "https://json-schema.org/draft/2020-12/schema",
                                                    **converted}


@pytest.mark.parametrize("schema, keyword, where", [
    ({"properties": {"a": {"$ref": "#/definitions/x", "type": "string"}}}, "$ref", "/properties/a"),
    ({"properties": {"a": {"$ref": "#thing"}}}, "$ref", "/properties/a/$ref"),
    ({"properties": {"a": {"$id": "#thing"}}}, "$id", "/properties/a/$id"),
    ({"anyOf": [{"additionalItems": False}]}, "additionalItems", "/anyOf/0/additionalItems"),
    ({"definitions": {"p": {"unevaluatedProperties": False}}}, "unevaluatedProperties",
     "/definitions/p/unevaluatedProperties"),
    ({"properties": {"a": {"dependentRequired": {"b": ["c"]}}}}, "dependentRequired",
     "/properties/a/dependentRequired"),
    ({"properties": {"a/b": {"prefixItems": []}}}, "prefixItems", "/properties/a~1b/prefixItems"),
    ({"not": {"$schema": DRAFT_07}}, "$schema", "/not/$schema"),
])
def test_a_draft_07_schema_that_would_mean_something_else_is_refused_where_it_does(schema, keyword, where):
    with pytest.raises(user_tools.SchemaNotConvertible) as err:
        user_tools.draft07_to_2020_12({"$schema": DRAFT_07, "type": "object", **schema})
    assert (err.value.keyword, err.value.where) == (keyword, where)


def test_a_schema_in_another_dialect_is_left_as_it_is():
    for schema in ({"type": "object", "items": [{}]}, {"$schema": "https://json-schema.org/draft/2020-12/schema"},
                   {"$schema": "http://json-schema.org/draft-04/schema#", "dependencies": {}}):
        assert user_tools.draft07_to_2020_12(schema) is schema
