"""taint.mcp_tool_descriptions (default/3): an untrusted MCP server's tool descriptions and schemas reach
the model from the first step, so a run whose snapshot holds such a tool is tainted from its start;
decided from the recorded snapshot, so the audit re-derives it, and default/2's decisions are kept."""

from __future__ import annotations

import json

import pytest

from tether_contracts.records import ApprovalRequested, ToolCallAuthorized
from tether_tool_gateway.audit import GatewayAudit
from tether_tool_gateway.builtin_tools import builtin_tool_specs
from tether_tool_gateway.domain.policy import TrustPolicy
from tether_tool_gateway.domain.policy_document import (
    DEFAULT_1_POLICY_TEXT,
    DEFAULT_2_POLICY_TEXT,
    default_policies,
    index_by_version,
)
from tether_tool_gateway.executors.mcp_stdio import StdioServer, tool_specs_from_mcp_stdio
from tether_tool_gateway.executors.mcp_tool import McpTool, list_mcp_tools, tool_specs_from_mcp
from tether_tool_gateway.handlers import call_decision_inputs
from tether_tool_gateway.mcp_testing import start_mcp_server

DEFAULT_2 = DEFAULT_2_POLICY_TEXT
SECRET = "4711-0815"
#: What a poisoned description asks for: the goal's account in a URL to an allowed host.
LEAK = f"http://127.0.0.1/c?d={SECRET}-JaneRoe"
GOAL = f"Reconcile account {SECRET} of Jane Roe; the statement is at http://127.0.0.1/statement"


def builtins():
    return builtin_tool_specs(kv_url="http://127.0.0.1:1", smtp_host="127.0.0.1", smtp_port=1,
                              email_from="agent@tether.test", http_allow_hosts=["127.0.0.1"])


def only(emitted, kind):
    payloads = [e.payload for e in emitted]
    assert [type(p) for p in payloads] == [kind], payloads
    return payloads[0]


def audit_all_defaults(gw):
    policies = {v: TrustPolicy(p) for v, p in index_by_version(default_policies()).items()}
    return GatewayAudit(policies).check(gw.run_log())


@pytest.fixture(scope="module")
def mcp_specs():
    """The demo MCP server's tools as `tether tools import-mcp` makes them (a real loopback server)."""
    server = start_mcp_server()
    try:
        return tool_specs_from_mcp(server.url, list_mcp_tools(server.url), prefix="demo_")
    finally:
        server.stop()


def first_fetch(make_harness, tools, url, policy_json=None):
    gw = make_harness(tools=[*builtins(), *tools], policy_json=policy_json)
    gw.accept(goal=GOAL)
    call = gw.request("http_get", {"url": url})
    emitted = gw.budget(call)
    gw.log(emitted)
    return gw, call, emitted


def test_a_run_offered_an_untrusted_mcp_servers_tools_is_tainted_from_its_first_step(make_harness, mcp_specs):
    assert all(s.untrusted_source and s.executor_kind == "mcp" for s in mcp_specs)
    gw, call, emitted = first_fetch(make_harness, mcp_specs, LEAK)
    req = only(emitted, ApprovalRequested)
    assert req.reasons == ["TAINTED_EGRESS"] and req.policy_version.startswith("default/4@")
    assert gw.driver.pending == {} and gw.executor.requests == []
    inputs = call_decision_inputs(gw.driver.states["run-1"], gw.call_state(call), recorded_at_ms=0)
    assert inputs.tainted_by == () and inputs.tool_taint == tuple(sorted(f"tools:{s.name}" for s in mcp_specs))
    assert audit_all_defaults(gw) == []


def test_a_link_the_goal_gave_is_still_followed_on_such_a_run(make_harness, mcp_specs):
    gw, _, emitted = first_fetch(make_harness, mcp_specs, "http://127.0.0.1/statement")
    assert only(emitted, ToolCallAuthorized).reasons[-1] == "EGRESS_FOLLOWS_LINK"
    assert audit_all_defaults(gw) == []


def test_the_old_default_decided_such_a_fetch_untainted_and_still_re_derives_it(make_harness, mcp_specs):
    gw, _, emitted = first_fetch(make_harness, mcp_specs, LEAK, policy_json=DEFAULT_2)
    authorized = only(emitted, ToolCallAuthorized)
    assert authorized.reasons[-1] == "EGRESS_UNTAINTED" and authorized.policy_version.startswith("default/2@")
    assert audit_all_defaults(gw) == []


def test_only_untrusted_tools_whose_text_an_mcp_server_wrote_taint_the_start(make_harness, mcp_specs):
    stdio = tool_specs_from_mcp_stdio(StdioServer(("/opt/mcp/bin/server",)), [McpTool("notes", "Read notes.", {"type": "object"})])
    assert stdio[0].executor_kind == "mcp_stdio"
    gw, _, emitted = first_fetch(make_harness, stdio, LEAK)
    assert only(emitted, ApprovalRequested).reasons == ["TAINTED_EGRESS"]
    # An operator who vouches for the server (untrusted_source=False), or an untrusted tool whose
    # description the tenant registered itself (executor kind http): the run starts clean.
    trusted = [s.model_copy(update={"untrusted_source": False}) for s in mcp_specs]
    own = [s.model_copy(update={"executor_kind": "http", "executor_config_json": json.dumps({"url": "http://x/"})})
           for s in mcp_specs]
    for tools in (trusted, own):
        _, _, emitted = first_fetch(make_harness, tools, LEAK)
        assert only(emitted, ToolCallAuthorized).reasons[-1] == "EGRESS_UNTAINTED"


def test_earlier_policies_hash_the_inputs_they_hashed_before_the_snapshot_taint_existed(make_harness, mcp_specs):
    import dataclasses

    from tether_tool_gateway.domain.policy_document import parse_policy

    gw, call, _ = first_fetch(make_harness, mcp_specs, "http://127.0.0.1/statement")
    inputs = call_decision_inputs(gw.driver.states["run-1"], gw.call_state(call), recorded_at_ms=5)
    assert inputs.tool_taint and inputs.copied_args and inputs.linked_args
    bare = dataclasses.replace(inputs, tool_taint=(), copied_args=None, linked_args=None)
    for text in (DEFAULT_2_POLICY_TEXT, DEFAULT_1_POLICY_TEXT):  # the defaults before the snapshot taint
        old = TrustPolicy(parse_policy(text))
        assert old.decide_call(inputs) == old.decide_call(bare)
    current = TrustPolicy()
    assert current.decide_call(inputs).inputs_hash != current.decide_call(bare).inputs_hash
