"""The chaos invariant checker on hand-built evidence: a clean run passes, and each kind of violation is counted."""

from __future__ import annotations

import hashlib
from collections import defaultdict

import pytest
from confluent_kafka import Producer

from tether_bench.invariants import Evidence, Fault, check, violated
from tether_bench.observer import LogObserver
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalOutcome,
    ApprovalRequested,
    Envelope,
    ModelCallCompleted,
    ModelRef,
    Remaining,
    RiskClass,
    StepGranted,
    ToolCall,
    ToolCallBudgeted,
    ToolCallCompleted,
    ToolCallOutcomeUnknown,
    ToolCallRequested,
    Usage,
)
from tether_messaging.chain import GENESIS_HASH, seal
from tether_messaging.envelopes import derived_id, make_envelope
from tether_messaging.logreader import read_to_end
from tether_messaging.registry import RegistryCodec, SchemaRegistryClient, value_subject

REMAINING = Remaining(steps=5, tokens=1000, cost_usd_micros=1000, wall_clock_ms=60_000)


def idem(run: str, step: int, index: int) -> str:
    return hashlib.sha256(f"{run}\x1f{step}\x1f{index}".encode()).hexdigest()


class Log:
    """Builds a sealed run event log event by event (seq, prev_hash, hash as budget would)."""

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []
        self._seq: dict[str, int] = defaultdict(int)
        self._last: dict[str, str] = defaultdict(lambda: GENESIS_HASH)
        self.clock = 1_000

    def add(self, run: str, payload: AvroRecord | str, *, producer: str = "budget") -> Envelope:
        self.clock += 10
        what = f"{type(payload).__name__}:{len(self.envelopes)}"
        if isinstance(payload, str):  # an event the checker only looks at by type
            env = Envelope(event_id=derived_id(run, what), tenant_id="t0", run_id=run, event_type=payload,
                           schema_fingerprint="00" * 8, payload=b"", recorded_at_ms=self.clock, producer=producer)
        else:
            env = make_envelope(payload, run_id=run, tenant_id="t0", event_id=derived_id(run, what),
                                producer=producer, recorded_at_ms=self.clock)
        sealed = seal(env, self._seq[run] + 1, self._last[run])
        self._seq[run] += 1
        self._last[run] = sealed.hash or ""
        self.envelopes.append(sealed)
        return sealed

    def step_with_tool(self, run: str, step: int, tool: str) -> str:
        key = idem(run, step, 0)
        self.add(run, StepGranted(step=step, remaining=REMAINING))
        self.add(run, ModelCallCompleted(step=step, model=ModelRef(provider="openai", name="m"), usage=Usage(),
                                         tool_call_count=1, finish_reason="tool_calls", latency_ms=1),
                 producer="planner")
        call = ToolCall(call_id=f"{step}.0", call_index=0, idem_key=key, tool_name=tool, args_json="{}",
                        args_hash="h")
        self.add(run, ToolCallRequested(step=step, call=call), producer="planner")
        self.add(run, ToolCallBudgeted(step=step, call_id=f"{step}.0", idem_key=key, remaining=REMAINING))
        return key

    def approval(self, run: str, step: int, key: str, outcome: ApprovalOutcome) -> None:
        approval_id = f"apr_{key[:8]}"
        self.add(run, ApprovalRequested(approval_id=approval_id, step=step, call_id=f"{step}.0", idem_key=key,
                                        tool_name="send_email", args_json="{}", args_hash="h",
                                        risk_class=RiskClass.IRREVERSIBLE, reasons=["RISK_CLASS"], expires_at_ms=9,
                                        policy_version="p", inputs_hash="i"), producer="tool-gateway")
        self.add(run, ApprovalDecided(approval_id=approval_id, call_id=f"{step}.0", args_hash="h", outcome=outcome,
                                      approver_id="a", decided_at_ms=self.clock), producer="approval")

    def completed(self, run: str, step: int, key: str, tool: str) -> None:
        self.add(run, ToolCallCompleted(step=step, call_id=f"{step}.0", idem_key=key, tool_name=tool,
                                        result_json="{}", duration_ms=1), producer="tool-gateway")


def clean_run(log: Log, run: str) -> tuple[str, str]:
    """kv_put in step 1, an approved send_email in step 2, an answer in step 3."""
    log.add(run, "tether.v1.RunAccepted")
    put = log.step_with_tool(run, 1, "kv_put")
    log.completed(run, 1, put, "kv_put")
    mail = log.step_with_tool(run, 2, "send_email")
    log.approval(run, 2, mail, ApprovalOutcome.APPROVED)
    log.completed(run, 2, mail, "send_email")
    log.add(run, StepGranted(step=3, remaining=REMAINING))
    log.add(run, "tether.v1.RunCompleted", producer="planner")
    return put, mail


