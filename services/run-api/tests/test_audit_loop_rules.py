"""`tether audit verify` replays each run's loop warnings and stops under the loop guard rules version its RunAccepted names."""

from __future__ import annotations

import hashlib
import io
import json
import uuid

import fastavro
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from typer.testing import CliRunner

from tether_budget.domain.decisions import AdmissionPolicy, Decide, admit, fold
from tether_budget.domain.loopguard import LoopGuard
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    AgentSpec,
    Caps,
    Envelope,
    ModelCallCompleted,
    ModelRef,
    RunAccepted,
    RunTerminated,
    StepGranted,
    SubmitRun,
    ToolCall,
    ToolCallCompleted,
    ToolCallRequested,
    Usage,
)
from tether_contracts.schemas import schema_set
from tether_messaging.chain import seal
from tether_messaging.envelopes import derived_id, headers_for, make_envelope
from tether_messaging.serde import encode, open_payload
from tether_run_api.audit import render_text, verify_log
from tether_run_api.cli import main as cli
from tether_tool_gateway.builtin_tools import builtin_tool_specs

RUN, TENANT = "run-loop-rules-1", "t1"
T0 = 1_800_000_000_000
TOOLS = builtin_tool_specs(kv_url="http://127.0.0.1:1", smtp_host="127.0.0.1", smtp_port=1, email_from="a@x.test",
                           http_allow_hosts=["example.test"])
NAMES = [t.name for t in TOOLS]
MODEL = ModelRef(provider="openai", name="m", context_window_tokens=128_000)
# A job service answering with a different wait each time: one result under v1 (any whole-number
# duration was noise), five under v2. Under v1 the run was warned after step 4 and stopped after step 5.
RETRIES = ["retry in 5 min", "retry in 30 min", "retry in 10 min", "retry in 2 min", "retry in 15 min"]


def _submit() -> SubmitRun:
    caps = Caps(max_steps=10, max_wall_clock_ms=3_600_000, max_tokens=100_000, max_cost_usd_micros=1_000_000,
                max_tool_calls=10)
    agent = AgentSpec(agent_id="a", version=1, name="a", instructions="be good", model=MODEL, tool_allowlist=NAMES,
                      caps=caps, compaction_threshold=0.8)
    return SubmitRun(request_id="r1", principal_id="alice", goal="wait for the job", agent=agent, tools=TOOLS,
                     caps=caps, tenant_grants=NAMES)


class Budget:
    """Writes a run's log as a budget judging it by `loop_rules` would (its own domain, a sealed chain)."""

    def __init__(self, loop_rules: int, run_id: str = RUN) -> None:
        self.run_id = run_id
        self.log: list[Envelope] = []
        self.clock = T0
        self.ledger, plan = admit(_submit(), run_id=run_id, tenant_id=TENANT, partition=0, event_id="submit-1",
                                  now_ms=self._tick(), policy=AdmissionPolicy(), loop_rules=loop_rules)
        self._write(plan.entries, None)

    def _tick(self) -> int:
        self.clock += 7
        return self.clock

    def _append(self, env: Envelope) -> None:
        self.log.append(seal(env, len(self.log) + 1, self.log[-1].hash if self.log else "0" * 64))

    def _write(self, entries, inbound: Envelope | None) -> None:
        for entry in entries:
            if isinstance(entry, Decide):
                self._append(make_envelope(entry.payload, run_id=self.run_id, tenant_id=TENANT,
                                           event_id=derived_id(self.run_id, *entry.what), producer="budget",
                                           recorded_at_ms=self.clock))
            else:
                self._append(inbound)

    def intake(self, payload: AvroRecord, producer: str, what: str) -> None:
        env = make_envelope(payload, run_id=self.run_id, tenant_id=TENANT, event_id=derived_id(self.run_id, what),
                            producer=producer, recorded_at_ms=self._tick())
        plan = fold(self.ledger, payload, event_id=env.event_id, tenant_id=TENANT, guard=LoopGuard(),
                    now_ms=self._tick())
        self._write(plan.entries, env)

    def retry_step(self, step: int, answer: str) -> None:
        self.intake(ModelCallCompleted(step=step, model=MODEL, usage=Usage(input_tokens=10, output_tokens=5,
                                       cost_usd_micros=3), assistant_text="", tool_call_count=1,
                                       finish_reason="tool_calls", latency_ms=1), "planner", f"m{step}")
        args_json = '{"key":"job"}'
        call = ToolCall(call_id=f"{step}.0", call_index=0,
                        idem_key=hashlib.sha256(f"{self.run_id}\x1f{step}\x1f0".encode()).hexdigest(), tool_name="kv_get",
                        args_json=args_json, args_hash=hashlib.sha256(args_json.encode()).hexdigest(),
                        provider_call_id=f"p{step}")
        self.intake(ToolCallRequested(step=step, call=call, provenance_json="{}"), "planner", f"r{step}")
        result = json.dumps({"status": "busy", "detail": answer})
        self.intake(ToolCallCompleted(step=step, call_id=call.call_id, idem_key=call.idem_key, tool_name="kv_get",
                                      result_json=result, untrusted=False, duration_ms=1, replayed=False),
                    "tool-gateway", f"c{step}")


def _stopped_under_v1(run_id: str = RUN) -> list[Envelope]:
    budget = Budget(loop_rules=1, run_id=run_id)
    for step, answer in enumerate(RETRIES, start=1):
        budget.retry_step(step, answer)
    payloads = [open_payload(e) for e in budget.log]
    assert isinstance(payloads[0], RunAccepted) and payloads[0].loop_guard_version == 1
    grants = [p for p in payloads if isinstance(p, StepGranted)]
    assert [g.loop_warning is not None for g in grants] == [False, False, False, False, True]
    assert isinstance(payloads[-1], RunTerminated) and payloads[-1].reason_code == "LOOP_DETECTED"
    return budget.log


