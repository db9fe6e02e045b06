"""The tether CLI against a run-api on loopback backed by fakes, and its resuming event follower."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import replace
from datetime import UTC, datetime

import grpc
import pytest
from typer.testing import CliRunner

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import TerminationReport
from tether_run_api import handlers
from tether_run_api.api.server import start_server
from tether_run_api.api.servicers import Services
from tether_run_api.cli import main as cli
from tether_run_api.cli.client import CliError, connect
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import (
    ROLE_ADMIN,
    ROLE_APPROVER,
    ROLE_MEMBER,
    ApiKeyRecord,
    Principal,
    hash_api_key,
)
from tether_run_api.domain.catalog import AgentDraft, CapsDraft, CatalogLimits
from tether_run_api.domain.views import ApprovalView, EventView, RunStatus, RunView
from tether_run_api.ports import LiveEntry
from tether_run_api.testing import (
    FakeApiKeys,
    FakeCatalog,
    FakeLedger,
    FakeLiveEvents,
    FakePublisher,
    FakeReadModel,
)
from tether_testing.processes import free_port
from tether_testing.system import ApiClient

KEY = "tk_cli_" + "k" * 30
ME = Principal("acme", "alice", frozenset({ROLE_ADMIN, ROLE_APPROVER, ROLE_MEMBER}))


@pytest.fixture
def env(monkeypatch) -> Iterator[Services]:
    keys = FakeApiKeys()
    keys.keys[hash_api_key(KEY)] = ME
    services = Services(
        keys=keys, catalog=FakeCatalog(), ledger=FakeLedger(), read_model=FakeReadModel(), live=FakeLiveEvents(),
        publisher=FakePublisher(), limiter=SubmitRateLimiter(100, 100), partitioning=handlers.Partitioning(3),
        stream_policy=handlers.StreamPolicy(block_ms=10, gap_wait_s=0.5, gap_poll_s=0.01),
    )
    handlers.create_agent(
        AgentDraft(agent_id="demo", display_name="Demo", instructions="Help.", model_provider="openai",
                   model_name="m", caps=CapsDraft(max_steps=3, max_wall_clock_ms=1000, max_tokens=1000,
                                                  max_cost_usd_micros=1000)),
        "", principal=ME, now_ms=1, catalog=services.catalog, limits=CatalogLimits(),
    )
    server = start_server(services, port=0, workers=8)
    monkeypatch.setenv("TETHER_ADDR", f"127.0.0.1:{server.port}")
    monkeypatch.setenv("TETHER_API_KEY", KEY)
    yield services
    server.stop(0)


def invoke(*args: str, input: str | None = None):  # noqa: A002 (click's name)
    return CliRunner().invoke(cli.app, list(args), catch_exceptions=True, input=input)


def complete_run(services: Services, run_id: str, answer: str = "42") -> None:
    events = [EventView(run_id, 1, "e1", "tether.v1.RunAccepted", 1000, "{}"),
              EventView(run_id, 2, "e2", "tether.v1.RunCompleted", 1500, json.dumps({"step": 1, "answer": answer}))]
    services.read_model.add_events("acme", events)
    services.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, agent_id="demo",
                                                          agent_version=1, goal="g", answer=answer, last_seq=2)


def test_run_without_watch_prints_the_run_id(env: Services) -> None:
    result = invoke("run", "Find it", "--request-id", "fixed-1")
    assert result.exit_code == 0, result.output
    run_id = result.stdout.strip()
    assert env.ledger.find_run("acme", run_id) is not None
    assert invoke("run", "Find it", "--request-id", "fixed-1").stdout.strip() == run_id


def test_run_watch_streams_and_prints_the_answer(env: Services) -> None:
    original = env.ledger.claim

    def claim_and_finish(submission):
        row = original(submission)
        complete_run(env, row.run_id, answer="The answer is 42.")
        return row

    env.ledger.claim = claim_and_finish  # type: ignore[method-assign]
    result = invoke("run", "What is it?", "--watch")
    assert result.exit_code == 0, result.output
    assert "RunCompleted" in result.output and "The answer is 42." in result.output and "COMPLETED" in result.output


def test_terminated_run_exits_2_with_the_report(env: Services) -> None:
    run_id = invoke("run", "x").stdout.strip()
    env.read_model.add_events("acme", [EventView(run_id, 1, "e1", "tether.v1.RunTerminated", 1, "{}")])
    env.read_model.runs[("acme", run_id)] = RunView(
        run_id, RunStatus.TERMINATED, last_seq=1,
        termination=TerminationReport(reason_code="STEP_CAP", detail="3 steps used", steps_done=3,
                                      tool_calls_done=["1.0 http_get COMPLETED"], pending=[],
                                      usage={"input_tokens": 1}),
    )
    result = invoke("watch", run_id)
    assert result.exit_code == 2
    assert "STEP_CAP" in result.output and "1.0 http_get COMPLETED" in result.output


def test_watch_shows_the_facts_recorded_after_the_run_ended(env: Services) -> None:
    # Cancelled while send_mail was executing: the budget records the call's outcome after RunTerminated.
    run_id = invoke("run", "x").stdout.strip()
    env.read_model.add_events("acme", [
        EventView(run_id, 1, "e1", "tether.v1.RunAccepted", 1000, "{}"),
        EventView(run_id, 2, "e2", "tether.v1.RunTerminated", 1100, json.dumps({"reason_code": "CANCELLED"})),
        EventView(run_id, 3, "e3", "tether.v1.ToolCallCompleted", 1200, json.dumps({"tool_name": "send_mail"})),
    ])
    env.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.TERMINATED, agent_id="demo", agent_version=1,
                                                     goal="g", last_seq=3)
    result = invoke("--json", "watch", run_id)
    assert result.exit_code == 2, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"seq"')]
    assert [(line["seq"], line["event_type"]) for line in lines] == [
        (1, "tether.v1.RunAccepted"), (2, "tether.v1.RunTerminated"), (3, "tether.v1.ToolCallCompleted")]


def test_get_json_and_errors(env: Services) -> None:
    run_id = invoke("run", "x").stdout.strip()
    result = invoke("--json", "get", run_id)
    assert result.exit_code == 0 and json.loads(result.stdout)["status"] == "RUN_STATUS_PENDING"
    result = invoke("get", "0" * 26)
    assert isinstance(result.exception, CliError) and "RUN_NOT_FOUND" in str(result.exception)
    result = invoke("--api-key", "tk_" + "w" * 30, "get", run_id)
    assert isinstance(result.exception, CliError) and "UNAUTHENTICATED_API_KEY" in str(result.exception)


def test_approve_quotes_the_hash_it_showed(env: Services) -> None:
    run_id = "01ARZ3NDEKTSV4RRFFQ69G5FAV"  # submitted by someone else: alice may approve its calls
    env.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.WAITING, principal_id="carol")
    env.read_model.approvals[("acme", "ap-1")] = ApprovalView(
        "ap-1", run_id, "1.0", "c" * 64, "PENDING", tool_name="send_email",
        args_json='{"to": "a@b.c", "body": "' + "x" * 300 + '"}',
        expires_at_ms=4_000_000_000_000)
    listed = json.loads(invoke("--json", "approvals", "list").stdout)  # long lines must not be wrapped
    assert listed["approvals"][0]["args_json"] == '{"to": "a@b.c", "body": "' + "x" * 300 + '"}'
    result = invoke("approvals", "approve", "ap-1", "--yes", "--comment", "fine")
    assert result.exit_code == 0, result.output
    assert "a@b.c" in result.output and "approved ap-1" in result.output
    env_, _ = env.publisher.published[-1]
    assert env_.event_type == "tether.v1.DecideApproval"
    result = invoke("approvals", "reject", "ap-1", input="n\n")
    assert result.exit_code == 1  # declined at the prompt: nothing sent
    assert env.publisher.published[-1][0] is env_


def test_agents_and_tools_commands(env: Services, tmp_path) -> None:
    tool_file = tmp_path / "tool.json"
    tool_file.write_text(json.dumps({"name": "kv_get", "description": "Read a key.", "risk_class": "RISK_CLASS_READ_ONLY",
                                     "executor_kind": "builtin", "args_schema": {"type": "object"},
                                     "executor_config": {"builtin": "kv_get"},
                                     "constraints": {"rules": []}}))
    assert "registered tool kv_get v1" in invoke("tools", "register", "-f", str(tool_file)).output
    assert "kv_get" in invoke("tools", "list").output
    assert json.loads(invoke("--json", "tools", "get", "kv_get").stdout)["constraints_json"] == '{"rules":[]}'
    assert "disabled kv_get versions [1]" in invoke("tools", "disable", "kv_get").output
    agent_file = tmp_path / "agent.json"
    agent_file.write_text(json.dumps({"agent_id": "demo", "instructions": "Be brief."}))
    assert "agent demo is now v2" in invoke("agents", "update", "-f", str(agent_file), "--mask", "instructions").output
    listed = json.loads(invoke("--json", "agents", "list").stdout)
    assert listed["agents"][0]["version"] == 2


class _Dropped(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset"

    def trailing_metadata(self):
        return ()


class _FlakyRuns:
    """Serves the log 1..6 but drops the connection after every second event."""

    def __init__(self) -> None:
        self.requests: list[int] = []

    def StreamRunEvents(self, request, metadata=None):  # noqa: N802
        self.requests.append(request.from_seq)
        sent = 0
        for seq in range(request.from_seq, 7):
            if sent == 2:
                raise _Dropped()
            # A server may repeat the last event after a reconnect; the follower must not show it twice.
            yield runs_pb.StreamRunEventsResponse(event=runs_pb.RunEvent(seq=seq, terminal=seq == 6))
            sent += 1


class _FakeClient:
    metadata = [("authorization", "Bearer x")]

    def __init__(self) -> None:
        self.runs = _FlakyRuns()


def test_follow_reconnects_from_the_next_seq_and_shows_each_event_once() -> None:
    client = _FakeClient()
    seen: list[int] = []
    last = cli.follow(client, "R", 1, on_event=lambda e: seen.append(e.seq), sleep=lambda s: None)
    assert seen == [1, 2, 3, 4, 5, 6] and last.seq == 6
    assert client.runs.requests == [1, 3, 5]



def test_watch_goes_on_past_a_hole_in_the_read_model_and_says_so(env: Services) -> None:
    # seqs 2 and 3 were never stored (the projector dead-lettered them and moved past them): run-api ends
    # the stream at the hole with DATA_LOSS / STREAM_HOLE (next_seq 2, next_stored_seq 4). The CLI shows
    # both as missing at once and follows the run to its end from seq 4.
    run_id = invoke("run", "x").stdout.strip()
    env.read_model.add_events("acme", [
        EventView(run_id, 1, "e1", "tether.v1.RunAccepted", 1000, "{}"),
        EventView(run_id, 4, "e4", "tether.v1.StepGranted", 1100, "{}"),
        EventView(run_id, 5, "e5", "tether.v1.RunCompleted", 1500, json.dumps({"step": 1, "answer": "42"})),
    ])
    env.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, agent_id="demo", agent_version=1,
                                                     goal="g", answer="42", last_seq=5)
    result = invoke("--json", "watch", run_id)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"seq"')]
    assert [(line["seq"], line.get("missing", False)) for line in lines] == [
        (1, False), (2, True), (3, True), (4, False), (5, False)]
    assert lines[1]["reason"] == lines[2]["reason"] == "STREAM_HOLE"
    assert "seqs 2..3 missing from the read model" in result.output
    assert f"tether audit verify --run {run_id}" in result.output


class _Clock:
    """A clock that a sleep moves on, so bounded waits pass without waiting."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_follow_goes_past_a_hole_at_once_and_asks_again_for_a_seq_not_stored_yet(env: Services) -> None:
    run_id = invoke("run", "x").stdout.strip()
    env.read_model.add_events("acme", [EventView(run_id, 1, "e1", "tether.v1.RunAccepted", 1000, "{}"),
                                       EventView(run_id, 3, "e3", "tether.v1.RunCompleted", 1500, "{}")])
    env.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, last_seq=3)
    client, clock = connect(os.environ["TETHER_ADDR"], KEY), _Clock()
    seen, missing = [], []
    try:
        # A hole (DATA_LOSS / STREAM_HOLE) is permanent: reported and skipped at once, no retry, no wait.
        for on_missing in (lambda first, last, err: missing.append((first, last, cli.reason(err))), None):
            seen.clear()
            with pytest.raises(CliError) if on_missing is None else nullcontext() as refused:
                cli.follow(client, run_id, 1, on_event=lambda e: seen.append(e.seq), on_missing=on_missing,
                           sleep=clock.sleep, monotonic=lambda: clock.now)
            if on_missing is not None:
                assert seen == [1, 3] and missing == [(2, 2, "STREAM_HOLE")]
        assert seen == [1]  # without on_missing: a clear error at the hole instead
        assert "--from-seq 3" in str(refused.value) and "STREAM_HOLE" in str(refused.value)
        assert clock.slept == []

        # A seq seen live but not stored yet (UNAVAILABLE / STREAM_RESUME_REQUIRED) is only late: it is
        # asked again with growing delays (the server's RetryInfo 0.5 s at least), never skipped, for as
        # long as the projector takes (here: it stores seq 2 after 7.5 s of the fake clock).
        late = invoke("run", "y").stdout.strip()
        env.read_model.add_events("acme", [EventView(late, 1, "e1", "tether.v1.RunAccepted", 1000, "{}")])
        env.read_model.runs[("acme", late)] = RunView(late, RunStatus.RUNNING, last_seq=1)
        announce = lambda: env.live.script.__setitem__(late, [[LiveEntry(2, None)]])  # noqa: E731
        announce()

        def projector_catches_up_later(seconds: float) -> None:
            clock.sleep(seconds)
            if clock.now < 7.5:
                announce()  # the next stream is told of seq 2 again and still does not find it
                return
            env.read_model.add_events("acme", [
                EventView(late, 2, "e2", "tether.v1.StepGranted", 1100, "{}"),
                EventView(late, 3, "e3", "tether.v1.RunCompleted", 1500, "{}")])
            env.read_model.runs[("acme", late)] = RunView(late, RunStatus.COMPLETED, last_seq=3)

        seen.clear()
        missing.clear()
        clock.slept.clear()
        cli.follow(client, late, 1, on_event=lambda e: seen.append(e.seq),
                   on_missing=lambda first, last, err: missing.append((first, last)),
                   sleep=projector_catches_up_later, monotonic=lambda: clock.now)
        assert seen == [1, 2, 3] and missing == []
        assert clock.slept == [0.5, 1.0, 2.0, 4.0]
    finally:
        client.close()


