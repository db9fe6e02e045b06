"""JSON Schema `format` in an MCP server's input schema (pydantic's datetime, an email field) is asserted
by the gateway's decision under default/4, through a real loopback MCP server, the tools/list import and
the gateway processor; decided under default/3 it stays an annotation, and the audit re-derives both."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated

import pytest
from mcp.server.mcpserver import MCPServer
from pydantic import Field

from tether_contracts.records import ApprovalRequested, ToolCallDenied
from tether_tool_gateway.audit import GatewayAudit
from tether_tool_gateway.domain.policy import TrustPolicy
from tether_tool_gateway.domain.policy_document import DEFAULT_3_POLICY_TEXT, default_policies, index_by_version
from tether_tool_gateway.executors.mcp_tool import list_mcp_tools, tool_specs_from_mcp
from tether_tool_gateway.mcp_testing import start_mcp_server


@pytest.fixture(scope="module")
def invite_spec():
    """`invite` as `tether tools import-mcp` registers it from a server on the Python SDK."""
    server = MCPServer("calendar")
    called: list[dict] = []

    @server.tool(description="Invite someone to a meeting.")
    def invite(email: Annotated[str, Field(json_schema_extra={"format": "email"})], starts: datetime) -> str:
        called.append({"email": email})
        return "invited"

    running = start_mcp_server(server)
    try:
        [spec] = tool_specs_from_mcp(running.url, list_mcp_tools(running.url))
    finally:
        running.stop()
    properties = json.loads(spec.args_schema_json)["properties"]
    assert properties["email"]["format"] == "email" and properties["starts"]["format"] == "date-time"
    assert called == []
    return spec


def decided(make_harness, spec, args, policy_json=None):
    gw = make_harness(tools=[spec], policy_json=policy_json)
    gw.accept()
    emitted = gw.budget(gw.request(spec.name, args))
    gw.log(emitted)
    [payload] = [e.payload for e in emitted]
    policies = {v: TrustPolicy(p) for v, p in index_by_version(default_policies()).items()}
    assert GatewayAudit(policies).check(gw.run_log()) == []
    return payload


GOOD = {"email": "ana@example.com", "starts": "2026-12-01T09:30:00+01:00"}


@pytest.mark.parametrize(("args", "detail"), [
    (GOOD | {"email": "ana at example.com"}, "email: 'ana at example.com' is not a 'email'"),
    (GOOD | {"starts": "next Tuesday"}, "starts: 'next Tuesday' is not a 'date-time'"),
])
def test_a_value_breaking_the_servers_format_is_denied_before_anyone_is_asked(make_harness, invite_spec, args,
                                                                              detail):
    # It was asked of a human (the tool is IRREVERSIBLE), then sent to the server, which may not check it.
    denied = decided(make_harness, invite_spec, args)
    assert isinstance(denied, ToolCallDenied), denied
    assert (denied.reason_code, denied.detail) == ("INVALID_ARGS", detail)
    assert denied.policy_version.startswith("default/4@")


def test_a_well_formed_call_goes_on_and_default_3_leaves_formats_unasserted(make_harness, invite_spec):
    assert isinstance(decided(make_harness, invite_spec, GOOD), ApprovalRequested)
    # A run decided under default/3 (in flight across the upgrade) keeps the verdicts it had.
    under_3 = decided(make_harness, invite_spec, GOOD | {"email": "ana at example.com"},
                      policy_json=DEFAULT_3_POLICY_TEXT)
    assert isinstance(under_3, ApprovalRequested) and under_3.policy_version.startswith("default/3@")
