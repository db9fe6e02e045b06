"""Use cases against the in-memory fakes: submit idempotency, tenancy, cancel, approvals, resumable streams."""

from __future__ import annotations

import json

import pytest

from tether_contracts.records import CancelRun, DecideApproval, SubmitRun
from tether_messaging.envelopes import derived_id
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import open_payload
from tether_run_api import handlers
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_APPROVER, ROLE_MEMBER, Principal
from tether_run_api.domain.catalog import AgentDraft, CapsDraft, CatalogLimits, ToolDraft
from tether_run_api.domain.errors import (
    AgentNotFound,
    AgentVersionConflict,
    ApprovalExpired,
    ApprovalNotFound,
    ApprovalNotPending,
    CommandNotDelivered,
    MissingRole,
    RateLimited,
    RequestIdReused,
    RunAlreadyFinished,
    RunNotFound,
    SelfApproval,
    StaleArgsHash,
    StreamHole,
    StreamResumeRequired,
)
from tether_run_api.domain.runs import RunLimits, SubmitRequest, new_run_id
from tether_run_api.domain.views import ApprovalView, EventView, RunStatus, RunView
from tether_run_api.ports import LiveEntry
from tether_run_api.testing import FakeCatalog, FakeLedger, FakeLiveEvents, FakePublisher, FakeReadModel

ADMIN = Principal("acme", "root", frozenset({ROLE_ADMIN}))
ALICE = Principal("acme", "alice", frozenset({ROLE_MEMBER}))
APPROVER = Principal("acme", "bob", frozenset({ROLE_MEMBER, ROLE_APPROVER}))
MALLORY = Principal("evil", "mallory", frozenset({ROLE_ADMIN, ROLE_APPROVER}))
CAPS = CapsDraft(max_steps=10, max_wall_clock_ms=60_000, max_tokens=100_000, max_cost_usd_micros=1_000_000)
LIMITS = CatalogLimits()
P = 6


class World:
    def __init__(self) -> None:
        self.catalog = FakeCatalog()
        self.ledger = FakeLedger()
        self.publisher = FakePublisher()
        self.read_model = FakeReadModel()
        self.live = FakeLiveEvents()
        self.limiter = SubmitRateLimiter(1000.0, 1000)
        self.now = 1_700_000_000_000
        self.ids = 0
        handlers.create_agent(
            AgentDraft(agent_id="helper", display_name="Helper", instructions="Help.", model_provider="openai",
                       model_name="m", tool_allowlist=("web_search",), caps=CAPS),
            "", principal=ADMIN, now_ms=self.now, catalog=self.catalog, limits=LIMITS,
        )
        handlers.register_tool(
            ToolDraft(name="web_search", description="Search.", args_schema_json='{"type":"object"}',
                      risk_class="READ_ONLY", executor_kind="builtin"),
            "", principal=ADMIN, now_ms=self.now, catalog=self.catalog, limits=LIMITS,
        )
        self.catalog.grant("acme", "*", ["web_search"])

    def submit(self, request_id: str = "req-1", goal: str = "find things", principal: Principal = ALICE,
               **kw) -> str:
        self.ids += 1
        sub = handlers.submit_run(
            SubmitRequest(request_id, kw.pop("agent_id", "helper"), goal, **kw),
            principal=principal, now_ms=self.now, run_id=new_run_id(self.now, self.ids.to_bytes(10, "big")),
            catalog=self.catalog, ledger=self.ledger, publisher=self.publisher, limiter=self.limiter,
            limits=RunLimits(), partitioning=handlers.Partitioning(P),
        )
        return sub.run_id


@pytest.fixture
def world() -> World:
    return World()


# -- submit -------------------------------------------------------------------------------------