def model_answer(run: str, step: int, ts: float) -> dict:
    return {"status": 200, "ts_ms": ts, "headers": {"x-tether-run": run, "x-tether-step": str(step),
                                                    "x-tether-call": "0"}}


def evidence_for_clean_runs(runs: list[str]) -> Evidence:
    log = Log()
    kv, smtp, models = [], [], []
    for run in runs:
        put, mail = clean_run(log, run)
        kv.append({"op": "put", "idempotency_key": put, "applied": True, "ts_ms": 100})
        # sent once the approval was decided, before the gateway recorded the outcome
        decided = next(e for e in reversed(log.envelopes) if e.event_type == "tether.v1.ApprovalDecided")
        smtp.append({"idempotency_key": mail, "ts_ms": decided.recorded_at_ms + 1})
        models += [model_answer(run, s, 50 * s) for s in (1, 2, 3)]
    return Evidence(submitted={r: "t0" for r in runs}, log=log.envelopes, kv_records=kv, smtp_records=smtp,
                    model_requests=models)


def test_clean_runs_violate_nothing() -> None:
    report = check(evidence_for_clean_runs(["r1", "r2"]))
    assert violated(report) == []
    assert report["runs"] == 2
    assert report["info"]["completed"] == 2


def test_a_run_never_accepted_is_lost_and_one_never_ended_is_stuck_unless_a_human_owes_a_decision() -> None:
    ev = evidence_for_clean_runs(["r1"])
    log = Log()
    log.envelopes = list(ev.log)
    log.add("r2", "tether.v1.RunAccepted")
    log.step_with_tool("r2", 1, "kv_put")  # budgeted, never finished
    log.add("r3", "tether.v1.RunAccepted")
    mail = log.step_with_tool("r3", 1, "send_email")
    log.add("r3", ApprovalRequested(approval_id="apr_x", step=1, call_id="1.0", idem_key=mail, tool_name="send_email",
                                    args_json="{}", args_hash="h", risk_class=RiskClass.IRREVERSIBLE,
                                    reasons=["RISK_CLASS"], expires_at_ms=9, policy_version="p", inputs_hash="i"))
    ev.log = log.envelopes
    ev.submitted = {"r1": "t0", "r2": "t0", "r3": "t0", "r4": "t0"}
    report = check(ev)
    assert report["lost_runs"] == 1  # r4
    assert report["stuck_runs"] == 1  # r2; r3 waits for a human
    assert report["info"]["waiting_on_human"] == 1


def test_an_effect_applied_twice_is_a_duplicate_and_an_email_sent_twice_is_also_silent() -> None:
    ev = evidence_for_clean_runs(["r1"])
    put = ev.kv_records[0]["idempotency_key"]
    mail = ev.smtp_records[0]["idempotency_key"]
    ev.kv_records = [*ev.kv_records, {"op": "put", "idempotency_key": put, "applied": True, "ts_ms": 150}]
    ev.smtp_records = [*ev.smtp_records, {"idempotency_key": mail, "ts_ms": ev.smtp_records[0]["ts_ms"] + 2}]
    report = check(ev)
    assert report["duplicate_effects"] == 2
    # The kv write ran twice with no fault between: silent; the email ran twice with no OutcomeUnknown: silent.
    assert report["silent_reexecutions"] == 2


def test_an_idempotent_rerun_across_a_gateway_crash_is_not_silent_and_a_deduplicated_attempt_is_no_duplicate() -> None:
    ev = evidence_for_clean_runs(["r1"])
    put = ev.kv_records[0]["idempotency_key"]
    ev.kv_records = [*ev.kv_records, {"op": "put", "idempotency_key": put, "applied": False, "duplicate": True,
                                      "ts_ms": 180}]
    ev.faults = [Fault("tool-gateway#1", 120, 170)]
    report = check(ev)
    assert violated(report) == []
    ev.faults = [Fault("planner", 120, 170)]  # a planner crash does not explain a second tool execution
    assert check(ev)["silent_reexecutions"] == 1


def test_more_sink_attempts_than_the_ledger_granted_are_silent() -> None:
    ev = evidence_for_clean_runs(["r1"])
    put = ev.kv_records[0]["idempotency_key"]
    ev.kv_records = [*ev.kv_records, {"op": "put", "idempotency_key": put, "applied": False, "ts_ms": 180}]
    ev.faults = [Fault("tool-gateway", 120, 170)]
    ev.ledger_attempts = {put: 1}
    assert check(ev)["silent_reexecutions"] == 1