def test_the_e2e_follow_helper_goes_past_a_hole_only_when_asked_and_never_retries_it(env: Services) -> None:
    run_id = invoke("run", "x").stdout.strip()
    env.read_model.add_events("acme", [EventView(run_id, 1, "e1", "tether.v1.RunAccepted", 1000, "{}"),
                                       EventView(run_id, 4, "e4", "tether.v1.RunCompleted", 1500, "{}")])
    env.read_model.runs[("acme", run_id)] = RunView(run_id, RunStatus.COMPLETED, last_seq=4)
    client, missing = ApiClient(os.environ["TETHER_ADDR"], KEY), []
    try:
        queries = env.read_model.event_queries
        with pytest.raises(grpc.RpcError) as err:
            list(client.follow(run_id))
        assert err.value.code() is grpc.StatusCode.DATA_LOSS
        assert env.read_model.event_queries - queries == 1  # one stream: a hole is not asked again
        seen = [e.seq for e in client.follow(run_id, on_missing=lambda first, last: missing.append((first, last)))]
        assert seen == [1, 4] and missing == [(2, 3)]
    finally:
        client.channel.close()


def test_follow_gives_up_after_the_reconnect_window_with_a_clear_error() -> None:
    client, clock = connect(f"127.0.0.1:{free_port()}", KEY), _Clock()  # nothing listens there
    try:
        with pytest.raises(CliError) as err:
            cli.follow(client, "R", 7, on_event=lambda e: None, reconnect_window_s=30.0, sleep=clock.sleep,
                       monotonic=lambda: clock.now)
    finally:
        client.close()
    assert "UNAVAILABLE" in str(err.value) and "tether watch R --from-seq 7" in str(err.value)
    assert clock.now == 30.0 and max(clock.slept) == 5.0  # backoff capped, the window bounded