def test_submit_produces_a_snapshot_command_to_the_runs_partition(world: World) -> None:
    run_id = world.submit()
    [(env, partition)] = world.publisher.published
    assert partition == partition_for("acme", run_id, P, 1)
    assert (env.run_id, env.tenant_id, env.producer) == (run_id, "acme", "run-api")
    assert env.event_id == derived_id(run_id, "SubmitRun")
    cmd = open_payload(env)
    assert isinstance(cmd, SubmitRun)
    assert cmd.agent.agent_id == "helper" and [t.name for t in cmd.tools] == ["web_search"]
    assert cmd.tenant_grants == ["web_search"] and cmd.principal_id == "alice"


def test_submit_is_idempotent_on_request_id(world: World) -> None:
    first = world.submit("req-1")
    again = world.submit("req-1")
    assert again == first
    assert len(world.publisher.published) == 1
    assert world.submit("req-2") != first


def test_same_request_id_with_another_request_is_refused(world: World) -> None:
    world.submit("req-1", goal="a")
    with pytest.raises(RequestIdReused):
        world.submit("req-1", goal="b")


def test_request_ids_are_per_tenant(world: World) -> None:
    world.catalog.agents[("evil", "helper")] = world.catalog.agents[("acme", "helper")]
    assert world.submit("req-1") != world.submit("req-1", principal=MALLORY)


def test_a_lost_ack_is_retried_with_the_identical_record(world: World) -> None:
    world.publisher.fail_next = 1
    with pytest.raises(CommandNotDelivered):
        world.submit("req-1")
    run_id = world.submit("req-1")
    [(env, _)] = world.publisher.published
    assert env.run_id == run_id and env.event_id == derived_id(run_id, "SubmitRun")
    assert world.ledger.get("acme", "req-1").delivered


def test_a_submit_whose_ack_never_came_is_redelivered_identically(world: World) -> None:
    world.publisher.fail_next = 1
    with pytest.raises(CommandNotDelivered):
        world.submit("req-1")
    assert handlers.redeliver_submissions(ledger=world.ledger, publisher=world.publisher, now_ms=world.now + 10,
                                          grace_ms=30) == 0  # too young: its caller may still be retrying
    assert handlers.redeliver_submissions(ledger=world.ledger, publisher=world.publisher, now_ms=world.now + 31,
                                          grace_ms=30) == 1
    [(env, partition)] = world.publisher.published
    row = world.ledger.get("acme", "req-1")
    assert row.delivered and env.run_id == row.run_id and partition == row.partition
    assert env.event_id == derived_id(row.run_id, "SubmitRun")
    assert handlers.redeliver_submissions(ledger=world.ledger, publisher=world.publisher, now_ms=world.now + 99,
                                          grace_ms=30) == 0


def test_unknown_agent_and_other_tenants_agent_are_not_found(world: World) -> None:
    with pytest.raises(AgentNotFound):
        world.submit(agent_id="nobody")
    with pytest.raises(AgentNotFound):
        world.submit(principal=MALLORY)  # "helper" exists only for acme
    assert world.publisher.published == []


def test_rate_limit_applies_to_new_submits_only(world: World) -> None:
    world.limiter = SubmitRateLimiter(1.0, 1)
    run_id = world.submit("req-1")
    with pytest.raises(RateLimited):
        world.submit("req-2")
    assert world.submit("req-1") == run_id  # a retry of an accepted submit is never throttled


def test_disabled_tool_versions_fall_back_or_drop_out_of_the_snapshot(world: World) -> None:
    handlers.register_tool(
        ToolDraft(name="web_search", description="Search v2.", args_schema_json='{"type":"object"}',
                  risk_class="READ_ONLY", executor_kind="builtin"),
        "", principal=ADMIN, now_ms=world.now, catalog=world.catalog, limits=LIMITS,
    )
    assert handlers.disable_tool("web_search", 2, principal=ADMIN, catalog=world.catalog) == [2]
    world.submit("a")
    assert [t.version for t in open_payload(world.publisher.published[-1][0]).tools] == [1]
    assert handlers.disable_tool("web_search", 0, principal=ADMIN, catalog=world.catalog) == [1]
    world.submit("b")
    assert open_payload(world.publisher.published[-1][0]).tools == []