def test_an_effect_no_budgeted_call_names_is_silent_and_an_unapproved_email_is_counted() -> None:
    ev = evidence_for_clean_runs(["r1"])
    ev.kv_records = [*ev.kv_records, {"op": "put", "idempotency_key": "f" * 64, "applied": True, "ts_ms": 1}]
    log = Log()
    log.add("r9", "tether.v1.RunAccepted")
    mail = log.step_with_tool("r9", 1, "send_email")
    log.completed("r9", 1, mail, "send_email")
    log.add("r9", "tether.v1.RunTerminated")
    ev.log = [*ev.log, *log.envelopes]
    ev.submitted = {**ev.submitted, "r9": "t0"}
    ev.smtp_records = [*ev.smtp_records, {"idempotency_key": mail, "ts_ms": 5}]
    report = check(ev)
    assert report["silent_reexecutions"] == 1
    assert report["unapproved_effects"] == 1


def test_a_broken_chain_is_counted() -> None:
    ev = evidence_for_clean_runs(["r1"])
    log = list(ev.log)
    del log[3]  # a gap
    ev.log = log
    assert check(ev)["seq_gaps"] >= 1


def test_a_model_call_repeated_without_a_crash_or_after_its_step_was_logged_is_a_duplicate() -> None:
    ev = evidence_for_clean_runs(["r1"])
    models = list(ev.model_requests)
    # step 1 answered again at 60 (its ModelCallCompleted is recorded at ~1020 in this log: not yet logged).
    models.append(model_answer("r1", 1, 60))
    ev.model_requests = models
    assert check(ev)["duplicate_model_calls"] == 1
    ev.faults = [Fault("planner#1", 52, 58)]
    report = check(ev)
    assert report["duplicate_model_calls"] == 0
    assert report["info"]["model_calls_redone_after_a_crash"] == 1
    # Asked again after the step's ModelCallCompleted was in the log: a duplicate whatever crashed.
    models.append(model_answer("r1", 2, 5_000))
    ev.faults = [Fault("planner#1", 52, 58), Fault("planner", 100, 4_999)]
    assert check(ev)["duplicate_model_calls"] == 1


def test_two_outcomes_for_one_call_are_counted() -> None:
    ev = evidence_for_clean_runs(["r1"])
    log = Log()
    log.add("r2", "tether.v1.RunAccepted")
    key = log.step_with_tool("r2", 1, "kv_get")
    log.completed("r2", 1, key, "kv_get")
    log.add("r2", ToolCallOutcomeUnknown(step=1, call_id="1.0", idem_key=key, tool_name="kv_get", detail="x"))
    log.completed("r2", 1, key, "kv_get")
    log.add("r2", "tether.v1.RunCompleted")
    ev.log = [*ev.log, *log.envelopes]
    ev.submitted = {**ev.submitted, "r2": "t0"}
    assert check(ev)["duplicate_outcomes"] == 1


@pytest.mark.integration
def test_the_checker_and_the_observer_read_a_log_in_the_registry_wire_format(kafka_bootstrap, kafka_topics,
                                                                             schema_registry) -> None:
    # With TETHER_SCHEMA_REGISTRY_URL set the services write Confluent-framed values; make chaos reads
    # the log with read_to_end and follows it with LogObserver, both given the registry.
    url, state = schema_registry
    topic = kafka_topics.create("chaos-registry", partitions=2)
    ev = evidence_for_clean_runs(["r1", "r2"])
    codec = RegistryCodec(SchemaRegistryClient(url))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for env in ev.log:
        producer.produce(topic, codec.encode_value(env, topic), env.run_id.encode(), partition=int(env.run_id[1:]) - 1)
    assert producer.flush(30) == 0
    assert state.subjects[value_subject(topic)]

    read = [entry.envelope for entry in read_to_end(kafka_bootstrap, topic, schema_registry_url=url, timeout_s=60)]
    assert sorted(read, key=lambda e: (e.run_id, e.seq)) == sorted(ev.log, key=lambda e: (e.run_id, e.seq))
    ev.log = read
    report = check(ev)
    assert violated(report) == [] and report["runs"] == 2

    observer = LogObserver(kafka_bootstrap, topic, 2, schema_registry_url=url).start()
    try:
        assert observer.wait_count(lambda: observer.events_seen == len(read), timeout_s=30), observer.errors
        assert set(observer.terminal) == {"r1", "r2"}
    finally:
        observer.stop()


