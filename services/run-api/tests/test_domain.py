"""Pure decisions: keys, catalog validation and update merge, submit snapshot, run ids, paging, admission, trace."""

from __future__ import annotations

import json

import pytest

from tether_contracts.records import AgentSpec, Caps, RiskClass, ToolSpec
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import (
    ROLE_ADMIN,
    ROLE_APPROVER,
    ROLE_MEMBER,
    Principal,
    api_key_from_metadata,
    generate_api_key,
    hash_api_key,
)
from tether_run_api.domain.catalog import (
    AgentDraft,
    CapsDraft,
    CatalogLimits,
    ToolDraft,
    merge_update,
    validate_agent,
    validate_tool,
)
from tether_run_api.domain.errors import (
    InvalidArgument,
    InvalidPageToken,
    MissingRole,
    RateLimited,
    Unauthenticated,
)
from tether_run_api.domain.paging import MAX_PAGE_SIZE, decode_token, encode_token, page_size
from tether_run_api.domain.runs import (
    RUN_ID,
    RunLimits,
    SubmitRequest,
    build_submit,
    effective_caps,
    new_run_id,
    request_fingerprint,
    validate_submit,
)
from tether_run_api.domain.stream import Offer, SeqGate
from tether_run_api.domain.trace import build_trace
from tether_run_api.domain.views import ApprovalView, EventView

LIMITS = CatalogLimits()
CAPS = CapsDraft(max_steps=10, max_wall_clock_ms=60_000, max_tokens=100_000, max_cost_usd_micros=1_000_000)


def agent_draft(**kw) -> AgentDraft:
    base = dict(agent_id="helper", display_name="Helper", instructions="Be useful.", model_provider="openai",
                model_name="gpt-x", tool_allowlist=("web_search",), caps=CAPS)
    base.update(kw)
    return AgentDraft(**base)


def tool_draft(**kw) -> ToolDraft:
    base = dict(name="web_search", description="Search the web.",
                args_schema_json='{"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}',
                risk_class="READ_ONLY", executor_kind="builtin", executor_config_json='{"builtin":"web_search"}')
    base.update(kw)
    return ToolDraft(**base)


def fields(err: InvalidArgument) -> set[str]:
    return {v.field for v in err.violations}


# -- auth ---------------------------------------------------------------------------------------


def test_api_key_is_read_from_bearer_or_x_api_key_and_hashed() -> None:
    key = generate_api_key()
    assert api_key_from_metadata([("authorization", f"Bearer {key}")]) == key
    assert api_key_from_metadata([("x-api-key", key)]) == key
    assert hash_api_key(key) != key and len(hash_api_key(key)) == 64


@pytest.mark.parametrize(
    "metadata",
    [[], [("authorization", "Basic abc")], [("x-api-key", "short")], [("x-api-key", "tk_" + "a" * 30),
                                                                        ("authorization", "Bearer tk_" + "b" * 30)]],
)
def test_missing_malformed_or_conflicting_keys_are_unauthenticated(metadata) -> None:
    with pytest.raises(Unauthenticated) as err:
        api_key_from_metadata(metadata)
    assert err.value.reason == "UNAUTHENTICATED_API_KEY"


def test_admin_implies_member_but_never_approver() -> None:
    admin = Principal("t", "p", frozenset({ROLE_ADMIN}))
    assert admin.has(ROLE_MEMBER)
    with pytest.raises(MissingRole) as err:
        admin.require(ROLE_APPROVER)
    assert err.value.metadata == {"required_role": "approver"}


# -- catalog ------------------------------------------------------------------------------------


def test_valid_agent_gets_defaults() -> None:
    spec = validate_agent(agent_draft(), LIMITS)
    assert spec.model.context_window_tokens == 128_000
    assert spec.compaction_threshold == pytest.approx(0.8)
    assert spec.caps.max_tool_calls == 200


