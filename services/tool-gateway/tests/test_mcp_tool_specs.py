"""`tool_specs`: an MCP tool's declared input schema is what the gateway validates its calls against, whatever its root."""

from __future__ import annotations

import json

import pytest

from tether_security.argument_schema import NotAnObjectSchema
from tether_tool_gateway.domain.policy import validate_args
from tether_tool_gateway.executors.mcp_stdio import StdioServer, tool_specs_from_mcp_stdio
from tether_tool_gateway.executors.mcp_tool import McpTool, tool_specs_from_mcp

#: zod's named output in 2020-12 words (as import-mcp hands it over after converting draft-07).
NAMED = {"$ref": "#/$defs/Charge", "$defs": {"Charge": {
    "type": "object", "properties": {"amount": {"type": "integer", "maximum": 100}, "currency": {"enum": ["EUR"]}},
    "required": ["amount", "currency"], "additionalProperties": False}}}
#: A root `anyOf` of two object shapes (a discriminated union), with no root "type".
EITHER = {"anyOf": [{"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
                    {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]}]}


@pytest.mark.parametrize("declared", [NAMED, EITHER], ids=["root-ref", "root-anyOf"])
@pytest.mark.parametrize("specs_of", [lambda tools: tool_specs_from_mcp("http://tools.internal/mcp", tools),
                                      lambda tools: tool_specs_from_mcp_stdio(StdioServer(("/opt/s",)), tools)],
                         ids=["http", "stdio"])
def test_a_tool_whose_schema_root_is_not_type_object_keeps_its_schema(declared, specs_of):
    # Such a schema became {"type": "object"}: every call of the tool passed the gateway's schema check.
    [spec] = specs_of([McpTool("charge", "charges", declared)])
    schema = json.loads(spec.args_schema_json)
    assert schema["type"] == "object" and schema != {"type": "object"}
    problems = {json.dumps(args): validate_args(spec, json.dumps(args)) for args in (
        {"amount": 5, "currency": "EUR"}, {"amount": 500, "currency": "EUR"}, {"amount": 5}, {"id": 1},
        {"email": "a@b"}, {"id": "1"}, {})}
    valid = {args for args, problem in problems.items() if problem is None}
    expected = ({'{"amount": 5, "currency": "EUR"}'} if declared is NAMED else {'{"id": 1}', '{"email": "a@b"}'})
    assert valid == expected, problems


def test_a_tool_whose_schema_matches_no_object_is_refused_by_name():
    tools = [McpTool("fine", "fine", {"type": "object"}),
             McpTool("lookup", "looks up", {"$ref": "#/$defs/Id", "$defs": {"Id": {"type": "string"}}})]
    with pytest.raises(NotAnObjectSchema, match="the input schema of the MCP tool 'lookup' matches no JSON object"):
        tool_specs_from_mcp("http://tools.internal/mcp", tools)