# -- catalog ------------------------------------------------------------------------------------


def test_update_agent_makes_versions_and_checks_the_precondition(world: World) -> None:
    draft = AgentDraft(agent_id="helper", instructions="Be brief.")
    v2 = handlers.update_agent(draft, ["instructions"], 1, "", principal=ADMIN, now_ms=1, catalog=world.catalog,
                               limits=LIMITS)
    assert v2.spec.version == 2 and v2.spec.instructions == "Be brief." and v2.spec.name == "Helper"
    with pytest.raises(AgentVersionConflict):
        handlers.update_agent(draft, ["instructions"], 1, "", principal=ADMIN, now_ms=1, catalog=world.catalog,
                              limits=LIMITS)
    with pytest.raises(MissingRole):
        handlers.update_agent(draft, ["instructions"], 0, "", principal=ALICE, now_ms=1, catalog=world.catalog,
                              limits=LIMITS)
    assert handlers.get_agent("helper", 1, principal=ALICE, catalog=world.catalog).spec.instructions == "Help."


def test_list_agents_pages(world: World) -> None:
    for i in range(5):
        handlers.create_agent(
            AgentDraft(agent_id=f"a{i}", display_name="A", instructions="x", model_provider="openai",
                       model_name="m", caps=CAPS),
            "", principal=ADMIN, now_ms=1, catalog=world.catalog, limits=LIMITS,
        )
    seen, token = [], ""
    while True:
        page, token = handlers.list_agents(2, token, principal=ALICE, catalog=world.catalog)
        seen += [a.spec.agent_id for a in page]
        if not token:
            break
    assert seen == ["a0", "a1", "a2", "a3", "a4", "helper"]


# -- queries and cancel -----------------------------------------------------------------------


def test_get_run_is_pending_until_projected_and_invisible_to_other_tenants(world: World) -> None:
    run_id = world.submit()
    assert handlers.get_run(run_id, principal=ALICE, read_model=world.read_model,
                            ledger=world.ledger).status is RunStatus.PENDING
    world.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, answer="42")
    assert handlers.get_run(run_id, principal=ALICE, read_model=world.read_model, ledger=world.ledger).answer == "42"
    with pytest.raises(RunNotFound):
        handlers.get_run(run_id, principal=MALLORY, read_model=world.read_model, ledger=world.ledger)


def test_cancel_produces_one_command_per_run_and_refuses_finished_runs(world: World) -> None:
    run_id = world.submit()
    kw = dict(principal=ALICE, now_ms=world.now, read_model=world.read_model, ledger=world.ledger,
              publisher=world.publisher, partitioning=handlers.Partitioning(P), catalog=world.catalog)
    handlers.cancel_run(run_id, "", **kw)
    env, partition = world.publisher.published[-1]
    assert isinstance(open_payload(env), CancelRun) and env.event_id == derived_id(run_id, "CancelRun")
    assert partition == world.publisher.published[0][1]
    with pytest.raises(RunNotFound):
        handlers.cancel_run(run_id, "", **{**kw, "principal": MALLORY})
    world.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.TERMINATED)
    with pytest.raises(RunAlreadyFinished):
        handlers.cancel_run(run_id, "", **kw)


# -- approvals ------------------------------------------------------------------------------------


def _approval(world: World, run_id: str, **kw) -> ApprovalView:
    a = ApprovalView(**{"approval_id": "ap-1", "run_id": run_id, "call_id": "2.0", "args_hash": "a" * 64,
                        "status": "PENDING", "tool_name": "send_email", "expires_at_ms": world.now + 1000, **kw})
    world.read_model.approvals[("acme", a.approval_id)] = a
    return a


