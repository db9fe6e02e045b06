"""`tether audit verify`: re-derive every run's chain, budget, gateway and approval decisions from the log.

Pure over a list of sequenced envelopes (`verify_log`); `read_run_log` reads them from Kafka
(read_committed, every partition from its log start, either wire format) and says which partitions
lost their first records. The budget's decisions are replayed with its
own domain (`tether_budget.domain.decisions`), fed the run's recorded inputs in sequence order
at the time the budget recorded its decisions; the gateway's with `GatewayAudit`; approval
decisions against the pending request they decide. What the log alone cannot show is said so
(`Finding.check == "note"`), not reported as a mismatch. Loop warnings and stops are re-derived
under the loop guard rules version the run's RunAccepted names (`loop_guard_version`), as the
gateway's decisions under the `policy_version` they name.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tether_approval.domain.decisions import SYSTEM_APPROVER, ApprovalPolicy
from tether_approval.domain.errors import DecisionAfterExpiry
from tether_budget.domain.decisions import AdmissionPolicy, Decide, Plan, Retention, admit, cancel, fold, tick
from tether_budget.domain.errors import ProtocolViolation
from tether_budget.domain.ledger import Ledger, Reason, RunStatus
from tether_budget.domain.loopguard import (
    CURRENT_RULES,
    LOOP_RULES,
    Detection,
    LoopGuard,
    LoopGuardState,
    LoopRule,
    StepSignature,
    Verdict,
)
from tether_contracts.base import AvroRecord
from tether_contracts.records import (
    ApprovalDecided,
    ApprovalDecisionRefused,
    ApprovalOutcome,
    ApprovalRequested,
    CancelRun,
    Envelope,
    RunAccepted,
    RunCompleted,
    RunQueued,
    RunRejected,
    RunTerminated,
    StepDeferred,
    StepGranted,
    SubmitRun,
)
from tether_messaging.chain import verify_chain
from tether_messaging.envelopes import derived_id
from tether_messaging.logreader import read_log
from tether_messaging.serde import SerdeError, open_payload
from tether_tool_gateway.audit import GatewayAudit
from tether_tool_gateway.domain.policy import BasicPolicy, Policy, TrustPolicy
from tether_tool_gateway.domain.policy_document import LoadedPolicy, default_policies

BUDGET = "budget"
_CANCELLED = re.compile(r"^cancelled by (?P<who>\S+) \((?:the submitter|a member of the tenant)\)(?:: (?P<why>.*))?$",
                        re.DOTALL)
_TENANT_DECISIONS = (RunQueued, StepDeferred)
_TERMINAL = (RunCompleted, RunTerminated, RunRejected)


@dataclass(frozen=True)
class Finding:
    """One thing the audit found: a mismatch (`check` chain/budget/gateway/approval/log/absent) or a note."""

    check: str
    run_id: str
    seq: int | None
    event_type: str
    problem: str


@dataclass
class AuditReport:
    """What `verify_log` found over the whole log."""

    runs: int = 0
    events: int = 0
    findings: list[Finding] = field(default_factory=list)
    #: Runs in the log without a terminal event: live, or cut off (the log alone cannot tell).
    open_runs: list[str] = field(default_factory=list)
    #: Runs asked for (`run_ids`) of which the log has no event: a mismatch each.
    absent_runs: list[str] = field(default_factory=list)
    #: Partitions whose first records were deleted: partition → the offset its log starts at.
    deleted: dict[int, int] = field(default_factory=dict)
    #: Each run's chain head in the log: run id → (last seq, its hash). The chain is an unkeyed
    #: hash: whoever can write the topic can rewrite an event and every hash after it, so the
    #: log alone proves consistency, not authenticity. Compared with a copy kept elsewhere (the
    #: read model's runs.last_seq/last_hash, or heads recorded by an earlier audit), it does.
    heads: dict[str, tuple[int, str]] = field(default_factory=dict)

    @property
    def mismatches(self) -> list[Finding]:
        return [f for f in self.findings if f.check != "note"]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "runs": self.runs, "events": self.events,
                "mismatches": [asdict(f) for f in self.mismatches],
                "notes": [asdict(f) for f in self.findings if f.check == "note"],
                "open": list(self.open_runs), "absent": list(self.absent_runs),
                "deleted": [{"partition": p, "log_start_offset": o} for p, o in sorted(self.deleted.items())],
                "heads": {run_id: {"seq": seq, "hash": hash_} for run_id, (seq, hash_) in sorted(self.heads.items())}}


@dataclass(frozen=True)
class AuditConfig:
    """The deployment's rules the decisions were made under (the services' defaults unless told)."""

    gateway_policies: tuple[LoadedPolicy, ...] = ()
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    guard: LoopGuard = field(default_factory=LoopGuard)
    retention: Retention = field(default_factory=Retention)
    approval: ApprovalPolicy = field(default_factory=ApprovalPolicy)

    def policies(self) -> tuple[dict[str, Policy], str]:
        """Gateway policies by version, and the version allowed calls (no decision event) are checked under."""
        # Without a deployment's documents: the gateway's default of every release, the current
        # one first (the last, the oldest, is what logs without decision events are checked under).
        loaded = self.gateway_policies or default_policies()
        policies: dict[str, Policy] = {"basic/1": BasicPolicy()}
        for doc in loaded:
            policies[doc.policy_version] = TrustPolicy(doc)
        return policies, loaded[-1].policy_version


Event = tuple[Envelope, AvroRecord]


class RunLog(list[Envelope]):
    """The envelopes `read_run_log` read, and the partitions whose first records were deleted."""

    def __init__(self, envelopes: Iterable[Envelope], *, topic: str, deleted: Mapping[int, int],
                 partitions: Iterable[int] | None = None) -> None:
        super().__init__(envelopes)
        self.topic = topic
        #: partition → the offset its log starts at (only partitions that lost records).
        self.deleted = dict(deleted)
        #: The partition each envelope was read from (same order), when known.
        self.partitions = list(partitions) if partitions is not None else None


def verify_log(envelopes: Iterable[Envelope], config: AuditConfig | None = None, *,
               run_ids: set[str] | None = None, deleted: Mapping[int, int] | None = None) -> AuditReport:
    """Check every run in the log (or only `run_ids`): chain, budget, gateway and approval decisions.

    A run of `run_ids` with no event in the log is a mismatch (check "absent"): a typo or a
    deleted run must not pass. A run without a terminal event is listed in `open_runs` with a
    note: it may be live; a tail cut off after any event is not detectable from the log alone.
    Each partition whose first records were deleted (`deleted`, by default a `RunLog`'s) is a
    mismatch (check "log", RECORDS_DELETED): the log is kept forever, and a run whose events are
    all gone would otherwise not show at all.
    """
    config = config or AuditConfig()
    report = AuditReport()
    if deleted is None and isinstance(envelopes, RunLog):
        deleted = envelopes.deleted
    topic = envelopes.topic if isinstance(envelopes, RunLog) else "the run event log"
    for partition, start in sorted((deleted or {}).items()):
        report.deleted[partition] = start
        report.findings.append(Finding(
            "log", "", None, "RECORDS_DELETED",
            f"partition {partition} of {topic} starts at offset {start}: offsets 0..{start - 1} were deleted "
            "(retention, delete_records or a lost segment); runs on it may have lost their first events "
            "(chain GAP) or all of them"))
    by_run: dict[str, list[Envelope]] = defaultdict(list)
    for env in envelopes:
        if run_ids is None or env.run_id in run_ids:
            by_run[env.run_id].append(env)
    # A run's events are ordered and chained in one partition (keyed by run id): events of one run
    # on several partitions mean a producer keyed it wrongly, and its order is then not defined.
    if isinstance(envelopes, RunLog) and envelopes.partitions is not None:
        partitions_of: dict[str, set[int]] = defaultdict(set)
        for env, partition in zip(envelopes, envelopes.partitions, strict=True):
            if env.run_id in by_run:
                partitions_of[env.run_id].add(partition)
        for run_id, found in sorted(partitions_of.items()):
            if len(found) > 1:
                report.findings.append(Finding(
                    "log", run_id, None, "SPLIT_PARTITIONS",
                    f"events of this run are on partitions {sorted(found)}: a run's events belong to one "
                    "partition, where they are ordered and chained"))
    policies, allow_version = config.policies()
    for run_id, envs in by_run.items():
        report.runs += 1
        report.events += len(envs)
        for p in verify_chain(envs):
            report.findings.append(Finding("chain", run_id, p.seq, p.kind.value, p.detail))
        head = max(envs, key=lambda e: e.seq or 0)
        report.heads[run_id] = (head.seq or 0, head.hash or "")
        events: list[Event] = []
        for env in sorted(envs, key=lambda e: e.seq or 0):
            try:
                payload = open_payload(env)
            except SerdeError as err:
                report.findings.append(Finding("log", run_id, env.seq, env.event_type, f"payload does not decode: {err}"))
                continue
            if payload.AVRO_NAME != env.event_type:
                # The envelope's label is what subscribers filter and decode by: one that differs
                # from its payload stops every subscriber (UndecodableRecord).
                report.findings.append(Finding("log", run_id, env.seq, "TYPE_MISMATCH",
                                               f"the envelope says {env.event_type}, the payload is {payload.AVRO_NAME}"))
            events.append((env, payload))
        report.findings.extend(BudgetReplay(run_id, config).check(events))
        for m in GatewayAudit(policies, allow_version=allow_version).check(events):
            report.findings.append(Finding("gateway", m.run_id, m.seq, m.event_type, f"{m.call_id}: {m.problem}"))
        report.findings.extend(check_approvals(run_id, events, config.approval))
        if not any(isinstance(payload, _TERMINAL) for _, payload in events):
            last = max(envs, key=lambda e: e.seq or 0)
            report.open_runs.append(run_id)
            report.findings.append(Finding(
                "note", run_id, last.seq, last.event_type,
                "no terminal event: the run may still be live, or the log's tail of it is cut off "
                "(not detectable from the log; compare with the read model's last_seq)"))
    for run_id in sorted((run_ids or set()) - by_run.keys()):
        report.absent_runs.append(run_id)
        report.findings.append(Finding("absent", run_id, None, "",
                                       "no event of this run in the log (a wrong run id, or its events are gone)"))
    return report


# -- budget ------------------------------------------------------------------------------------------


def _comparable(payload: AvroRecord, *, approximate_clock: bool, loop_unknown: bool = False) -> Any:
    data = payload.to_avro()
    if approximate_clock:
        _drop_clock(data)
    if loop_unknown:
        # The loop guard's words depend on the rules that judged the run (already noted as unknown).
        if isinstance(payload, StepGranted):
            data["loop_warning"] = None
        elif isinstance(payload, RunTerminated) and payload.reason_code == Reason.LOOP_DETECTED:
            data["report"]["detail"] = None
    return data


LoopOutcome = tuple[Verdict, str | None]


def _loop_outcome(payloads: Iterable[AvroRecord]) -> LoopOutcome:
    """What the loop guard said among the budget decisions one input triggered: a stop (with its
    detail), a warning on the next grant, or nothing."""
    for payload in payloads:
        if isinstance(payload, RunTerminated) and payload.reason_code == Reason.LOOP_DETECTED:
            return Verdict.TERMINATE, payload.report.detail
        if isinstance(payload, StepGranted) and payload.loop_warning is not None:
            return Verdict.WARN, payload.loop_warning
    return Verdict.CONTINUE, None


def _describe(outcome: LoopOutcome) -> str:
    verdict, text = outcome
    if verdict is Verdict.TERMINATE:
        return f"stops the run ({text})"
    if verdict is Verdict.WARN:
        return f"warns ({text})"
    return "neither warns nor stops"


class _LoggedVerdict(LoopGuard):
    """The loop guard of a run whose rules version is unknown, made to give the verdict its log
    records: the step is folded into the guard's memory by the current rules, the verdict is the
    log's, so the replay goes on from the state the budget was in."""

    def __init__(self, guard: LoopGuard, verdict: Verdict) -> None:
        super().__init__(guard.config)
        self.verdict = verdict

    def observe(self, state: LoopGuardState, step: StepSignature) -> tuple[Verdict, Detection | None]:
        warned, fired = state.warned, state.fired
        verdict, detection = super().observe(state, step)
        if verdict is self.verdict:
            return verdict, detection
        state.warned, state.fired = warned, fired
        if self.verdict is Verdict.CONTINUE:
            return Verdict.CONTINUE, None
        # Its words are not compared (the log's come from unknown rules); the memory needs a detection.
        stand_in = detection or Detection(rule=LoopRule.REPEAT, step=step.step, count=0, action=step.label)
        if self.verdict is Verdict.WARN:
            state.warned = stand_in
        else:
            state.warned, state.fired = warned or stand_in, stand_in
        return self.verdict, stand_in


def _drop_clock(data: Any) -> None:
    # How long a run waited for humans depends on when the budget read the approval records,
    # which the log does not record; what follows from it is left out of the comparison.
    if isinstance(data, dict):
        for key in ("wall_clock_ms", "detail"):
            if key in data and (key == "wall_clock_ms" or "waiting for humans" in str(data[key])):
                data[key] = None
        for value in data.values():
            _drop_clock(value)
    elif isinstance(data, list):
        for value in data:
            _drop_clock(value)


@dataclass
class BudgetReplay:
    """Replays the budget's domain over one run's recorded inputs and compares its decisions."""

    run_id: str
    config: AuditConfig
    findings: list[Finding] = field(default_factory=list)
    ledger: Ledger | None = None
    waited: bool = False
    #: The run's RunAccepted names no loop guard rules version this audit has: its loop verdicts
    #: are re-derived with the current rules, and one that differs is a note, not a mismatch.
    loop_rules_unknown: bool = False

    def check(self, events: list[Event]) -> list[Finding]:
        i = 0
        while i < len(events):
            env, payload = events[i]
            if isinstance(payload, _TENANT_DECISIONS):
                self._note(env, "tenant-ledger decisions (queue, token rate) are not re-derived; "
                                "the run's budget decisions are not checked")
                return self.findings
            if env.producer == BUDGET:
                i = self._unprompted(events, i)
            else:
                i = self._input(events, i)
        return self.findings

    def _finding(self, env: Envelope, problem: str) -> None:
        self.findings.append(Finding("budget", self.run_id, env.seq, env.event_type, problem))

    def _note(self, env: Envelope, problem: str) -> None:
        self.findings.append(Finding("note", self.run_id, env.seq, env.event_type, problem))

    def _input(self, events: list[Event], i: int) -> int:
        """An intake record: the budget appended it; the decisions it triggers follow it at once."""
        env, payload = events[i]
        if self.ledger is None:
            self._finding(env, "an input before the run was accepted")
            return i + 1
        nxt = events[i + 1][0] if i + 1 < len(events) else None
        now_ms = nxt.recorded_at_ms if nxt is not None and nxt.producer == BUDGET else env.recorded_at_ms
        before = self.ledger.model_copy(deep=True)
        try:
            plan = fold(self.ledger, payload, event_id=env.event_id, tenant_id=env.tenant_id,
                        guard=self.config.guard, now_ms=now_ms)
        except ProtocolViolation as err:
            self.ledger = before
            self._finding(env, f"appended although the budget refuses it: {err}")
            return i + 1
        if self.ledger.waiting_since_ms is not None or self.ledger.human_wait_ms:
            self.waited = True
        if not plan.entries:
            self._finding(env, f"appended although the budget drops it ({plan.dropped})")
            return i + 1
        if self.loop_rules_unknown:
            logged = _loop_outcome(p for e, p in self._decisions(events, i + 1))
            derived = _loop_outcome(e.payload for e in plan.entries if isinstance(e, Decide))
            if derived != logged:
                # Which rules judged the run is not recorded: follow the log's verdict, check the rest.
                self._note(env, f"the loop guard's verdict differs: the log {_describe(logged)}; the current "
                                f"rules (v{CURRENT_RULES}) {_describe(derived)}. The run's loop guard rules version "
                                "is unknown (its RunAccepted names none: recorded before versions were), so "
                                "this is not a mismatch; the replay follows the log's verdict")
                self.ledger = before
                plan = fold(self.ledger, payload, event_id=env.event_id, tenant_id=env.tenant_id,
                            guard=_LoggedVerdict(self.config.guard, logged[0]), now_ms=now_ms)
        return self._compare(events, i + 1, plan)

    @staticmethod
    def _decisions(events: list[Event], i: int) -> list[Event]:
        """The budget decisions in the log from index i (those the preceding input triggered)."""
        found: list[Event] = []
        while i < len(events) and events[i][0].producer == BUDGET:
            found.append(events[i])
            i += 1
        return found

    def _unprompted(self, events: list[Event], i: int) -> int:
        """A budget decision no appended input precedes: admission, cancel or the wall-clock timer."""
        env, payload = events[i]
        if isinstance(payload, RunAccepted) and self.ledger is None:
            submit = SubmitRun(request_id=payload.request_id, principal_id=payload.principal_id, goal=payload.goal,
                               agent=payload.agent, tools=payload.tools, caps=payload.caps,
                               tenant_grants=payload.tenant_grants, delegated_scope=payload.delegated_scope)
            rules = payload.loop_guard_version
            if rules is not None and rules not in LOOP_RULES:
                self._finding(env, f"loop guard rules version {rules} is unknown to the audit (it knows "
                                   f"{', '.join(f'v{v}' for v in sorted(LOOP_RULES))}); loop verdicts are replayed "
                                   f"with v{CURRENT_RULES} and one that differs is a note")
            self.loop_rules_unknown = rules not in LOOP_RULES
            try:
                self.ledger, plan = admit(submit, run_id=self.run_id, tenant_id=env.tenant_id, partition=0,
                                          event_id=env.event_id, now_ms=env.recorded_at_ms,
                                          policy=self.config.admission,
                                          loop_rules=CURRENT_RULES if self.loop_rules_unknown else rules)
            except ProtocolViolation as err:
                self._finding(env, f"RunAccepted although the budget refuses the submit: {err}")
                return len(events)  # nothing of the run can be re-derived without its admission
            if self.loop_rules_unknown:
                # Replayed with the current rules, which the log does not name: its own word stands.
                plan.entries = [Decide(e.payload.model_copy(update={"loop_guard_version": rules}), e.what)
                                if isinstance(e, Decide) and isinstance(e.payload, RunAccepted) else e
                                for e in plan.entries]
            return self._compare(events, i, plan)
        if isinstance(payload, RunRejected) and self.ledger is None:
            self._note(env, "the rejected submit is not in the run log; its admission is not re-derived")
            return i + 1
        if self.ledger is None:
            self._finding(env, "a budget decision before the run was accepted")
            return i + 1
        if isinstance(payload, RunTerminated) and payload.reason_code == Reason.CANCELLED:
            match = _CANCELLED.match(payload.report.detail)
            if match is None:
                self._finding(env, f"CANCELLED with a detail no cancel produces: {payload.report.detail!r}")
                return i + 1
            command = CancelRun(principal_id=match["who"], reason=match["why"] or "")
            before = self.ledger.model_copy(deep=True)
            try:
                plan = cancel(self.ledger, command, tenant_id=env.tenant_id, now_ms=env.recorded_at_ms)
            except ProtocolViolation as err:
                self.ledger = before
                self._finding(env, f"CANCELLED although the budget refuses the cancel: {err}")
                return i + 1
            return self._compare(events, i, plan)
        if isinstance(payload, RunTerminated) and payload.reason_code == Reason.WALL_CLOCK_CAP:
            result = tick(self.ledger, now_ms=env.recorded_at_ms, retention=self.config.retention)
            if not result.plan.entries and self.waited:
                # The budget measured the human wait when it read the approval records, which the
                # log does not record: follow the log, the run ended here for the rest of the fold.
                self._note(env, "wall-clock stop after waiting for humans: the deadline is not re-derived exactly; "
                                "the run is taken as ended here, as the log says")
                self.ledger.end(RunStatus.TERMINATED, Reason.WALL_CLOCK_CAP, env.recorded_at_ms)
                return i + 1
            return self._compare(events, i, result.plan)
        self._finding(env, f"a budget decision ({env.event_type}) that follows from no recorded input")
        return i + 1

    def _compare(self, events: list[Event], i: int, plan: Plan) -> int:
        """Match the plan's decisions with the budget events from index i; returns the next index."""
        for entry in plan.entries:
            if not isinstance(entry, Decide):
                continue
            want = entry.payload
            if i >= len(events) or events[i][0].producer != BUDGET:
                where = events[i][0] if i < len(events) else events[-1][0]
                self._finding(where, f"the inputs give {want.AVRO_NAME.rsplit('.', 1)[-1]} here; the log has none")
                continue
            env, got = events[i]
            i += 1
            if type(got) is not type(want):
                self._finding(env, f"the inputs give {type(want).__name__}, the log has {type(got).__name__}"
                                   + _reason_of(want))
                continue
            if env.event_id != derived_id(self.run_id, *entry.what):
                self._finding(env, f"event_id {env.event_id} is not the derived id of {entry.what}")
            a = _comparable(want, approximate_clock=self.waited, loop_unknown=self.loop_rules_unknown)
            b = _comparable(got, approximate_clock=self.waited, loop_unknown=self.loop_rules_unknown)
            if a != b:
                diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                self._finding(env, f"{type(got).__name__} differs in {', '.join(diff)}: the inputs give "
                                   f"{json.dumps({k: a.get(k) for k in diff}, default=str)[:300]}")
        return i


def _reason_of(payload: AvroRecord) -> str:
    if isinstance(payload, RunTerminated):
        return f" ({payload.reason_code}: {payload.report.detail})"
    return ""


DECISION_AFTER_EXPIRY = DecisionAfterExpiry.reason

# -- approvals ---------------------------------------------------------------------------------------


def check_approvals(run_id: str, events: list[Event], policy: ApprovalPolicy) -> list[Finding]:
    """Each ApprovalDecided must decide a pending ApprovalRequested of the run with its args hash, in
    time (or EXPIRED by the system after its expiry), and not be an approval by the run's submitter.
    Each ApprovalDecisionRefused must follow the EXPIRED decision of its approval, for a decision
    recorded by the expiry (the approval service's DECISION_AFTER_EXPIRY)."""
    findings: list[Finding] = []
    requested: dict[str, ApprovalRequested] = {}
    decided: set[str] = set()
    expired: set[str] = set()  # approvals whose decision on the log is EXPIRED
    submitter: str | None = None
    for env, payload in events:
        if isinstance(payload, RunAccepted):
            submitter = payload.principal_id
        elif isinstance(payload, ApprovalRequested):
            requested.setdefault(payload.approval_id, payload)
        elif isinstance(payload, ApprovalDecided):
            def bad(problem: str, env: Envelope = env, d: ApprovalDecided = payload) -> None:
                findings.append(Finding("approval", run_id, env.seq, env.event_type, f"{d.approval_id}: {problem}"))

            req = requested.get(payload.approval_id)
            if req is None:
                bad("decides an approval that was never requested")
                continue
            if payload.approval_id in decided:
                bad("decides an approval that was already decided")
            decided.add(payload.approval_id)
            if (payload.call_id, payload.args_hash) != (req.call_id, req.args_hash):
                bad(f"decided call {payload.call_id} args {payload.args_hash[:12]}; the request is for call "
                    f"{req.call_id} args {req.args_hash[:12]}")
            if payload.outcome is ApprovalOutcome.EXPIRED:
                if payload.decided_at_ms <= req.expires_at_ms:
                    bad(f"EXPIRED at {payload.decided_at_ms}, before its expiry {req.expires_at_ms}")
                if payload.approver_id != SYSTEM_APPROVER:
                    bad(f"EXPIRED by {payload.approver_id}, not by the system")
            else:
                if payload.decided_at_ms > req.expires_at_ms:
                    bad(f"{payload.outcome.value} at {payload.decided_at_ms}, after its expiry {req.expires_at_ms}")
                if payload.approver_id == SYSTEM_APPROVER:
                    bad(f"{payload.outcome.value} by the system, which only expires approvals")
                if (payload.outcome is ApprovalOutcome.APPROVED and policy.forbid_self_approval
                        and payload.approver_id == submitter):
                    bad(f"approved by {payload.approver_id}, who submitted the run")
            if payload.outcome is ApprovalOutcome.EXPIRED:
                expired.add(payload.approval_id)
        elif isinstance(payload, ApprovalDecisionRefused):
            def refused(problem: str, env: Envelope = env, r: ApprovalDecisionRefused = payload) -> None:
                findings.append(Finding("approval", run_id, env.seq, env.event_type, f"{r.approval_id}: {problem}"))

            # The one refusal on the log: a decision recorded in time, read after the expiry decided.
            req = requested.get(payload.approval_id)
            if req is None:
                refused("refuses a decision on an approval that was never requested")
                continue
            if payload.call_id != req.call_id:
                refused(f"refused a decision on call {payload.call_id}; the request is for call {req.call_id}")
            if payload.approval_id not in expired:
                refused("refused as read after the expiry, but the approval had not EXPIRED before it")
            if payload.reason != DECISION_AFTER_EXPIRY:
                refused(f"refused for {payload.reason!r}; only {DECISION_AFTER_EXPIRY} is recorded on the log")
            if payload.decided_at_ms > req.expires_at_ms or payload.expires_at_ms != req.expires_at_ms:
                refused(f"decided at {payload.decided_at_ms} against an expiry of {payload.expires_at_ms}; the request "
                        f"expires at {req.expires_at_ms}: not a decision recorded in time")
    return findings


# -- reading the log ---------------------------------------------------------------------------------


def read_run_log(bootstrap: str, topic: str, *, schema_registry_url: str | None = None,
                 timeout_s: float = 120.0) -> RunLog:
    """Every committed envelope of `topic` (all partitions from their log start, read_committed), in partition order.

    Reads both wire formats (tether_messaging.logreader); a log written with
    TETHER_SCHEMA_REGISTRY_URL set needs that registry's URL. The `RunLog` also names the
    partitions whose first records were deleted (`verify_log` reports them). Raises LogReadError.
    """
    read = read_log(bootstrap, topic, schema_registry_url=schema_registry_url, timeout_s=timeout_s,
                    group_prefix="tether-audit")
    return RunLog((r.envelope for r in read.records), topic=topic, deleted=read.deleted,
                  partitions=(r.partition for r in read.records))


def render_text(report: AuditReport) -> str:
    """The human report: a summary line, then one line per mismatch and note."""
    verdict = "OK" if report.ok else f"{len(report.mismatches)} MISMATCH(ES)"
    still_open = f", {len(report.open_runs)} open (no terminal event)" if report.open_runs else ""
    lines = [f"audit: {report.runs} run(s), {report.events} event(s){still_open}: {verdict}"]
    for f in report.findings:
        tag = "note" if f.check == "note" else f"MISMATCH {f.check}"
        lines.append(f"  {tag} run={f.run_id} seq={f.seq} {f.event_type}: {f.problem}")
    return "\n".join(lines)


def policies_from_texts(texts: Mapping[str, str]) -> tuple[LoadedPolicy, ...]:
    """Parse policy documents (name → text) for the gateway audit."""
    from tether_tool_gateway.domain.policy_document import parse_policy

    return tuple(parse_policy(text) for text in texts.values())