def test_invalid_agent_lists_every_bad_field() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_agent(agent_draft(agent_id="Bad Id", instructions="", caps=CapsDraft(), tool_allowlist=("x", "x"),
                                   compaction_threshold=1.5), LIMITS)
    assert {"agent.agent_id", "agent.instructions", "agent.caps.max_steps", "agent.tool_allowlist[1]",
            "agent.compaction_threshold"} <= fields(err.value)


def test_tool_schema_must_be_a_valid_json_schema_for_an_object() -> None:
    spec = validate_tool(tool_draft(), LIMITS)
    assert spec.risk_class is RiskClass.READ_ONLY and spec.timeout_ms == 30_000
    assert json.loads(spec.args_schema_json)["required"] == ["q"]
    for bad, why in [
        ("{not json", "not valid JSON"),
        ('{"type": "object", "properties": {"q": {"type": "strin"}}}', "not a valid JSON Schema"),
        ('{"type": "object", "minProperties": -1}', "not a valid JSON Schema"),
        ('{"type": "string"}', "top-level"),
        ("[1]", "JSON object"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            validate_tool(tool_draft(args_schema_json=bad), LIMITS)
        assert any(why in v.description for v in err.value.violations), (bad, err.value.violations)


def test_tool_constraints_are_a_canonical_json_object() -> None:
    assert validate_tool(tool_draft(), LIMITS).constraints_json == "{}"
    spec = validate_tool(tool_draft(constraints_json='{"rules": [{"kind": "egress", "arg": "/url", "hosts": ["a"]}]}'),
                         LIMITS)
    assert spec.constraints_json == '{"rules":[{"arg":"/url","hosts":["a"],"kind":"egress"}]}'
    for bad in ("[]", '{"rules": [{"kind": "egress", "arg": "url", "hosts": []}]}', '{"rules": [{"kind": "teleport"}]}'):
        with pytest.raises(InvalidArgument) as err:
            validate_tool(tool_draft(constraints_json=bad), LIMITS)
        assert fields(err.value) == {"tool.constraints_json"}, bad


def test_tool_needs_risk_class_and_known_executor() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_tool(tool_draft(risk_class="", executor_kind="shell", executor_config_json="[]"), LIMITS)
    assert fields(err.value) == {"tool.risk_class", "tool.executor_kind", "tool.executor_config_json"}


def test_update_mask_takes_named_fields_and_keeps_the_rest() -> None:
    latest = validate_agent(agent_draft(), LIMITS).model_copy(update={"version": 3})
    update = agent_draft(instructions="New.", display_name="ignored", caps=CapsDraft(max_steps=5))
    merged = merge_update(latest, update, ["instructions", "caps.max_steps"])
    assert merged.instructions == "New."
    assert merged.display_name == "Helper"
    assert merged.caps.max_steps == 5 and merged.caps.max_tokens == CAPS.max_tokens
    with pytest.raises(InvalidArgument):
        merge_update(latest, update, ["agent_id"])
    assert merge_update(latest, update, []).display_name == "ignored"


# -- submit -------------------------------------------------------------------------------------


def _agent() -> AgentSpec:
    return validate_agent(agent_draft(tool_allowlist=("web_search", "send_email", "unregistered")), LIMITS)


def test_caps_may_only_tighten() -> None:
    agent_caps = Caps(max_steps=10, max_wall_clock_ms=1000, max_tokens=500, max_cost_usd_micros=9, max_tool_calls=4)
    tightened = effective_caps(agent_caps, CapsDraft(max_steps=3))
    assert tightened.max_steps == 3 and tightened.max_tokens == 500
    with pytest.raises(InvalidArgument) as err:
        effective_caps(agent_caps, CapsDraft(max_tokens=501))
    assert fields(err.value) == {"caps.max_tokens"}


def test_submit_validation_and_goal_cap() -> None:
    limits = RunLimits(max_goal_chars=10)
    validate_submit(SubmitRequest("r-1", "helper", "short"), limits)
    with pytest.raises(InvalidArgument) as err:
        validate_submit(SubmitRequest("bad id!", "helper", "x" * 11, agent_version=-1), limits)
    assert fields(err.value) == {"request_id", "goal", "agent_version"}


@pytest.mark.parametrize("pattern", ["REQUEST_ID", "RUN_ID", "AGENT_ID", "TOOL_NAME", "PROVIDER", "_KEY_SHAPE"])
def test_an_id_with_a_trailing_newline_is_not_an_id(pattern: str) -> None:
    # `$` also matches before a final newline: "r-1\n" passed as a request id and was stored so.
    import tether_run_api.domain.auth as auth
    import tether_run_api.domain.catalog as catalog
    import tether_run_api.domain.runs as runs

    compiled = next(getattr(m, pattern) for m in (runs, catalog, auth) if hasattr(m, pattern))
    good = {"REQUEST_ID": "r-1", "RUN_ID": "01ARZ3NDEKTSV4RRFFQ69G5FAV", "AGENT_ID": "helper", "TOOL_NAME": "kv_get",
            "PROVIDER": "scripted", "_KEY_SHAPE": "tk_" + "a" * 24}[pattern]
    assert compiled.match(good)
    assert not compiled.match(good + "\n")


def test_a_request_id_or_agent_id_ending_in_a_newline_is_a_field_violation() -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_submit(SubmitRequest("r-1\n", "helper\n", "goal"), RunLimits(max_goal_chars=10))
    assert fields(err.value) == {"request_id", "agent_id"}


def test_snapshot_carries_allowlisted_enabled_tools_in_order_and_grants() -> None:
    principal = Principal("t1", "alice", frozenset({ROLE_MEMBER}))
    tools = [
        ToolSpec(name=n, version=v, description="d", args_schema_json="{}", risk_class=RiskClass.WRITE,
                 idempotent=True, untrusted_source=False, executor_kind="builtin")
        for n, v in [("send_email", 2), ("web_search", 1), ("not_on_allowlist", 1)]
    ]
    cmd = build_submit(principal, SubmitRequest("r", "helper", "goal", caps=CapsDraft(max_steps=2)), _agent(),
                       tools, ["web_search", "web_search", "send_email"])
    assert [(t.name, t.version) for t in cmd.tools] == [("web_search", 1), ("send_email", 2)]
    assert cmd.tenant_grants == ["send_email", "web_search"]
    assert cmd.caps.max_steps == 2 and cmd.principal_id == "alice" and cmd.request_id == "r"


def test_delegated_scope_is_passed_on_and_validated() -> None:
    principal = Principal("t1", "alice", frozenset({ROLE_MEMBER}))
    scoped = build_submit(principal, SubmitRequest("r", "helper", "g", delegated_scope=("b", "a", "b")), _agent(), [],
                          [])
    assert scoped.delegated_scope == ["a", "b"]
    assert build_submit(principal, SubmitRequest("r", "helper", "g"), _agent(), [], []).delegated_scope is None
    assert build_submit(principal, SubmitRequest("r", "helper", "g", delegated_scope=()), _agent(), [],
                        []).delegated_scope == []
    with pytest.raises(InvalidArgument) as err:
        validate_submit(SubmitRequest("r", "helper", "g", delegated_scope=("ok", "Not OK")), RunLimits())
    assert fields(err.value) == {"delegated_scope.tools[1]"}
    assert request_fingerprint(SubmitRequest("r", "a", "g")) != \
        request_fingerprint(SubmitRequest("r", "a", "g", delegated_scope=()))


def test_fingerprint_distinguishes_requests() -> None:
    a = SubmitRequest("r", "helper", "goal")
    assert request_fingerprint(a) == request_fingerprint(SubmitRequest("r", "helper", "goal"))
    assert request_fingerprint(a) != request_fingerprint(SubmitRequest("r", "helper", "other goal"))


def test_run_ids_are_ulids_that_sort_by_time() -> None:
    a = new_run_id(1_700_000_000_000, bytes(10))
    b = new_run_id(1_700_000_000_001, bytes(10))
    assert RUN_ID.match(a) and RUN_ID.match(b) and a < b
    assert new_run_id(5, bytes(range(10))) != new_run_id(5, bytes(10))


# -- paging, admission --------------------------------------------------------------------------


def test_page_tokens_round_trip_and_are_bound_to_their_listing() -> None:
    token = encode_token("agents", "abc")
    assert decode_token(token, "agents") == "abc"
    assert decode_token("", "agents") is None
    for bad in ("!!!", encode_token("tools", "abc"), "e30"):
        with pytest.raises(InvalidPageToken):
            decode_token(bad, "agents")
    assert page_size(0) == 50 and page_size(10_000) == MAX_PAGE_SIZE
    with pytest.raises(InvalidArgument):
        page_size(-1)


def test_rate_limiter_refuses_past_the_burst_and_refills() -> None:
    limiter = SubmitRateLimiter(rate_per_s=2.0, burst=2)
    limiter.admit("t", 100.0)
    limiter.admit("t", 100.0)
    with pytest.raises(RateLimited) as err:
        limiter.admit("t", 100.0)
    assert err.value.retry_after_s == pytest.approx(0.5)
    limiter.admit("other", 100.0)  # tenants have their own buckets
    limiter.admit("t", 100.5)


# -- stream order, approvals, trace -----------------------------------------------------------


def ev(seq: int, etype: str, at: int, **payload) -> EventView:
    return EventView("R", seq, f"e{seq}", f"tether.v1.{etype}", at, json.dumps(payload))


def test_seq_gate_sends_each_seq_once_in_order() -> None:
    gate = SeqGate(from_seq=3)
    assert gate.offer(2) is Offer.SEEN and gate.offer(4) is Offer.AHEAD and gate.offer(3) is Offer.NEXT
    gate.sent(ev(3, "StepGranted", 0))
    assert gate.offer(3) is Offer.SEEN
    with pytest.raises(ValueError):
        gate.sent(ev(5, "StepGranted", 0))
    gate.sent(ev(4, "RunCompleted", 0))
    assert gate.done


def test_pending_approval_past_expiry_reads_as_expired() -> None:
    a = ApprovalView("a", "R", "1.0", "h" * 64, "PENDING", expires_at_ms=1000)
    assert a.effective_status(1000) == "PENDING" and a.effective_status(1001) == "EXPIRED"


def test_trace_offsets_and_spans() -> None:
    events = [
        ev(1, "RunAccepted", 1000),
        ev(2, "StepGranted", 1010, step=1),
        ev(3, "ModelCallCompleted", 1110, step=1),
        ev(4, "ToolCallRequested", 1111, step=1, call={"call_id": "1.0", "tool_name": "web_search"}),
        ev(5, "ToolCallBudgeted", 1115, step=1, call_id="1.0"),
        ev(6, "ToolCallCompleted", 1315, step=1, call_id="1.0", tool_name="web_search"),
        ev(7, "StepGranted", 1320, step=2),
    ]
    trace = build_trace(events)
    assert [t.offset_ms for t in trace.events] == [0, 10, 110, 111, 115, 315, 320]
    assert trace.events[3].call_id == "1.0" and trace.events[3].step == 1
    assert trace.events[5].since_previous_ms == 200
    spans = {(s.kind, s.name): s for s in trace.spans}
    assert spans[("model", "step 1 model")].duration_ms == 100
    tool = spans[("tool", "call 1.0 web_search")]
    assert (tool.start_seq, tool.end_seq, tool.duration_ms, tool.outcome) == (5, 6, 200, "ToolCallCompleted")
    assert spans[("model", "step 2 model")].outcome == ""  # still open
    assert trace.duration_ms == 320