class _KeysStore:
    """The store calls of revoke-key, over stored key hashes (tenant acme, principal alice)."""

    def __init__(self, *key_hashes: str) -> None:
        self.records = [ApiKeyRecord(h, "acme", "alice", ("member",), "", datetime.now(UTC), None) for h in key_hashes]

    def api_keys(self, *, tenant_id: str | None = None, hash_prefix: str = "") -> list[ApiKeyRecord]:
        return [r for r in self.records if r.key_hash.startswith(hash_prefix) and tenant_id in (None, r.tenant_id)]

    def revoke_api_key(self, key_hash: str) -> bool:
        [record] = [r for r in self.records if r.key_hash == key_hash]
        if record.revoked_at is not None:
            return False
        self.records[self.records.index(record)] = replace(record, revoked_at=datetime.now(UTC))
        return True


def test_admin_revoke_key_takes_no_key_from_the_command_line_and_never_echoes_one(monkeypatch) -> None:
    monkeypatch.setattr(cli, "_store", lambda: pytest.fail("refused before any store call"))
    secret = "tk_" + "s" * 40
    for args, stdin, says in (
        (("admin", "revoke-key", secret), None, "takes no argument"),
        (("admin", "revoke-key", "--key-file", "-"), f"export K={secret}\nnot a key {secret}\n", "line 2: not an"),
        (("admin", "revoke-key"), None, "exactly one of --key-file"),
    ):
        result = invoke(*args, input=stdin)
        assert isinstance(result.exception, CliError), result.output
        assert result.exception.exit_code == cli.EXIT_INVALID_ARGUMENT and says in str(result.exception)
        assert secret not in str(result.exception) and secret not in result.output