def test_decide_approval_checks_role_tenant_status_and_args_hash(world: World) -> None:
    run_id = world.submit()
    _approval(world, run_id)
    kw = dict(now_ms=world.now, read_model=world.read_model, ledger=world.ledger, catalog=world.catalog,
              publisher=world.publisher, partitioning=handlers.Partitioning(P))
    ok = handlers.Decision("ap-1", "a" * 64, True, "fine")
    with pytest.raises(MissingRole):
        handlers.decide_approval(ok, principal=ALICE, **kw)
    with pytest.raises(ApprovalNotFound):
        handlers.decide_approval(ok, principal=MALLORY, **kw)
    with pytest.raises(StaleArgsHash):
        handlers.decide_approval(handlers.Decision("ap-1", "b" * 64, True), principal=APPROVER, **kw)
    with pytest.raises(ApprovalExpired):
        handlers.decide_approval(ok, principal=APPROVER, **{**kw, "now_ms": world.now + 1001})
    # Exactly at the deadline is still in time.
    decided = handlers.decide_approval(ok, principal=APPROVER, **{**kw, "now_ms": world.now + 1000})
    assert decided.status == "APPROVED" and decided.decided_by == "bob"
    env, partition = world.publisher.published[-1]
    cmd = open_payload(env)
    assert isinstance(cmd, DecideApproval)
    assert (cmd.approval_id, cmd.call_id, cmd.args_hash, cmd.approver_id, cmd.approve) == \
        ("ap-1", "2.0", "a" * 64, "bob", True)
    assert cmd.approver_roles == ["approver", "member"]
    assert env.run_id == run_id and partition == world.publisher.published[0][1]
    world.read_model.approvals[("acme", "ap-1")] = _approval(world, run_id, status="APPROVED")
    with pytest.raises(ApprovalNotPending):
        handlers.decide_approval(ok, principal=APPROVER, **kw)


def test_list_approvals_filters_on_the_status_it_shows(world: World) -> None:
    # A stored PENDING past its expiry is shown EXPIRED, so it is listed under EXPIRED, not PENDING;
    # exactly at expires_at_ms it is still in time, and one without an expiry never expires.
    run_id = world.submit()
    stored = {"late": ("PENDING", world.now - 1), "due": ("PENDING", world.now), "open": ("PENDING", None),
              "old": ("EXPIRED", world.now - 5000), "done": ("APPROVED", world.now - 1)}
    for i, (approval_id, (status, expires)) in enumerate(stored.items()):
        _approval(world, run_id, approval_id=approval_id, status=status, expires_at_ms=expires, requested_at_ms=i)
    listed = {}
    for status in ("PENDING", "EXPIRED", "APPROVED"):
        rows, _ = handlers.list_approvals(status, "", 0, "", principal=ALICE, read_model=world.read_model,
                                          now_ms=world.now)
        listed[status] = [a.approval_id for a in rows]
        assert {a.effective_status(world.now) for a in rows} <= {status}
    assert listed == {"PENDING": ["due", "open"], "EXPIRED": ["late", "old"], "APPROVED": ["done"]}
    # Paging through EXPIRED mixes both kinds in one order.
    first, token = handlers.list_approvals("EXPIRED", "", 1, "", principal=ALICE, read_model=world.read_model,
                                           now_ms=world.now)
    rest, _ = handlers.list_approvals("EXPIRED", "", 1, token, principal=ALICE, read_model=world.read_model,
                                      now_ms=world.now)
    assert [a.approval_id for a in first + rest] == ["late", "old"]


def test_an_approver_may_not_approve_their_own_run_but_may_reject_it(world: World) -> None:
    run_id = world.submit(principal=APPROVER)
    _approval(world, run_id)
    kw = dict(now_ms=world.now, read_model=world.read_model, ledger=world.ledger, catalog=world.catalog,
              publisher=world.publisher, partitioning=handlers.Partitioning(P))
    with pytest.raises(SelfApproval):
        handlers.decide_approval(handlers.Decision("ap-1", "a" * 64, True), principal=APPROVER, **kw)
    assert handlers.decide_approval(handlers.Decision("ap-1", "a" * 64, False), principal=APPROVER,
                                    **kw).status == "REJECTED"
    assert handlers.decide_approval(handlers.Decision("ap-1", "a" * 64, True), principal=APPROVER,
                                    forbid_self_approval=False, **kw).status == "APPROVED"


