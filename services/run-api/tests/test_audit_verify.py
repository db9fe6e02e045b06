"""`tether audit verify` over synthetic logs: a clean log verifies; tampering and decisions that do not follow are found."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from typer.testing import CliRunner

from tether_budget.domain.decisions import AdmissionPolicy, Decide, admit, fold
from tether_budget.domain.loopguard import LoopGuard
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    Caps,
    Envelope,
    ModelCallCompleted,
    ModelRef,
    RunCompleted,
    StepGranted,
    SubmitRun,
    ToolCall,
    ToolCallAuthorized,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallRequested,
    Usage,
)
from tether_messaging.chain import seal
from tether_messaging.envelopes import derived_id, headers_for, make_envelope
from tether_messaging.registry import RegistryCodec, SchemaRegistryClient, value_subject
from tether_messaging.serde import EnvelopeCodec, encode, open_payload
from tether_run_api.audit import AuditConfig, RunLog, render_text, verify_log
from tether_run_api.cli import main as cli
from tether_run_api.cli.audit import EXIT_UNREADABLE
from tether_run_api.cli.client import CliError
from tether_tool_gateway.builtin_tools import builtin_tool_specs
from tether_tool_gateway.domain.policy import Allow, CallDecisionInputs, TrustPolicy
from tether_tool_gateway.domain.policy_document import default_policy

RUN, TENANT = "run-audit-1", "t1"
T0 = 1_800_000_000_000
TOOLS = builtin_tool_specs(kv_url="http://127.0.0.1:1", smtp_host="127.0.0.1", smtp_port=1, email_from="a@x.test",
                           http_allow_hosts=["example.test"])
NAMES = [t.name for t in TOOLS]


def _submit(max_tool_calls: int = 10) -> SubmitRun:
    caps = Caps(max_steps=10, max_wall_clock_ms=3_600_000, max_tokens=100_000, max_cost_usd_micros=1_000_000,
                max_tool_calls=max_tool_calls)
    agent = AgentSpec(agent_id="a", version=1, name="a", instructions="be good",
                      model=ModelRef(provider="openai", name="m", context_window_tokens=128_000),
                      tool_allowlist=NAMES, caps=caps, compaction_threshold=0.8)
    return SubmitRun(request_id="r1", principal_id="alice", goal="do it", agent=agent, tools=TOOLS, caps=caps,
                     tenant_grants=NAMES)


class Sequencer:
    """Builds a run log the way the budget does (its domain decides, envelopes are sealed on a chain)."""

    def __init__(self, submit: SubmitRun) -> None:
        self.log: list[Envelope] = []
        self.clock = T0
        self.guard = LoopGuard()
        self.ledger, plan = admit(submit, run_id=RUN, tenant_id=TENANT, partition=0, event_id="submit-1",
                                  now_ms=self._tick(), policy=AdmissionPolicy())
        self._write(plan.entries, None)

    def _tick(self) -> int:
        self.clock += 7
        return self.clock

    def _append(self, env: Envelope) -> None:
        prev = self.log[-1].hash if self.log else "0" * 64
        self.log.append(seal(env, len(self.log) + 1, prev))

    def _write(self, entries, inbound: Envelope | None) -> None:
        for entry in entries:
            if isinstance(entry, Decide):
                self._append(make_envelope(entry.payload, run_id=RUN, tenant_id=TENANT,
                                           event_id=derived_id(RUN, *entry.what), producer="budget",
                                           recorded_at_ms=self.clock))
            else:
                self._append(inbound)

    def intake(self, payload: AvroRecord, producer: str, what: str) -> None:
        env = make_envelope(payload, run_id=RUN, tenant_id=TENANT, event_id=derived_id(RUN, what),
                            producer=producer, recorded_at_ms=self._tick())
        now = self._tick()
        plan = fold(self.ledger, payload, event_id=env.event_id, tenant_id=TENANT, guard=self.guard, now_ms=now)
        self._write(plan.entries, env)

    def raw(self, payload: AvroRecord, producer: str, what: str) -> None:
        """Append a record the budget never decided on (what a forger or a bug would do)."""
        self._append(make_envelope(payload, run_id=RUN, tenant_id=TENANT, event_id=derived_id(RUN, what),
                                   producer=producer, recorded_at_ms=self._tick()))


def _model(step: int, k: int) -> ModelCallCompleted:
    return ModelCallCompleted(step=step, model=ModelRef(provider="openai", name="m", context_window_tokens=128_000),
                              usage=Usage(input_tokens=10, output_tokens=5, cost_usd_micros=3), assistant_text="",
                              tool_call_count=k, finish_reason="tool_calls" if k else "stop", latency_ms=1,
                              attempts=1, compacted=False)


def _call(step: int, index: int, tool: str, args: dict) -> tuple[ToolCallRequested, ToolCall]:
    args_json = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    call = ToolCall(call_id=f"{step}.{index}", call_index=index,
                    idem_key=hashlib.sha256(f"{RUN}\x1f{step}\x1f{index}".encode()).hexdigest(), tool_name=tool,
                    args_json=args_json, args_hash=hashlib.sha256(args_json.encode()).hexdigest(),
                    provider_call_id=f"p{step}{index}")
    return ToolCallRequested(step=step, call=call, provenance_json="{}"), call


def _completed(call: ToolCall, step: int, result: str = '{"ok":true}') -> ToolCallCompleted:
    return ToolCallCompleted(step=step, call_id=call.call_id, idem_key=call.idem_key, tool_name=call.tool_name,
                             result_json=result, untrusted=False, duration_ms=1, replayed=False)


def clean_run() -> Sequencer:
    s = Sequencer(_submit())
    s.intake(_model(1, 1), "planner", "m1")
    req, call = _call(1, 0, "kv_get", {"key": "k"})
    s.intake(req, "planner", "r1.0")
    s.intake(_completed(call, 1), "tool-gateway", "c1.0")
    s.intake(_model(2, 0), "planner", "m2")
    s.intake(RunCompleted(step=2, answer="done", usage=Usage(input_tokens=20, output_tokens=10, cost_usd_micros=6)),
             "planner", "done")
    return s


def _replace(log: list[Envelope], index: int, payload: AvroRecord, *, reseal: bool) -> list[Envelope]:
    out = list(log)
    out[index] = out[index].model_copy(update={"payload": encode(payload)})
    if reseal:
        for i in range(index, len(out)):
            out[i] = seal(out[i], out[i].seq, out[i - 1].hash if i else "0" * 64)
    return out


def test_a_clean_log_verifies():
    s = clean_run()
    report = verify_log(s.log)
    assert report.ok, render_text(report)
    assert (report.runs, report.events) == (1, len(s.log))
    assert [type(open_payload(e)).__name__ for e in s.log][:3] == ["RunAccepted", "StepGranted", "ModelCallCompleted"]


def test_a_run_asked_for_that_the_log_does_not_hold_is_a_mismatch():
    absent = "01HZZZZZZZZZZZZZZZZZZZZZZZ"
    report = verify_log([], run_ids={absent})
    assert not report.ok and report.absent_runs == [absent]
    assert [(f.check, f.run_id) for f in report.mismatches] == [("absent", absent)]
    assert report.to_json()["absent"] == [absent] and "MISMATCH absent" in render_text(report)
    # Asked for with a run that is there: only the missing one fails.
    both = verify_log(clean_run().log, run_ids={RUN, absent})
    assert both.runs == 1 and [(f.check, f.run_id) for f in both.mismatches] == [("absent", absent)]


def test_a_partition_whose_first_records_were_deleted_is_a_mismatch_even_with_no_run_left():
    report = verify_log([], deleted={1: 12})
    assert not report.ok and report.runs == 0
    assert [(f.check, f.event_type) for f in report.mismatches] == [("log", "RECORDS_DELETED")]
    assert "partition 1 of the run event log starts at offset 12" in report.mismatches[0].problem
    assert report.to_json()["deleted"] == [{"partition": 1, "log_start_offset": 12}]
    assert "MISMATCH log run= seq=None RECORDS_DELETED: partition 1" in render_text(report)


def test_a_run_without_a_terminal_event_is_reported_open_not_as_a_failure():
    log = clean_run().log
    assert verify_log(log).open_runs == [] and verify_log(log).to_json()["open"] == []
    # Cut after its last StepGranted: every decision still follows, so only the missing
    # terminal event shows; live or cut off, the log alone cannot tell (docs/audit.md).
    cut = max(i for i, e in enumerate(log) if e.event_type == StepGranted.AVRO_NAME) + 1
    report = verify_log(log[:cut])
    assert report.ok, render_text(report)
    assert report.open_runs == [RUN] and report.to_json()["open"] == [RUN]
    [note] = [f for f in report.findings if f.check == "note"]
    assert note.seq == log[cut - 1].seq and "no terminal event" in note.problem
    assert "1 open (no terminal event): OK" in render_text(report)


def test_a_changed_payload_without_a_new_chain_is_a_chain_problem():
    log = clean_run().log
    i = next(i for i, e in enumerate(log) if e.event_type == StepGranted.AVRO_NAME)
    granted = open_payload(log[i])
    forged = granted.model_copy(update={"remaining": granted.remaining.model_copy(update={"steps": 99})})
    report = verify_log(_replace(log, i, forged, reseal=False))
    kinds = {(f.check, f.event_type) for f in report.mismatches}
    assert ("chain", "HASH_MISMATCH") in kinds
    assert ("budget", StepGranted.AVRO_NAME) in kinds  # and the content does not follow either


def test_a_changed_decision_with_a_recomputed_chain_is_a_decision_mismatch():
    log = clean_run().log
    i = next(i for i, e in enumerate(log) if e.event_type == StepGranted.AVRO_NAME)
    granted = open_payload(log[i])
    forged = granted.model_copy(update={"remaining": granted.remaining.model_copy(update={"tokens": 10**9})})
    report = verify_log(_replace(log, i, forged, reseal=True))
    assert [f.check for f in report.mismatches] == ["budget"], render_text(report)
    assert "remaining" in report.mismatches[0].problem
    assert report.mismatches[0].seq == log[i].seq


def test_a_rewrite_with_a_recomputed_chain_passes_the_log_but_not_a_comparison_of_heads():
    # The chain is an unkeyed hash (docs/audit.md): a rewritten final answer with every later hash
    # recomputed changes no decision and passes. The heads the audit reports differ from the ones
    # kept elsewhere (here: the first audit's), which is how such a rewrite is caught.
    log = clean_run().log
    before = verify_log(log).to_json()["heads"]
    assert before == {RUN: {"seq": log[-1].seq, "hash": log[-1].hash}}
    i = next(i for i, e in enumerate(log) if e.event_type == "tether.v1.RunCompleted")
    done = open_payload(log[i])
    rewritten = verify_log(_replace(log, i, done.model_copy(update={"answer": "something else"}), reseal=True))
    assert rewritten.ok, render_text(rewritten)
    assert rewritten.to_json()["heads"][RUN]["hash"] != before[RUN]["hash"]


def test_a_run_whose_events_are_on_two_partitions_is_reported():
    log = clean_run().log
    one = RunLog(log, topic="t", deleted={}, partitions=[3] * len(log))
    assert verify_log(one).ok
    half = len(log) // 2
    split = verify_log(RunLog(log, topic="t", deleted={}, partitions=[3] * half + [4] * (len(log) - half)))
    assert [(f.check, f.run_id, f.event_type) for f in split.mismatches] == [("log", RUN, "SPLIT_PARTITIONS")]
    assert "[3, 4]" in split.mismatches[0].problem


def test_a_tool_call_budgeted_past_the_cap_is_reported():
    s = Sequencer(_submit(max_tool_calls=1))
    s.intake(_model(1, 2), "planner", "m1")
    req0, _ = _call(1, 0, "kv_get", {"key": "a"})
    req1, call1 = _call(1, 1, "kv_get", {"key": "b"})
    s.intake(req0, "planner", "r1.0")
    # The second call is past the cap: the budget would end the run; a forged log budgets it instead.
    s.raw(req1, "planner", "r1.1")
    s.raw(ToolCallBudgeted(step=1, call_id="1.1", idem_key=call1.idem_key,
                           remaining=open_payload(s.log[-2]).remaining), "budget", "forged-budget")
    report = verify_log(s.log)
    problems = [f.problem for f in report.mismatches if f.check == "budget"]
    assert any("RunTerminated" in p and "TOOL_CALL_CAP" in p for p in problems), render_text(report)
    assert not [f for f in report.mismatches if f.check == "chain"]


def test_a_send_email_executed_without_approval_is_reported():
    s = Sequencer(_submit())
    s.intake(_model(1, 1), "planner", "m1")
    req, call = _call(1, 0, "send_email", {"to": "x@evil.test", "subject": "s", "body": "b"})
    s.intake(req, "planner", "r1.0")
    s.intake(_completed(call, 1, '{"sent":true}'), "tool-gateway", "c1.0")
    report = verify_log(s.log, AuditConfig())
    gateway = [f for f in report.mismatches if f.check == "gateway"]
    assert gateway and "approval" in gateway[0].problem, render_text(report)
    assert gateway[0].event_type == ToolCallCompleted.AVRO_NAME


def _send_email_awaiting_approval(s: Sequencer, *, expires_at_ms: int) -> tuple[ToolCall, ApprovalRequested]:
    """Step 1 asks for send_email and the gateway asks a human (apr_1), appended as recorded."""
    s.intake(_model(1, 1), "planner", "m1")
    req, call = _call(1, 0, "send_email", {"to": "x@evil.test", "subject": "s", "body": "b"})
    s.intake(req, "planner", "r1.0")
    requested = ApprovalRequested(approval_id="apr_1", step=1, call_id=call.call_id, idem_key=call.idem_key,
                                  tool_name="send_email", args_json=call.args_json, args_hash=call.args_hash,
                                  reasons=["RISK_CLASS"], risk_class=TOOLS[NAMES.index("send_email")].risk_class,
                                  expires_at_ms=expires_at_ms, policy_version="x", inputs_hash="0" * 64,
                                  provenance_json="{}")
    s.raw(requested, "tool-gateway", "a1")
    return call, requested


def test_an_approval_decision_that_does_not_follow_is_reported():
    s = Sequencer(_submit())
    call, _ = _send_email_awaiting_approval(s, expires_at_ms=T0 + 10)
    # Approved after its expiry, by the run's own submitter, for other arguments.
    s.raw(ApprovalDecided(approval_id="apr_1", call_id=call.call_id, args_hash="f" * 64,
                          outcome=ApprovalOutcome.APPROVED, approver_id="alice", comment="",
                          decided_at_ms=T0 + 10_000), "approval", "d1")
    problems = [f.problem for f in verify_log(s.log).mismatches if f.check == "approval"]
    assert any("after its expiry" in p for p in problems)
    assert any("who submitted the run" in p for p in problems)
    assert any("the request is for call" in p for p in problems)


def _refusal(call: ToolCall, *, decided_at_ms: int, expires_at_ms: int, reason: str = "DECISION_AFTER_EXPIRY",
             ) -> ApprovalDecisionRefused:
    return ApprovalDecisionRefused(approval_id="apr_1", call_id=call.call_id, approver_id="bob", approve=True,
                                   reason=reason, decided_at_ms=decided_at_ms, expires_at_ms=expires_at_ms)


def test_a_decision_refused_after_its_approval_expired_follows_and_one_that_does_not_is_reported():
    s = Sequencer(_submit())
    call, requested = _send_email_awaiting_approval(s, expires_at_ms=T0 + 10_000)
    expired = ApprovalDecided(approval_id="apr_1", call_id=call.call_id, args_hash=call.args_hash,
                              outcome=ApprovalOutcome.EXPIRED, approver_id="system", decided_at_ms=T0 + 40_001)
    # Refused before any EXPIRED is on the log: the approval service refuses only after the expiry decided.
    s.raw(_refusal(call, decided_at_ms=T0 + 9_000, expires_at_ms=requested.expires_at_ms), "approval", "early")
    s.raw(expired, "approval", "d1")
    s.raw(_refusal(call, decided_at_ms=T0 + 9_000, expires_at_ms=requested.expires_at_ms), "approval", "ok")
    s.raw(_refusal(call, decided_at_ms=T0 + 11_000, expires_at_ms=T0 + 12_000), "approval", "late")
    s.raw(_refusal(call, decided_at_ms=T0 + 9_000, expires_at_ms=requested.expires_at_ms,
                   reason="APPROVAL_NOT_PENDING"), "approval", "other")
    found = [(f.seq, f.problem) for f in verify_log(s.log).mismatches if f.check == "approval"]
    seqs = {e.event_id: e.seq for e in s.log}
    assert [seq for seq, _ in found] == [seqs[derived_id(RUN, "early")], seqs[derived_id(RUN, "late")],
                                         seqs[derived_id(RUN, "other")]], found
    assert "had not EXPIRED before it" in found[0][1]
    assert "not a decision recorded in time" in found[1][1]
    assert "only DECISION_AFTER_EXPIRY is recorded" in found[2][1]


def _authorized(s: Sequencer, call: ToolCall, step: int, *, forge: list[str] | None = None) -> ToolCallAuthorized:
    """The gateway's ToolCallAuthorized for `call`, decided as the gateway decides it: the default
    policy over the run's recorded inputs at its ToolCallBudgeted (the last event in the log).
    `forge`: reasons for a call the policy does not allow (what a faulty gateway would record)."""
    budgeted = s.log[-1]
    assert budgeted.event_type == ToolCallBudgeted.AVRO_NAME
    tool = next(t for t in TOOLS if t.name == call.tool_name)
    policy = TrustPolicy(default_policy())
    decision = policy.decide_call(CallDecisionInputs(
        tool_name=call.tool_name, args_json=call.args_json, args_hash=call.args_hash, tool=tool,
        tenant_grants=NAMES, agent_allowlist=NAMES, recorded_at_ms=budgeted.recorded_at_ms, tenant_id=TENANT,
        agent_id="a", principal_id="alice"))
    assert isinstance(decision.verdict, Allow) == (forge is None), decision.verdict
    return ToolCallAuthorized(step=step, call_id=call.call_id, idem_key=call.idem_key, tool_name=call.tool_name,
                              tool_version=tool.version, args_hash=call.args_hash, risk_class=tool.risk_class,
                              reasons=list(decision.verdict.reasons) if forge is None else forge,
                              policy_version=decision.policy_version, inputs_hash=decision.inputs_hash)


def test_an_allowed_call_is_checked_by_its_authorization_and_a_forged_one_is_reported():
    s = Sequencer(_submit())
    s.intake(_model(1, 2), "planner", "m1")
    get_req, get_call = _call(1, 0, "kv_get", {"key": "k"})
    s.intake(get_req, "planner", "r1.0")
    s.intake(_authorized(s, get_call, 1), "tool-gateway", "a1.0")
    s.intake(_completed(get_call, 1), "tool-gateway", "c1.0")
    mail_req, mail_call = _call(1, 1, "send_email", {"to": "x@evil.test", "subject": "s", "body": "b"})
    s.intake(mail_req, "planner", "r1.1")
    # A gateway that lets send_email run without a human records an authorization the policy does not give.
    s.intake(_authorized(s, mail_call, 1, forge=["GRANTED", "ARGS_VALID", "RISK_CLASS_WAIVED"]),
             "tool-gateway", "a1.1")
    s.intake(_completed(mail_call, 1, '{"sent":true}'), "tool-gateway", "c1.1")
    report = verify_log(s.log)
    assert [(f.check, f.event_type) for f in report.mismatches] == [("gateway", ToolCallAuthorized.AVRO_NAME)], \
        render_text(report)
    assert "1.1: the policy says approval ['RISK_CLASS'], not allow" in report.mismatches[0].problem
    kinds = [e.event_type.rsplit(".", 1)[-1] for e in s.log]
    assert kinds[kinds.index("ToolCallBudgeted"):][:3] == ["ToolCallBudgeted", "ToolCallAuthorized",
                                                           "ToolCallCompleted"]


# -- the CLI over a real Kafka topic --------------------------------------------------------------



def _publish(bootstrap: str, topic: str, log: list[Envelope], codec: EnvelopeCodec | None = None) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for env in log:
        value = codec.encode_value(env, topic) if codec else encode(env)
        producer.produce(topic, key=env.run_id.encode(), value=value, partition=1, headers=headers_for(env))
    assert producer.flush(30) == 0


def _unapproved_email_run(run_id: str) -> list[Envelope]:
    """A run whose send_email ran without approval, sealed on a chain of its own under `run_id`."""
    bad = Sequencer(_submit())
    bad.intake(_model(1, 1), "planner", "m1")
    req, call = _call(1, 0, "send_email", {"to": "x@evil.test", "subject": "s", "body": "b"})
    bad.intake(req, "planner", "r1.0")
    bad.intake(_completed(call, 1, '{"sent":true}'), "tool-gateway", "c1.0")
    forged: list[Envelope] = []
    for e in bad.log:
        forged.append(seal(e.model_copy(update={"run_id": run_id}), e.seq, forged[-1].hash if forged else "0" * 64))
    return forged


@pytest.mark.parametrize("content", [None, "{not json", '{"version": 3}'], ids=["missing", "not-json", "invalid"])
def test_cli_a_bad_policy_file_is_a_documented_error_not_a_traceback(tmp_path, content):
    path = tmp_path / "policy.json"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", "127.0.0.1:1",
                                          "--policy-file", str(path), "--json"])
    # The policy is read before the log: no broker needed. CliError is what `tether` turns into the exit code.
    assert isinstance(result.exception, CliError) and result.exception.exit_code == 2, result.output
    error = json.loads(result.stdout)
    assert error["ok"] is False and error["error"]["reason"] == "BAD_POLICY_FILE"
    assert str(path) in error["error"]["message"] or "policy" in error["error"]["message"]


@pytest.mark.integration
def test_cli_reads_the_log_from_kafka_and_exits_non_zero_on_a_mismatch(kafka_bootstrap):
    prefix = f"audit-{uuid.uuid4().hex[:10]}."
    topic = prefix + "tether.run-events.v1"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(30)
    try:
        clean = clean_run().log
        _publish(kafka_bootstrap, topic, clean)
        ok = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", kafka_bootstrap,
                                          "--topic-prefix", prefix, "--json"])
        assert ok.exit_code == 0, ok.output
        report = json.loads(ok.stdout)
        assert report["ok"] is True and report["events"] == len(clean) and report["runs"] == 1

        # A second run whose send_email ran without approval: the audit fails and names it.
        _publish(kafka_bootstrap, topic, _unapproved_email_run("run-audit-2"))
        failed = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", kafka_bootstrap,
                                              "--topic-prefix", prefix])
        assert failed.exit_code == 3, failed.output
        assert "MISMATCH gateway run=run-audit-2" in failed.stdout
        only_clean = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", kafka_bootstrap,
                                                  "--topic-prefix", prefix, "--run", RUN])
        assert only_clean.exit_code == 0, only_clean.output
        # A run id the log does not hold (a typo, a deleted run) fails, machine-readably.
        typo = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", kafka_bootstrap,
                                            "--topic-prefix", prefix, "--run", RUN, "--run", "run-audit-9", "--json"])
        assert typo.exit_code == 3, typo.output
        report = json.loads(typo.stdout)
        assert report["ok"] is False and report["absent"] == ["run-audit-9"] and report["runs"] == 1
        assert [(m["check"], m["run_id"]) for m in report["mismatches"]] == [("absent", "run-audit-9")]
        assert report["deleted"] == []
    finally:
        admin.delete_topics([topic])


@pytest.mark.integration
def test_cli_reports_a_partition_whose_first_records_were_deleted(kafka_bootstrap):
    prefix = f"audit-{uuid.uuid4().hex[:10]}."
    topic = prefix + "tether.run-events.v1"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(30)
    verify = ["audit", "verify", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix, "--json"]
    try:
        clean = clean_run().log
        _publish(kafka_bootstrap, topic, clean)  # partition 1
        (fut,) = admin.delete_records([TopicPartition(topic, 1, 3)]).values()
        assert fut.result(30).low_watermark == 3

        # The head of the run is gone: read from offset 3 (not skipped to the end), a chain GAP,
        # and the deletion itself named.
        out = CliRunner().invoke(cli.app, verify)
        assert out.exit_code == 3, out.output
        report = json.loads(out.stdout)
        assert report["events"] == len(clean) - 3 and report["deleted"] == [{"partition": 1, "log_start_offset": 3}]
        found = {(m["check"], m["event_type"]) for m in report["mismatches"]}
        assert {("log", "RECORDS_DELETED"), ("chain", "GAP")} <= found

        # Every event of the run gone: no run left to check, and still not "0 runs: OK".
        (fut,) = admin.delete_records([TopicPartition(topic, 1, len(clean))]).values()
        fut.result(30)
        out = CliRunner().invoke(cli.app, verify)
        assert out.exit_code == 3, out.output
        report = json.loads(out.stdout)
        assert report["runs"] == 0 and report["deleted"] == [{"partition": 1, "log_start_offset": len(clean)}]
        assert [(m["check"], m["event_type"]) for m in report["mismatches"]] == [("log", "RECORDS_DELETED")]
    finally:
        admin.delete_topics([topic])


@pytest.mark.integration
def test_cli_verifies_a_log_the_services_wrote_in_the_registry_wire_format(kafka_bootstrap, schema_registry):
    # With TETHER_SCHEMA_REGISTRY_URL set the services write Confluent-framed values (docs/serde.md).
    # This log switched formats mid-run, as one does when a deployment turns the registry on.
    url, state = schema_registry
    prefix = f"audit-{uuid.uuid4().hex[:10]}."
    topic = prefix + "tether.run-events.v1"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(30)
    verify = ["audit", "verify", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix]
    try:
        clean = clean_run().log
        half = len(clean) // 2
        registry_codec = RegistryCodec(SchemaRegistryClient(url))
        _publish(kafka_bootstrap, topic, clean[:half])
        forged = _unapproved_email_run("run-audit-2")
        _publish(kafka_bootstrap, topic, clean[half:] + forged, registry_codec)
        assert state.subjects[value_subject(topic)], "the values were not registry-framed"

        report = CliRunner().invoke(cli.app, [*verify, "--schema-registry-url", url, "--json"])
        assert report.exit_code == 3, report.output
        found = json.loads(report.stdout)
        assert found["events"] == len(clean) + len(forged) and found["runs"] == 2
        assert {f["run_id"] for f in found["mismatches"]} == {"run-audit-2"}
        assert "gateway" in {f["check"] for f in found["mismatches"]}
        clean_only = CliRunner().invoke(cli.app, [*verify, "--run", RUN],
                                        env={"TETHER_SCHEMA_REGISTRY_URL": url})
        assert clean_only.exit_code == 0, clean_only.output

        # Without the registry the framed records cannot be read: exit 4, saying what is missing.
        unreadable = CliRunner().invoke(cli.app, verify, env={"TETHER_SCHEMA_REGISTRY_URL": None})
        assert isinstance(unreadable.exception, CliError), unreadable.output
        assert unreadable.exception.exit_code == EXIT_UNREADABLE
        assert "UNKNOWN_SCHEMA_ID" in str(unreadable.exception) and "schema registry URL" in str(unreadable.exception)
    finally:
        admin.delete_topics([topic])


# -- the budget's clock, malformed records and envelope labels ---------------------------------------


def _resealed(log: list[Envelope]) -> list[Envelope]:
    out = list(log)
    for i in range(len(out)):
        out[i] = seal(out[i], out[i].seq, out[i - 1].hash if i else "0" * 64)
    return out


def test_a_wall_clock_stop_after_a_wait_for_a_human_is_followed_not_reported():
    # The budget read the ApprovalRequested 3 s after it was recorded, so the human wait it measured
    # (and the deadline) differ from what the records' own times give; its timer ended the run, and
    # the running call's late result is appended after the end.
    from tether_budget.domain.decisions import Retention, tick
    from tether_contracts.records import ApprovalDecided, ApprovalOutcome, ApprovalRequested
    from tether_tool_gateway.audit import GatewayAudit
    from tether_tool_gateway.domain.policy import approval_id_for
    from tether_tool_gateway.domain.policy_document import default_policies

    class Timed(Sequencer):
        def at(self, payload: AvroRecord, producer: str, what: str, recorded: int, now: int) -> None:
            env = make_envelope(payload, run_id=RUN, tenant_id=TENANT, event_id=derived_id(RUN, what),
                                producer=producer, recorded_at_ms=recorded)
            self.clock = now
            plan = fold(self.ledger, payload, event_id=env.event_id, tenant_id=TENANT, guard=self.guard, now_ms=now)
            self._write(plan.entries, env)

    submit = _submit()
    s = Timed(submit.model_copy(update={"caps": submit.caps.model_copy(update={"max_wall_clock_ms": 10_000})}))
    a = s.ledger.accepted_at_ms
    s.at(_model(1, 1), "planner", "m1", a + 10, a + 10)
    req, call = _call(1, 0, "send_email", {"to": "x@y.test", "subject": "s", "body": "b"})
    s.at(req, "planner", "r1.0", a + 20, a + 20)
    policies, allow_version = AuditConfig().policies()
    gateway = GatewayAudit(policies, allow_version=allow_version)
    gateway.check([(e, open_payload(e)) for e in s.log])
    version = default_policies()[0].policy_version
    decision = policies[version].decide_call(gateway._calls[call.call_id].inputs)
    asked = ApprovalRequested(
        approval_id=approval_id_for(RUN, call.idem_key, call.args_hash), step=1, call_id=call.call_id,
        idem_key=call.idem_key, tool_name="send_email", args_json=call.args_json, args_hash=call.args_hash,
        risk_class=TOOLS[NAMES.index("send_email")].risk_class, reasons=list(decision.verdict.reasons),
        provenance_json=gateway._calls[call.call_id].provenance_json, expires_at_ms=decision.verdict.expires_at_ms,
        policy_version=version, inputs_hash=decision.inputs_hash)
    s.at(asked, "tool-gateway", "a1", a + 30, a + 3_000)
    s.at(ApprovalDecided(approval_id=asked.approval_id, call_id=call.call_id, args_hash=call.args_hash,
                         outcome=ApprovalOutcome.APPROVED, approver_id="bob", comment="", decided_at_ms=a + 4_000),
         "approval", "d1", a + 4_000, a + 4_000)
    s.clock = a + 11_000
    s._write(tick(s.ledger, now_ms=a + 11_000, retention=Retention()).plan.entries, None)
    s.at(_completed(call, 1, '{"sent":true}'), "tool-gateway", "c1.0", a + 12_000, a + 12_000)
    assert [e.event_type.rsplit(".", 1)[1] for e in s.log][-2:] == ["RunTerminated", "ToolCallCompleted"]
    report = verify_log(s.log)
    assert report.ok, render_text(report)
    assert any(f.check == "note" and "waiting for humans" in f.problem for f in report.findings)


def test_a_run_id_the_budget_refuses_is_a_finding_not_a_crash():
    log = _resealed([e.model_copy(update={"run_id": "a:b"}) for e in clean_run().log])
    report = verify_log(log)
    assert not report.ok
    assert any(f.check == "budget" and "BAD_RUN_ID" in f.problem for f in report.mismatches), render_text(report)


def test_a_cancel_by_another_tenant_is_a_finding_not_a_crash():
    from tether_budget.domain.decisions import cancel
    from tether_contracts.records import CancelRun

    s = Sequencer(_submit())
    s.intake(_model(1, 1), "planner", "m1")
    s._write(cancel(s.ledger, CancelRun(principal_id="alice", reason="stop"), tenant_id=TENANT,
                    now_ms=s._tick()).entries, None)
    assert verify_log(s.log).ok
    log = list(s.log)
    log[-1] = log[-1].model_copy(update={"tenant_id": "t2"})
    report = verify_log(_resealed(log))
    assert [f.check for f in report.mismatches] == ["budget"], render_text(report)
    assert "CANCEL_FORBIDDEN" in report.mismatches[0].problem


def test_an_envelope_labelled_with_another_event_type_than_its_payload_is_a_type_mismatch():
    log = clean_run().log
    j = next(i for i, e in enumerate(log) if e.event_type.endswith("ModelCallCompleted"))
    relabeled = list(log)
    relabeled[j] = relabeled[j].model_copy(update={"event_type": "tether.v1.RunCompleted"})
    report = verify_log(_resealed(relabeled))
    assert [(f.check, f.event_type) for f in report.mismatches] == [("log", "TYPE_MISMATCH")], render_text(report)