def _resealed(log: list[Envelope]) -> list[Envelope]:
    out: list[Envelope] = []
    for env in log:
        out.append(seal(env, env.seq, out[-1].hash if out else "0" * 64))
    return out


def _with_accepted(log: list[Envelope], payload_bytes: bytes) -> list[Envelope]:
    return _resealed([log[0].model_copy(update={"payload": payload_bytes}), *log[1:]])


def _written_before_versions(accepted: RunAccepted) -> bytes:
    """RunAccepted as the released schema (v1, without loop_guard_version) wrote it."""
    fp, writer = next((fp, w) for fp, w in schema_set().writers.items()
                      if w.name == "tether.v1.RunAccepted" and w.release is not None)
    fields = {f["name"] for f in writer.parsed["fields"]}
    assert "loop_guard_version" not in fields
    body = io.BytesIO()
    fastavro.schemaless_writer(body, writer.parsed, {k: v for k, v in accepted.to_avro().items() if k in fields})
    return b"\xc3\x01" + fp + body.getvalue()


def _budget_mismatches(report) -> list[str]:
    return [f"{f.seq} {f.event_type} {f.problem}" for f in report.mismatches if f.check == "budget"]


def test_a_loop_stop_of_the_v1_rules_replays_clean_when_the_log_names_v1():
    log = _stopped_under_v1()
    report = verify_log(log)
    assert report.ok, render_text(report)
    assert not [f for f in report.findings if f.check == "note"], render_text(report)


def test_the_same_log_naming_v2_is_a_budget_mismatch():
    log = _stopped_under_v1()
    accepted = open_payload(log[0]).model_copy(update={"loop_guard_version": 2})
    report = verify_log(_with_accepted(log, encode(accepted)))
    found = _budget_mismatches(report)
    assert found, render_text(report)
    assert any("StepGranted differs in loop_warning" in f for f in found), found
    assert any("the inputs give StepGranted, the log has RunTerminated" in f and "LOOP_DETECTED" not in f
               for f in found), found
    assert not [f for f in report.findings if f.check == "note" and "unknown" in f.problem]


def test_the_same_log_written_before_versions_is_a_note_saying_the_rules_are_unknown():
    log = _stopped_under_v1()
    unversioned = _with_accepted(log, _written_before_versions(open_payload(log[0])))
    assert open_payload(unversioned[0]).loop_guard_version is None  # what an old budget's record decodes to
    report = verify_log(unversioned)
    assert report.ok, render_text(report)
    notes = [f for f in report.findings if f.check == "note"]
    assert [f.event_type.rsplit(".", 1)[1] for f in notes] == ["ToolCallCompleted", "ToolCallCompleted"]
    assert all("rules version is unknown" in f.problem for f in notes)
    assert "the log warns (Loop warning (R1_REPEAT)" in notes[0].problem
    assert "the log stops the run" in notes[1].problem and "neither warns nor stops" in notes[1].problem


def test_an_unversioned_log_still_reports_a_decision_that_is_not_the_loop_guards():
    log = _stopped_under_v1()
    unversioned = _with_accepted(log, _written_before_versions(open_payload(log[0])))
    i, grant = next((i, p) for i, e in enumerate(unversioned) if isinstance(p := open_payload(e), StepGranted)
                    and p.step == 3)
    forged = grant.model_copy(update={"remaining": grant.remaining.model_copy(update={"steps": 9})})
    tampered = list(unversioned)
    tampered[i] = unversioned[i].model_copy(update={"payload": encode(forged)})
    report = verify_log(_resealed(tampered))
    assert [f for f in _budget_mismatches(report) if "differs in remaining" in f], render_text(report)


def test_an_unknown_rules_version_is_a_mismatch():
    log = _stopped_under_v1()
    accepted = open_payload(log[0]).model_copy(update={"loop_guard_version": 9})
    report = verify_log(_with_accepted(log, encode(accepted)))
    assert any("loop guard rules version 9 is unknown to the audit" in f for f in _budget_mismatches(report))


@pytest.mark.integration
def test_cli_over_kafka_replays_each_run_by_the_rules_it_names(kafka_bootstrap):
    prefix = f"audit-rules-{uuid.uuid4().hex[:10]}."
    topic = prefix + "tether.run-events.v1"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)
    try:
        unversioned, v2 = _stopped_under_v1("run-unversioned"), _stopped_under_v1("run-v2")
        runs = {"run-v1": _stopped_under_v1("run-v1"),
                "run-unversioned": _with_accepted(unversioned, _written_before_versions(open_payload(unversioned[0]))),
                "run-v2": _with_accepted(v2, encode(open_payload(v2[0]).model_copy(update={"loop_guard_version": 2})))}
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for run_id, envs in runs.items():
            for env in envs:
                producer.produce(topic, key=run_id.encode(), value=encode(env), headers=headers_for(env))
        assert producer.flush(30) == 0
        result = CliRunner().invoke(cli.app, ["audit", "verify", "--bootstrap", kafka_bootstrap,
                                              "--topic-prefix", prefix, "--json"])
        assert result.exit_code == 3, result.output
        report = json.loads(result.stdout)
        assert report["runs"] == 3
        assert {m["run_id"] for m in report["mismatches"]} == {"run-v2"}
        assert {n["run_id"] for n in report["notes"] if "rules version is unknown" in n["problem"]} == \
            {"run-unversioned"}
    finally:
        admin.delete_topics([topic])