def test_admin_revoke_key_by_id_needs_a_prefix_of_one_key(monkeypatch) -> None:
    store = _KeysStore("abcdef00" + "1" * 56, "abcdef00" + "2" * 56)
    monkeypatch.setattr(cli, "_store", lambda: store)
    for key_id, says in (("abcdef0", "8-64 hex"), ("abcdef0z", "8-64 hex"), ("abcdef00", "2 keys start with")):
        result = invoke("admin", "revoke-key", "--key-id", key_id)
        assert isinstance(result.exception, CliError) and says in str(result.exception), result.output
        assert result.exception.exit_code == cli.EXIT_INVALID_ARGUMENT
    assert all(r.revoked_at is None for r in store.records)
    first = invoke("--json", "admin", "revoke-key", "--key-id", "ABCDEF001")
    assert first.exit_code == 0 and json.loads(first.stdout)["status"] == "revoked"
    assert json.loads(first.stdout)["key_id"] == "abcdef001111"
    again = invoke("admin", "revoke-key", "--key-id", "abcdef001111")
    assert again.exit_code == 0 and "key abcdef001111 of alice in acme: already revoked at" in again.stdout
    assert [r.revoked_at is None for r in store.records] == [False, True]
    unknown = invoke("admin", "revoke-key", "--key-id", "abcdef001111", "--tenant", "other")
    assert unknown.exit_code == cli.EXIT_NOT_FOUND and "key abcdef001111: not found" in unknown.stdout
