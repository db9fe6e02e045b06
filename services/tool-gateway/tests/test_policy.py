"""The trust policy as pure functions: capabilities, constraints, risk policy levels, taint, rate decisions, hashes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tether_contracts.records import ApprovalOutcome, RiskClass, ToolSpec
from tether_tool_gateway.builtin_tools import http_get_spec, kv_get_spec, kv_put_spec, send_email_spec
from tether_tool_gateway.domain.canonical import canonical_json, sha256_hex
from tether_tool_gateway.domain.policy import (
    Allow,
    ApprovalDecisionInputs,
    BasicPolicy,
    CallDecisionInputs,
    Defer,
    Deny,
    RateAnswer,
    RateDecisionInputs,
    RequireApproval,
    TrustPolicy,
    inputs_hash,
)
from tether_tool_gateway.domain.policy_document import (
    DEFAULT_APPROVAL_TTL_MS,
    PolicyDocumentInvalid,
    RateLimit,
    default_policy,
    index_by_version,
    parse_policy,
)

NOW = 1_700_000_000_000
EMAIL = send_email_spec("127.0.0.1", 25, "agent@tether.test", recipient_domains=["example.com", "evil.example"])
FETCH = http_get_spec(["docs.example.com"])
PUT = kv_put_spec("http://127.0.0.1:1")
GET = kv_get_spec("http://127.0.0.1:1")
ALL = ["http_get", "kv_put", "kv_get", "send_email", "refund"]


def refund_tool() -> ToolSpec:
    return ToolSpec(name="refund", version=2, description="refund a payment",
                    args_schema_json=json.dumps({"type": "object",
                                                 "properties": {"amount": {}, "order": {"type": "string"}},
                                                 "required": ["amount", "order"]}),
                    risk_class=RiskClass.WRITE, idempotent=True, untrusted_source=False, executor_kind="http",
                    constraints_json=json.dumps({"rules": [{"kind": "max_amount", "arg": "/amount", "max": "100"}]}))


def inputs(tool: ToolSpec | None, args: dict, **over) -> CallDecisionInputs:
    args_json = canonical_json(args)
    base = dict(tool_name=tool.name if tool else "nope", args_json=args_json, args_hash=sha256_hex(args_json),
                tool=tool, tenant_grants=ALL, agent_allowlist=ALL, recorded_at_ms=NOW, tenant_id="t1",
                agent_id="a1", principal_id="alice", delegated_scope=None, tainted_by=())
    base.update(over)
    return CallDecisionInputs(**base)


def verdict(policy, i):
    return policy.decide_call(i).verdict


FETCH_ARGS = {"url": "https://docs.example.com/page"}
EMAIL_ARGS = {"to": "bob@example.com", "subject": "hi", "body": "report attached"}
PUT_ARGS = {"key": "k", "value": 1}


# -- capabilities ------------------------------------------------------------------------------
@pytest.mark.parametrize("grants,allowlist,scope,missing", [
    (["kv_put"], ALL, None, "not granted to this principal by the tenant"),
    (ALL, ["kv_put"], None, "not on the agent's allowlist"),
    (ALL, ALL, ["kv_put"], "outside the run's delegated scope"),
    (ALL, ALL, [], "outside the run's delegated scope"),
    ([], [], [], "not granted to this principal by the tenant; not on the agent's allowlist; outside"),
])
def test_a_tool_is_allowed_only_in_grants_and_allowlist_and_scope(grants, allowlist, scope, missing):
    v = verdict(TrustPolicy(), inputs(FETCH, FETCH_ARGS, tenant_grants=grants, agent_allowlist=allowlist,
                                      delegated_scope=scope))
    assert isinstance(v, Deny) and v.reason_code == "TOOL_NOT_ALLOWED" and missing in v.detail


def test_a_scope_that_includes_the_tool_allows_it_and_no_scope_does_not_restrict():
    # An allow names the rules that let the call run (ToolCallAuthorized.reasons), in checking order.
    assert verdict(TrustPolicy(), inputs(FETCH, FETCH_ARGS, delegated_scope=["http_get"])) == Allow(
        ("GRANTED", "IN_DELEGATED_SCOPE", "ARGS_VALID", "CONSTRAINTS_MET", "RISK_CLASS_NEEDS_NO_APPROVAL",
         "EGRESS_UNTAINTED"))
    assert verdict(TrustPolicy(), inputs(FETCH, FETCH_ARGS, delegated_scope=None)) == Allow(
        ("GRANTED", "ARGS_VALID", "CONSTRAINTS_MET", "RISK_CLASS_NEEDS_NO_APPROVAL", "EGRESS_UNTAINTED"))


def test_unknown_tool_and_invalid_args():
    assert verdict(TrustPolicy(), inputs(None, {})).reason_code == "UNKNOWN_TOOL"
    v = verdict(TrustPolicy(), inputs(PUT, {"key": "k"}))
    assert v.reason_code == "INVALID_ARGS" and "value" in v.detail
    bad_hash = dataclasses.replace(inputs(PUT, PUT_ARGS), args_hash="0" * 64)
    assert verdict(TrustPolicy(), bad_hash).reason_code == "INVALID_ARGS"


# -- constraints -------------------------------------------------------------------------------
def test_constraint_violations_are_denied_with_the_argument_and_rule():
    v = verdict(TrustPolicy(), inputs(FETCH, {"url": "http://docs.example.com@evil.example/"}))
    assert v.reason_code == "CONSTRAINT_VIOLATION"
    assert v.detail.startswith("argument /url breaks the egress rule") and "user information" in v.detail
    v = verdict(TrustPolicy(), inputs(refund_tool(), {"amount": "100.01", "order": "o1"}))
    assert v.reason_code == "CONSTRAINT_VIOLATION" and "argument /amount breaks the max_amount rule" in v.detail
    allowed = verdict(TrustPolicy(), inputs(refund_tool(), {"amount": "99.99", "order": "o1"}))
    assert "CONSTRAINTS_MET" in allowed.reasons


def test_unreadable_constraints_deny_the_call():
    tool = refund_tool().model_copy(update={"constraints_json": '{"rules": [{"kind": "max_amount"}]}'})
    v = verdict(TrustPolicy(), inputs(tool, {"amount": 1, "order": "o"}))
    assert v.reason_code == "CONSTRAINT_VIOLATION" and "cannot be checked" in v.detail


@pytest.mark.parametrize("tool,args,why", [
    (FETCH, {"url": "http://-1.2.3.4/"}, "not a valid one"),
    (FETCH, {"url": "http://+1.2.3.4/"}, "not a valid one"),
    (FETCH, {"url": "http://1_0.0.0.1/"}, "not a valid one"),
    (FETCH, {"url": "https://api.example.com:\u00b2/x"}, "not a valid port"),
    (FETCH, {"url": "https://docs.example.com:\uff18\uff10/x"}, "not a valid port"),
    (EMAIL, {**EMAIL_ARGS, "to": "a@-1.2.3.4"}, "recipient domain"),
])
def test_model_written_hosts_and_ports_the_checker_cannot_read_are_denied_not_raised(tool, args, why):
    v = verdict(TrustPolicy(), inputs(tool, args))
    assert isinstance(v, Deny) and v.reason_code == "CONSTRAINT_VIOLATION" and why in v.detail


def test_a_failing_constraint_check_denies_the_call(monkeypatch):
    def broken(constraints, args):
        raise RuntimeError("checker bug")
    monkeypatch.setattr("tether_tool_gateway.domain.policy.check_constraints", broken)
    v = verdict(TrustPolicy(), inputs(FETCH, FETCH_ARGS))
    assert v == Deny("CONSTRAINT_VIOLATION",
                     "the arguments cannot be checked against the tool's constraints (RuntimeError)")


def test_schema_is_checked_before_constraints():
    v = verdict(TrustPolicy(), inputs(FETCH, {"url": 5}))
    assert v.reason_code == "INVALID_ARGS"


@pytest.mark.parametrize(("ref", "named"), [("#/$defs/missing", "'/$defs/missing'"),
                                            ("http://127.0.0.1:9/args.json", "'http://127.0.0.1:9/args.json'")])
def test_a_schema_whose_ref_resolves_to_nothing_denies_the_call_instead_of_failing_the_decision(ref, named):
    # The decision raised (jsonschema's unresolvable-ref error), after fetching the URL of a remote ref.
    tool = refund_tool().model_copy(update={"args_schema_json": json.dumps(
        {"type": "object", "properties": {"order": {"$ref": ref}}})})
    for policy in (TrustPolicy(), BasicPolicy()):
        v = verdict(policy, inputs(tool, {"amount": 5, "order": "o-1"}))
        assert v == Deny("INVALID_ARGS", f"the tool's argument schema is unusable: a $ref to {named} resolves to "
                                         "nothing in the schema (another document is never fetched)")


# -- JSON Schema `format`: asserted under the document's arguments.assert_formats ------------------
def invite_tool() -> ToolSpec:
    """A user tool as an MCP server on zod or pydantic declares it: formats, no pattern."""
    return ToolSpec(name="invite", version=1, description="invite someone to a meeting",
                    args_schema_json=json.dumps({"type": "object", "properties": {
                        "email": {"type": "string", "format": "email"},
                        "starts": {"type": "string", "format": "date-time"},
                        "agenda": {"type": "string", "format": "uri"},
                        "room": {"type": "string", "format": "uuid"},
                        "note": {"type": "string", "format": "regex"}},  # not asserted: an annotation
                        "required": ["email", "starts"]}),
                    risk_class=RiskClass.WRITE, idempotent=False, untrusted_source=False, executor_kind="mcp")


def invite(args: dict) -> CallDecisionInputs:
    return inputs(invite_tool(), args, tenant_grants=["invite"], agent_allowlist=["invite"])


INVITE = {"email": "ana@example.com", "starts": "2026-12-01T09:30:00+01:00", "agenda": "https://docs.example.com/a",
          "room": "2eb8aa08-aa98-11ea-b4aa-73b441d16380", "note": "(unclosed"}


@pytest.mark.parametrize(("arg", "value", "detail"), [
    ("email", "ana at example.com", "email: 'ana at example.com' is not a 'email'"),
    ("email", "ana@example.com\nBcc: all@example.com", "is not a 'email'"),
    ("starts", "tomorrow 9am", "starts: 'tomorrow 9am' is not a 'date-time'"),
    ("starts", "2026-02-30T09:30:00Z", "is not a 'date-time'"),
    ("agenda", "docs.example.com/a", "agenda: 'docs.example.com/a' is not a 'uri'"),
    ("room", "room-12", "room: 'room-12' is not a 'uuid'"),
])
def test_a_value_breaking_an_asserted_format_is_invalid_args_under_the_default(arg, value, detail):
    # jsonschema only annotates `format` unless given a FormatChecker: each of these was allowed.
    assert isinstance(verdict(TrustPolicy(), invite(INVITE)), Allow)
    v = verdict(TrustPolicy(), invite(INVITE | {arg: value}))
    assert isinstance(v, Deny) and v.reason_code == "INVALID_ARGS" and detail in v.detail, v


def test_formats_are_asserted_only_by_a_policy_that_lists_them():
    # The decisions recorded under default/3 and under documents without the rule re-derive unchanged.
    from tether_tool_gateway.domain.policy_document import default_policies

    _, third, *_ = default_policies()
    call = invite(INVITE | {"email": "ana at example.com", "starts": "tomorrow"})
    assert isinstance(verdict(TrustPolicy(third), call), Allow)
    assert isinstance(verdict(policy({"version": "acme/1"}), call), Allow)
    only_email = policy({"version": "acme/2", "arguments": {"assert_formats": ["email"]}})
    assert verdict(only_email, call) == Deny("INVALID_ARGS", "email: 'ana at example.com' is not a 'email'")
    assert isinstance(verdict(only_email, invite(INVITE | {"starts": "tomorrow"})), Allow)
    assert isinstance(verdict(BasicPolicy(), call), Allow)


def test_a_run_accepted_under_default_3_is_decided_without_formats_after_the_upgrade():
    # A gateway on the built-in default decides a run in flight under the default that accepted it
    # (RunState.default_policy_version): its calls get the verdicts default/3's gateway gave them.
    from tether_tool_gateway.domain.policy import policy_for_run
    from tether_tool_gateway.domain.policy_document import DEFAULT_POLICY_VERSION, default_policies

    _, third, *_ = default_policies()
    current = TrustPolicy()
    assert policy_for_run(current, DEFAULT_POLICY_VERSION) is current
    in_flight = policy_for_run(current, third.policy_version)
    assert in_flight.version == third.policy_version and in_flight.version.startswith("default/3@")
    call = invite(INVITE | {"email": "ana at example.com"})
    assert isinstance(verdict(in_flight, call), Allow) and isinstance(verdict(current, call), Deny)


# -- risk classes and the policy document ------------------------------------------------------
def test_default_policy_asks_a_human_for_irreversible_only():
    p = TrustPolicy()
    assert isinstance(verdict(p, inputs(FETCH, FETCH_ARGS)), Allow)
    # kv_put has no argument constraints: nothing to meet. It is egress (what it stores, later runs read
    # back as trusted content), and this run is untainted.
    assert verdict(p, inputs(PUT, PUT_ARGS)) == Allow(
        ("GRANTED", "ARGS_VALID", "RISK_CLASS_NEEDS_NO_APPROVAL", "EGRESS_UNTAINTED"))
    assert verdict(p, inputs(GET, {"key": "k"})) == Allow(("GRANTED", "ARGS_VALID", "RISK_CLASS_NEEDS_NO_APPROVAL"))
    v = verdict(p, inputs(EMAIL, EMAIL_ARGS))
    assert v == RequireApproval(("RISK_CLASS",), NOW + DEFAULT_APPROVAL_TTL_MS)


POLICY = {
    "version": "acme/7",
    "approval_ttl_ms": 3_600_000,
    "tenants": {
        "t-strict": {"require_risk_classes": ["WRITE"]},
        "t-ops": {"waive_tools": ["send_email"], "agents": {"a-careful": {"require_tools": ["send_email"]}}},
        "t-agents": {"agents": {"a-writer": {"require_risk_classes": ["WRITE"]},
                                "a-mailer": {"waive_tools": ["send_email"]}}},
    },
}


def policy(doc: dict | None = None) -> TrustPolicy:
    return TrustPolicy(parse_policy(json.dumps(doc or POLICY)))


@pytest.mark.parametrize("tenant,agent,tool,args,expected", [
    ("t1", "a1", PUT, PUT_ARGS, None),                                  # default level only
    ("t1", "a1", EMAIL, EMAIL_ARGS, ("RISK_CLASS",)),
    ("t-strict", "a1", PUT, PUT_ARGS, ("RISK_CLASS",)),                 # the tenant adds WRITE
    ("t-strict", "a1", EMAIL, EMAIL_ARGS, ("RISK_CLASS",)),             # and cannot drop IRREVERSIBLE
    ("t-ops", "a1", EMAIL, EMAIL_ARGS, None),                           # an operator waiver for one tool
    ("t-ops", "a-careful", EMAIL, EMAIL_ARGS, ("POLICY",)),             # a requirement beats the waiver
    ("t-agents", "a-writer", PUT, PUT_ARGS, ("RISK_CLASS",)),           # per agent
    ("t-agents", "a-other", PUT, PUT_ARGS, None),
    ("t-agents", "a-mailer", EMAIL, EMAIL_ARGS, None),
    ("t-agents", "a-other", EMAIL, EMAIL_ARGS, ("RISK_CLASS",)),
    ("t-strict", "a1", FETCH, FETCH_ARGS, None),                        # read-only runs
])
def test_approval_rules_per_tenant_and_agent(tenant, agent, tool, args, expected):
    v = verdict(policy(), inputs(tool, args, tenant_id=tenant, agent_id=agent))
    if expected is None:
        assert isinstance(v, Allow)
    else:
        assert v == RequireApproval(expected, NOW + 3_600_000)


# -- taint -------------------------------------------------------------------------------------
def test_a_tainted_run_needs_approval_for_egress_tools_only():
    p = policy()
    tainted = {"tainted_by": ("1.0",)}
    # send_email is egress; its risk class is waived for t-ops, so only the taint asks a human.
    assert verdict(p, inputs(EMAIL, EMAIL_ARGS, tenant_id="t-ops")) == Allow(
        ("GRANTED", "ARGS_VALID", "CONSTRAINTS_MET", "RISK_CLASS_WAIVED", "EGRESS_UNTAINTED"))
    assert verdict(p, inputs(EMAIL, EMAIL_ARGS, tenant_id="t-ops", **tainted)) == \
        RequireApproval(("TAINTED_EGRESS",), NOW + 3_600_000)
    assert verdict(p, inputs(EMAIL, EMAIL_ARGS, tenant_id="t1", **tainted)).reasons == ("RISK_CLASS", "TAINTED_EGRESS")
    assert verdict(p, inputs(EMAIL, EMAIL_ARGS, tenant_id="t-ops", agent_id="a-careful", **tainted)).reasons == \
        ("POLICY", "TAINTED_EGRESS")
    # Non-egress tools run on a tainted run as they would otherwise.
    assert isinstance(verdict(p, inputs(GET, {"key": "k"}, **tainted)), Allow)
    # kv_put is egress: a tainted run must not store what it read for later runs to trust without a human.
    assert verdict(p, inputs(PUT, PUT_ARGS, **tainted)) == RequireApproval(("TAINTED_EGRESS",), NOW + 3_600_000)
    # http_get is egress (its URL leaves): without taint.follow_links every fetch on a tainted run asks.
    assert verdict(p, inputs(FETCH, FETCH_ARGS, **tainted)) == RequireApproval(("TAINTED_EGRESS",), NOW + 3_600_000)


# -- following links on a tainted run (taint.follow_links) --------------------------------------
LINKS = {"version": "links/1", "taint": {"follow_links": True}}
LINK = "https://docs.example.com/page"
TAINTED = {"tainted_by": ("1.0",)}


def test_a_tainted_run_may_follow_a_link_it_was_given_but_not_send_a_url_the_model_composed():
    p = policy(LINKS)
    given = verdict(p, inputs(FETCH, {"url": LINK}, copied_args={"/url": "tool:1.0"}, **TAINTED))
    assert given == Allow(("GRANTED", "ARGS_VALID", "CONSTRAINTS_MET", "RISK_CLASS_NEEDS_NO_APPROVAL",
                           "EGRESS_FOLLOWS_LINK"))
    from_goal = verdict(p, inputs(FETCH, {"url": LINK}, copied_args={"/url": "goal"}, **TAINTED))
    assert isinstance(from_goal, Allow) and from_goal.reasons[-1] == "EGRESS_FOLLOWS_LINK"
    # Composed (the data would ride in the query or the path), or not looked for: a human decides.
    composed = inputs(FETCH, {"url": LINK + "?q=the-secret"}, copied_args={"/url": None}, **TAINTED)
    assert verdict(p, composed) == RequireApproval(("TAINTED_EGRESS",), NOW + DEFAULT_APPROVAL_TTL_MS)
    assert verdict(p, inputs(FETCH, {"url": LINK}, copied_args=None, **TAINTED)).reasons == ("TAINTED_EGRESS",)
    assert verdict(p, inputs(FETCH, {"url": LINK}, copied_args={}, **TAINTED)).reasons == ("TAINTED_EGRESS",)
    # An untainted run needs nothing copied.
    assert verdict(p, inputs(FETCH, {"url": LINK + "?q=x"})).reasons[-1] == "EGRESS_UNTAINTED"


LOOKUP_ALLOWED = {"tenant_grants": ["lookup"], "agent_allowlist": ["lookup"]}


def _egress_tool(risk: RiskClass, schema: dict) -> ToolSpec:
    return ToolSpec(name="lookup", version=1, description="look something up", args_schema_json=json.dumps(schema),
                    risk_class=risk, idempotent=True, untrusted_source=True, executor_kind="http", egress=True)


@pytest.mark.parametrize("args,copied", [
    ({"url": LINK, "note": "hi"}, {"/url": "tool:1.0", "/note": "tool:1.0"}),  # a key the schema does not declare
    ({"url": LINK, "n": 7}, {"/url": "tool:1.0", "/n": None}),                  # a number can spell data
    ({"url": LINK, "n": "7"}, {"/url": "tool:1.0", "/n": None}),                # one argument not copied
    ({"url": [LINK]}, {"/url/0": "tool:1.0"}),                                  # not a flat string
])
def test_only_a_flat_object_of_declared_copied_strings_follows_a_link(args, copied):
    schema = {"type": "object", "properties": {"url": {}, "n": {}}}
    v = verdict(policy(LINKS), inputs(_egress_tool(RiskClass.READ_ONLY, schema), args, copied_args=copied, **TAINTED,
                                        **LOOKUP_ALLOWED))
    assert v == RequireApproval(("TAINTED_EGRESS",), NOW + DEFAULT_APPROVAL_TTL_MS)


def test_only_read_only_tools_follow_links():
    # A write with egress does what the page says if the page wrote every argument: a human decides.
    schema = {"type": "object", "properties": {"url": {}}}
    for risk, expected in ((RiskClass.READ_ONLY, Allow), (RiskClass.WRITE, RequireApproval)):
        v = verdict(policy(LINKS), inputs(_egress_tool(risk, schema), {"url": LINK},
                                          copied_args={"/url": "tool:1.0"}, **TAINTED, **LOOKUP_ALLOWED))
        assert isinstance(v, expected)


def test_copied_args_are_hashed_only_by_a_policy_that_reads_them():
    a = inputs(FETCH, {"url": LINK}, copied_args={"/url": "tool:1.0"}, **TAINTED)
    b = dataclasses.replace(a, copied_args={"/url": "goal"})
    links, plain = policy(LINKS), policy({"version": "links/1"})
    assert links.decide_call(a).inputs_hash != links.decide_call(b).inputs_hash
    # A policy without the rule hashes what it hashed before the field existed.
    assert plain.decide_call(a).inputs_hash == plain.decide_call(dataclasses.replace(a, copied_args=None)).inputs_hash
    before = {k: v for k, v in a.canonical().items()}
    assert "copied_args" not in before and plain.decide_call(a).inputs_hash == inputs_hash(plain.version, before)


def test_the_default_policy_follows_links_and_the_earlier_default_still_derives_its_decisions():
    from tether_tool_gateway.domain.policy_document import default_policies

    current, third, second, earlier = default_policies()
    assert current.document.taint.follow_links and current.policy_version.startswith("default/4@")
    assert third.document.taint.follow_links and third.policy_version.startswith("default/3@")
    assert second.document.taint.follow_links and second.policy_version.startswith("default/2@")
    assert not earlier.document.taint.follow_links and earlier.policy_version.startswith("default/1@")
    old = inputs(FETCH, {"url": LINK}, copied_args={"/url": "tool:1.0"}, linked_args={"/url": "tool:1.0"}, **TAINTED)
    assert verdict(TrustPolicy(current), old).reasons[-1] == "EGRESS_FOLLOWS_LINK"
    assert verdict(TrustPolicy(third), old).reasons[-1] == "EGRESS_FOLLOWS_LINK"
    assert verdict(TrustPolicy(second), old).reasons[-1] == "EGRESS_FOLLOWS_LINK"
    assert verdict(TrustPolicy(earlier), old).reasons == ("TAINTED_EGRESS",)


def test_a_waiver_cannot_lift_the_taint_rule():
    doc = {"version": "v", "approval": {"require_risk_classes": [], "waive_tools": ["send_email"]}}
    # No level requires a human for the class, so the waiver is not what lets it run.
    assert verdict(policy(doc), inputs(EMAIL, EMAIL_ARGS)).reasons[-2:] == ("RISK_CLASS_NEEDS_NO_APPROVAL",
                                                                              "EGRESS_UNTAINTED")
    assert verdict(policy(doc), inputs(EMAIL, EMAIL_ARGS, tainted_by=("3.1",))).reasons == ("TAINTED_EGRESS",)


def test_denials_come_before_approvals_even_when_tainted():
    v = verdict(TrustPolicy(), inputs(EMAIL, {**EMAIL_ARGS, "to": "x@elsewhere.example"}, tainted_by=("1.0",)))
    assert v.reason_code == "CONSTRAINT_VIOLATION"


# -- decisions are re-derivable ----------------------------------------------------------------
def test_the_inputs_hash_covers_every_input_and_the_version():
    p = policy()
    base = inputs(EMAIL, EMAIL_ARGS)
    d = p.decide_call(base)
    assert d == p.decide_call(inputs(EMAIL, EMAIL_ARGS))  # same inputs, same decision and hash
    assert d.inputs_hash == inputs_hash(p.version, base.canonical())
    changed = [
        dataclasses.replace(base, tainted_by=("1.0",)),
        dataclasses.replace(base, delegated_scope=["send_email"]),
        dataclasses.replace(base, tenant_id="t2"),
        dataclasses.replace(base, agent_id="a2"),
        dataclasses.replace(base, principal_id="mallory"),
        dataclasses.replace(base, recorded_at_ms=NOW + 1),
        dataclasses.replace(base, tenant_grants=["send_email"]),
        dataclasses.replace(base, tool=EMAIL.model_copy(update={"constraints_json": "{}"})),
    ]
    hashes = {p.decide_call(c).inputs_hash for c in changed} | {d.inputs_hash}
    assert len(hashes) == len(changed) + 1
    assert TrustPolicy().decide_call(base).inputs_hash != d.inputs_hash  # another policy version


def test_order_and_duplicates_of_sets_do_not_change_the_hash():
    a = inputs(FETCH, FETCH_ARGS, tenant_grants=["kv_put", "http_get"], tainted_by=("2.0", "1.0"))
    b = inputs(FETCH, FETCH_ARGS, tenant_grants=["http_get", "kv_put", "http_get"], tainted_by=("1.0", "2.0"))
    assert TrustPolicy().decide_call(a) == TrustPolicy().decide_call(b)


def test_fields_the_decision_does_not_read_are_not_hashed():
    # A ToolSpec field added later (or a description edit) must not change an old decision's hash.
    a = inputs(FETCH, FETCH_ARGS)
    b = inputs(FETCH.model_copy(update={"description": "other", "timeout_ms": 1}), FETCH_ARGS)
    assert TrustPolicy().decide_call(a).inputs_hash == TrustPolicy().decide_call(b).inputs_hash


def test_basic_policy_hashes_as_it_did_before_constraints_existed():
    i = inputs(PUT, PUT_ARGS)
    old_tool = {k: v for k, v in PUT.to_avro().items() if k != "constraints_json"}
    old = {"kind": "call", "tool_name": i.tool_name, "args_json": i.args_json, "args_hash": i.args_hash,
           "tool": old_tool, "tenant_grants": sorted(ALL), "agent_allowlist": sorted(ALL), "recorded_at_ms": NOW}
    assert BasicPolicy().decide_call(i).inputs_hash == inputs_hash("basic/1", old)


def test_approval_decisions():
    p = TrustPolicy()
    base = ApprovalDecisionInputs(approval_id="apr_1", call_args_hash="h", approval_expires_at_ms=NOW + 10,
                                  decided_args_hash="h", outcome=ApprovalOutcome.APPROVED, approver_id="carol",
                                  comment="", decided_at_ms=NOW)
    assert p.decide_approval(base).verdict == Allow()
    other_args = p.decide_approval(dataclasses.replace(base, decided_args_hash="other")).verdict
    assert other_args.reason_code == "APPROVAL_REJECTED"
    assert p.decide_approval(dataclasses.replace(base, decided_at_ms=NOW + 11)).verdict.reason_code == \
        "APPROVAL_EXPIRED"
    v = p.decide_approval(dataclasses.replace(base, outcome=ApprovalOutcome.REJECTED, comment="no way")).verdict
    assert v == Deny("APPROVAL_REJECTED", "rejected by carol: no way")


# -- rate limits -------------------------------------------------------------------------------
RATED = {"version": "rated/1", "rate_limits": [
    {"tenant": "*", "tool": "*", "limit": 100, "per_s": 1},
    {"tenant": "*", "tool": "http_get", "limit": 10, "per_s": 60},
    {"tenant": "t1", "tool": "*", "limit": 50, "per_s": 1},
    {"tenant": "t1", "tool": "http_get", "limit": 2, "per_s": 1, "burst": 5},
]}


@pytest.mark.parametrize("tenant,tool,limit", [("t1", "http_get", 2), ("t1", "kv_put", 50), ("t2", "http_get", 10),
                                               ("t2", "kv_put", 100)])
def test_the_most_specific_rate_limit_applies(tenant, tool, limit):
    assert policy(RATED).rate_limit_for(tenant, tool).limit == limit
    assert TrustPolicy().rate_limit_for(tenant, tool) is None
    assert policy(RATED).rate_limit_for("t1", "http_get").capacity == 5


def test_a_rate_limited_call_is_deferred_by_the_recorded_answer():
    p = policy(RATED)
    limit = p.rate_limit_for("t1", "http_get")
    i = RateDecisionInputs(tenant_id="t1", tool_name="http_get", call_id="1.0", idem_key="k", attempt=1, limit=limit,
                           answer=RateAnswer(False, 1_500), decided_at_ms=NOW)
    d = p.decide_rate(i)
    assert d.verdict == Defer("RATE_LIMITED", 1_500, NOW + 1_500)
    assert d.inputs_hash == inputs_hash(p.version, i.canonical())
    assert p.decide_rate(dataclasses.replace(i, answer=RateAnswer(True))).verdict == Allow()
    assert p.decide_rate(dataclasses.replace(i, attempt=2)).inputs_hash != d.inputs_hash
    assert p.decide_rate(dataclasses.replace(i, answer=RateAnswer(False, 0))).verdict.not_before_ms == NOW + 1


# -- the document ------------------------------------------------------------------------------
def test_policy_version_names_the_version_and_the_content():
    a = parse_policy('{"version": "acme/7"}')
    b = parse_policy('{ "version" : "acme/7" }')  # formatting does not matter
    c = parse_policy('{"version": "acme/7", "approval_ttl_ms": 5}')  # content does
    assert a.policy_version == b.policy_version and a.policy_version.startswith("acme/7@")
    assert c.policy_version != a.policy_version
    assert index_by_version([a, c])[c.policy_version] is c
    assert default_policy().policy_version.startswith("default/4@")


@pytest.mark.parametrize("text,why", [
    ("[]", "JSON object"),
    ("{", "not JSON"),
    ('{"approval": {}}', "version"),
    ('{"version": "a@b"}', "'@'"),
    ('{"version": "v", "tenants": {"t": {"require_risk_classes": ["SCARY"]}}}', "SCARY"),
    ('{"version": "v", "rate_limits": [{"limit": 0, "per_s": 1}]}', "limit"),
    ('{"version": "v", "rate_limits": [{"limit": 1, "per_s": 1}, {"limit": 2, "per_s": 1}]}', "more than one"),
    ('{"version": "v", "surprise": 1}', "surprise"),
    ('{"version": "v", "arguments": {"assert_formats": ["email", "hostname"]}}', "cannot assert format(s) ['hostname']"),
])
def test_invalid_documents_are_refused(text, why):
    with pytest.raises(PolicyDocumentInvalid) as err:
        parse_policy(text)
    assert why in str(err.value)


def test_rate_limit_numbers():
    r = RateLimit(limit=30, per_s=60)
    assert r.capacity == 30 and r.rate_per_s == 0.5