# -- streaming ------------------------------------------------------------------------------------


def _events(run_id: str, n: int, terminal_at: int | None = None) -> list[EventView]:
    out = []
    for seq in range(1, n + 1):
        etype = "tether.v1.RunCompleted" if seq == terminal_at else "tether.v1.StepGranted"
        out.append(EventView(run_id, seq, f"e{seq}", etype, 1000 + seq, json.dumps({"step": seq})))
    return out


def _stream(world: World, run_id: str, from_seq: int, *, active_reads: int = 50, principal: Principal = ALICE):
    reads = {"n": 0}

    def is_active() -> bool:
        reads["n"] += 1
        return reads["n"] <= active_reads

    return list(handlers.stream_run_events(
        run_id, from_seq, principal=principal, read_model=world.read_model, ledger=world.ledger, live=world.live,
        policy=handlers.StreamPolicy(page=2, block_ms=1, gap_wait_s=0.05, gap_poll_s=0.0), is_active=is_active,
        sleep=lambda s: None,
    ))


def test_stream_catches_up_then_follows_live_without_duplicates_or_gaps(world: World) -> None:
    run_id = world.submit()
    log = _events(run_id, 8, terminal_at=8)
    world.read_model.add_events("acme", log[:3])
    # Live feed: overlaps catch-up (2, 3), skips 4 (the projector's publish was lost), then 5..8.
    world.live.script[run_id] = [
        [LiveEntry(2, log[1]), LiveEntry(3, log[2])],
        [LiveEntry(5, log[4]), LiveEntry(6, None)],
        [LiveEntry(7, log[6]), LiveEntry(8, log[7])],
    ]
    world.read_model.add_events("acme", log[3:6])  # the read model has 4..6 by the time they are needed
    got = _stream(world, run_id, 0)
    assert [e.seq for e in got] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert got[-1].terminal


def test_stream_resumes_from_a_seq_with_nothing_lost(world: World) -> None:
    run_id = world.submit()
    log = _events(run_id, 6, terminal_at=6)
    world.read_model.add_events("acme", log)
    assert [e.seq for e in _stream(world, run_id, 4)] == [4, 5, 6]
    world.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, last_seq=6)
    assert _stream(world, run_id, 7) == []


def test_a_quiet_feed_falls_back_to_the_read_model(world: World) -> None:
    run_id = world.submit()
    log = _events(run_id, 3, terminal_at=3)
    world.read_model.add_events("acme", log[:1])
    world.live.script[run_id] = [[]]  # one quiet read; meanwhile the projector committed 2..3 but Redis is silent

    original = world.live.read

    def read_then_commit(rid: str, cursor: str, block_ms: int):
        out = original(rid, cursor, block_ms)
        world.read_model.add_events("acme", log[1:])
        return out

    world.live.read = read_then_commit  # type: ignore[method-assign]
    assert [e.seq for e in _stream(world, run_id, 1)] == [1, 2, 3]


def test_a_stream_from_past_the_end_ends_when_the_run_finishes_during_it(world: World) -> None:
    # A 5-event run, still running, watched from seq 10: the feed then shows 4 and 5 (terminal).
    # Nothing is sent, and the stream ends at once rather than holding its slot until the client leaves.
    run_id = world.submit()
    log = _events(run_id, 5, terminal_at=5)
    world.read_model.add_events("acme", log[:3])
    world.live.script[run_id] = [[LiveEntry(4, log[3]), LiveEntry(5, log[4])]]
    assert _stream(world, run_id, 10, active_reads=1000) == []
    assert world.live.reads == 1