def test_an_approval_left_open_counts_as_stuck_when_the_approver_bot_serves_the_tenant() -> None:
    ev = evidence_for_clean_runs(["r1"])
    log = Log()
    log.envelopes = list(ev.log)
    log.add("r2", "tether.v1.RunAccepted")
    mail = log.step_with_tool("r2", 1, "send_email")
    log.add("r2", ApprovalRequested(approval_id="apr_x", step=1, call_id="1.0", idem_key=mail, tool_name="send_email",
                                    args_json="{}", args_hash="h", risk_class=RiskClass.IRREVERSIBLE,
                                    reasons=["RISK_CLASS"], expires_at_ms=9, policy_version="p", inputs_hash="i"))
    ev.log = log.envelopes
    ev.submitted = {"r1": "t0", "r2": "t0"}
    assert check(ev)["stuck_runs"] == 0  # no bot: a human may still decide
    # The bot decides every approval of t0 (and said it approved this one): the decision was lost.
    ev.approver_tenants = frozenset({"t0"})
    ev.bot_decisions = {"apr_x": "APPROVED"}
    report = check(ev)
    assert report["stuck_runs"] == 1 and report["info"]["waiting_on_human"] == 0
    assert "bot APPROVED" in report["details"]["stuck_runs"][0]
    ev.approver_tenants = frozenset({"t1"})  # another tenant's bot: still a human's to decide
    assert check(ev)["stuck_runs"] == 0


def test_an_email_sent_before_its_approval_could_have_been_granted_is_unapproved() -> None:
    ev = evidence_for_clean_runs(["r1"])
    mail = ev.smtp_records[0]["idempotency_key"]
    sent = ev.smtp_records[0]["ts_ms"]
    approval = f"apr_{mail[:8]}"
    assert check(ev)["unapproved_effects"] == 0
    # The bot's Decide call began after the sink had the email: it cannot have been approved then.
    ev.approval_asked_ms = {approval: sent + 0.4 + 50}
    report = check(ev)
    assert report["unapproved_effects"] == 1
    assert "before the bot first asked" in report["details"]["unapproved_effects"][0]
    # Asked within the same millisecond (the sink stamps whole ms): not a violation.
    ev.approval_asked_ms = {approval: sent + 0.9}
    assert check(ev)["unapproved_effects"] == 0
    # Without the bot's record, the decision's decided_at_ms is the bound.
    ev.approval_asked_ms = {}
    ev.smtp_records = [{"idempotency_key": mail, "ts_ms": 1_000}]  # before the log's decision (~1110)
    assert check(ev)["unapproved_effects"] == 1


def test_a_tool_executed_after_its_outcome_was_committed_is_silent_whatever_faults_happened() -> None:
    ev = evidence_for_clean_runs(["r1"])
    put = ev.kv_records[0]["idempotency_key"]
    done = next(e for e in ev.log if e.event_type == "tether.v1.ToolCallCompleted")
    ev.kv_records = [*ev.kv_records, {"op": "put", "idempotency_key": put, "applied": False, "duplicate": True,
                                      "ts_ms": 9_000}]
    ev.faults = [Fault("kafka", 5_000, 6_000), Fault("tool-gateway", 100, 9_500)]
    ev.ledger_attempts = {put: 2}
    report = check(ev)
    assert report["silent_reexecutions"] == 1
    assert "after its outcome was committed" in report["details"]["silent_reexecutions"][0]
    # Before its outcome was read by the observer (so maybe not committed yet), a fault excuses it.
    ev.seen_at_ms = {(done.run_id, done.seq): 9_001}
    assert check(ev)["silent_reexecutions"] == 0
    # An attempt counted by two rules (after the commit, and no fault between) is counted once.
    ev.seen_at_ms, ev.faults = {}, []
    assert check(ev)["silent_reexecutions"] == 1


def test_runs_in_the_log_without_a_client_are_counted_and_checked_but_never_lost() -> None:
    ev = evidence_for_clean_runs(["r1"])
    log = Log()
    log.clock = 50_000
    log.add("r-orphan", "tether.v1.RunAccepted")
    log.step_with_tool("r-orphan", 1, "kv_put")  # and nothing more
    ev.log = [*ev.log, *log.envelopes]
    ev.model_requests = [*ev.model_requests, model_answer("r-orphan", 1, 50_010), model_answer("r-orphan", 1, 50_020)]
    report = check(ev)
    assert report["runs"] == 2 and report["info"]["submitted"] == 1
    assert report["info"]["runs_without_a_client"] == 1
    assert report["lost_runs"] == 0
    assert report["stuck_runs"] == 1
    assert report["duplicate_model_calls"] == 1