def test_a_stream_from_past_the_end_ends_on_a_quiet_feed_once_the_run_has_finished(world: World) -> None:
    # The terminal event's live publish was lost: a quiet feed re-checks the run itself.
    run_id = world.submit()
    log = _events(run_id, 5, terminal_at=5)
    world.read_model.add_events("acme", log[:3])
    world.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.RUNNING, last_seq=3)
    world.live.script[run_id] = [[], [], []]
    original = world.live.read

    def read_then_finish(rid: str, cursor: str, block_ms: int):
        out = original(rid, cursor, block_ms)
        if world.live.reads == 2:  # quiet reads while running, then the run completes at seq 5
            world.read_model.add_events("acme", log[3:])
            world.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, last_seq=5)
        return out

    world.live.read = read_then_finish  # type: ignore[method-assign]
    assert _stream(world, run_id, 10, active_reads=1000) == []
    assert world.live.reads == 2
    # An already finished run watched from past its end: no events, at once (as before).
    assert _stream(world, run_id, 6) == [] and world.live.reads == 2


def test_a_gap_the_read_model_never_fills_asks_the_client_to_resume(world: World) -> None:
    run_id = world.submit()
    log = _events(run_id, 5, terminal_at=5)
    world.read_model.add_events("acme", log[:1])
    world.live.script[run_id] = [[LiveEntry(3, log[2])]]
    seen = []
    with pytest.raises(StreamResumeRequired) as err:
        for e in handlers.stream_run_events(
            run_id, 1, principal=ALICE, read_model=world.read_model, ledger=world.ledger, live=world.live,
            policy=handlers.StreamPolicy(page=10, block_ms=1, gap_wait_s=0.0, gap_poll_s=0.0),
            is_active=lambda: True, sleep=lambda s: None,
        ):
            seen.append(e.seq)
    assert seen == [1]
    assert err.value.metadata["next_seq"] == "2"


def test_a_hole_in_the_read_model_ends_the_stream_at_it_instead_of_polling_for_ever(world: World) -> None:
    # A finished run whose seq 2 the projector never stored (dead-lettered), everything published before
    # the stream opened: the feed stays quiet, and the read model can never fill the hole (the projector's
    # last_seq is past it), so the stream ends at it with STREAM_HOLE (not the retryable
    # STREAM_RESUME_REQUIRED), on every resume, naming the next stored seq.
    run_id = world.submit()
    log = _events(run_id, 5, terminal_at=5)
    world.read_model.add_events("acme", [log[0], *log[2:]])
    world.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, last_seq=5)
    world.live.feeds[run_id] = [LiveEntry(e.seq, e) for e in log if e.seq != 2]
    for from_seq, sent_before in ((0, [1]), (2, [])):
        seen: list[int] = []
        with pytest.raises(StreamHole) as err:
            for e in handlers.stream_run_events(
                run_id, from_seq, principal=ALICE, read_model=world.read_model, ledger=world.ledger,
                live=world.live, policy=handlers.StreamPolicy(page=10, block_ms=1, gap_wait_s=60.0, gap_poll_s=0.0),
                is_active=lambda: world.live.reads < 1000, sleep=lambda s: None,
            ):
                seen.append(e.seq)
        assert seen == sent_before
        assert err.value.metadata == {"run_id": run_id, "next_seq": "2", "next_stored_seq": "3"}
        assert err.value.message.endswith("missing seq 2 and nothing will fill it; resume at seq 3: the next "
                                          "stored event, or the end of the run's log if its last seq is 2")
        assert err.value.retry_after_s is None
    assert world.live.reads == 0  # ended from the catch-up itself, not after polling
    assert [e.seq for e in _stream(world, run_id, 3)] == [3, 4, 5]  # past the hole the rest is served


def test_stream_of_another_tenants_run_is_not_found(world: World) -> None:
    run_id = world.submit()
    with pytest.raises(RunNotFound):
        _stream(world, run_id, 0, principal=MALLORY)
