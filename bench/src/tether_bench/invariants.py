"""The chaos run's invariant checker: pure functions of evidence read independently of the services.

Evidence: the runs the clients submitted, the run event log (read_committed from offset 0), the
effect sinks' record files (where effects landed), the scripted model's request log, the
gateway's idempotency ledger rows, the fault timeline, and what the harness saw itself (the tenants
the approver bot serves, when it first asked to decide each approval, when its log reader first
read each event). Every count but `runs` must be 0;
what each one counts is tabled in docs/benchmarks.md ("make chaos: what is checked").
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether_bench.common import (
    APPROVAL_DECIDED,
    APPROVAL_REQUESTED,
    MODEL_CALL_COMPLETED,
    RUN_ACCEPTED,
    RUN_REJECTED,
    TERMINAL_TYPES,
    TOOL_CALL_BUDGETED,
    TOOL_CALL_COMPLETED,
    TOOL_CALL_DENIED,
    TOOL_CALL_FAILED,
    TOOL_CALL_OUTCOME_UNKNOWN,
    TOOL_CALL_REQUESTED,
)
from tether_contracts.records import Envelope
from tether_messaging.chain import verify_chain
from tether_messaging.serde import open_payload

OUTCOME_TYPES = (TOOL_CALL_COMPLETED, TOOL_CALL_FAILED, TOOL_CALL_DENIED)
#: Faults that may interrupt a tool execution (gateway) or a model call (planner) in flight.
TOOL_FAULTS = ("tool-gateway", "kafka", "postgres")
MODEL_FAULTS = ("planner", "kafka")


@dataclass(frozen=True)
class Fault:
    """One fault of the chaos run: `target` is a service ("planner", "tool-gateway#1" counts as
    "tool-gateway"), "kafka" or "postgres"; [start_ms, end_ms] is when it was down."""

    target: str
    start_ms: float
    end_ms: float

    @property
    def service(self) -> str:
        return self.target.split("#")[0]


@dataclass
class Evidence:
    """Everything the checker reads; built by `chaos.py` from files, topics and tables."""

    submitted: Mapping[str, str]  # run_id -> tenant_id
    log: Sequence[Envelope]  # in log order (per partition)
    kv_records: Sequence[Mapping[str, Any]] = ()
    smtp_records: Sequence[Mapping[str, Any]] = ()
    model_requests: Sequence[Mapping[str, Any]] = ()
    ledger_attempts: Mapping[str, int] = field(default_factory=dict)  # idem_key -> attempt
    faults: Sequence[Fault] = ()
    #: Tenants whose approvals the approver bot decides: an approval of theirs still open after the
    #: drain is a lost decision (or a bot failure), not a human's pending choice.
    approver_tenants: frozenset[str] = frozenset()
    #: approval_id -> wall clock (ms) when the bot first called DecideApproval for it (before the call).
    approval_asked_ms: Mapping[str, float] = field(default_factory=dict)
    #: approval_id -> what the bot got ("APPROVED", "REJECTED", "refused:...").
    bot_decisions: Mapping[str, str] = field(default_factory=dict)
    #: (run_id, seq) -> wall clock (ms) when the harness's read_committed observer first read that
    #: event: by then it was committed.
    seen_at_ms: Mapping[tuple[str, int], float] = field(default_factory=dict)


@dataclass
class _Run:
    accepted: bool = False
    tenant: str = ""
    terminal: str | None = None
    approvals_requested: set[str] = field(default_factory=set)
    approvals_decided: set[str] = field(default_factory=set)


def _fault_between(faults: Iterable[Fault], kinds: Sequence[str], start_ms: float, end_ms: float) -> bool:
    """True if a fault of those kinds overlapped [start_ms, end_ms]."""
    return any(f.service in kinds and f.start_ms <= end_ms and f.end_ms >= start_ms for f in faults)


def check(ev: Evidence) -> dict[str, Any]:
    """Every invariant's count (and a few samples of each violation, under `details`)."""
    details: dict[str, list[str]] = defaultdict(list)

    def note(kind: str, text: str) -> None:
        if len(details[kind]) < 10:
            details[kind].append(text)

    runs: dict[str, _Run] = defaultdict(_Run)
    budgeted: dict[str, tuple[str, str]] = {}  # idem_key -> (run, call_id)
    tool_of: dict[str, str] = {}  # idem_key -> tool name
    unknown_outcomes: set[str] = set()  # idem keys
    approved_calls: dict[tuple[str, str], list[str]] = defaultdict(list)  # (run, call_id) -> APPROVED approval ids
    decided_at: dict[str, int] = {}  # approval_id -> decided_at_ms of its (first) decision
    committed_at: dict[str, float] = {}  # idem key -> earliest time its terminal outcome was surely committed
    approval_call: dict[str, tuple[str, str]] = {}  # approval_id -> (run, call_id)
    model_done_at: dict[tuple[str, int], int] = {}  # (run, step) -> recorded_at_ms of ModelCallCompleted
    per_step_models: Counter[tuple[str, int]] = Counter()
    per_call_outcomes: Counter[tuple[str, str]] = Counter()

    for env in ev.log:
        run = runs[env.run_id]
        run.tenant = run.tenant or env.tenant_id
        kind = env.event_type
        if kind in (RUN_ACCEPTED, RUN_REJECTED):
            run.accepted = True
        if kind in TERMINAL_TYPES:
            run.terminal = kind
        if kind == TOOL_CALL_REQUESTED:
            call = open_payload(env).call
            tool_of[call.idem_key] = call.tool_name
        elif kind == TOOL_CALL_BUDGETED:
            payload = open_payload(env)
            budgeted[payload.idem_key] = (env.run_id, payload.call_id)
        elif kind == TOOL_CALL_OUTCOME_UNKNOWN:
            unknown_outcomes.add(open_payload(env).idem_key)
        elif kind == APPROVAL_REQUESTED:
            payload = open_payload(env)
            run.approvals_requested.add(payload.approval_id)
            approval_call[payload.approval_id] = (env.run_id, payload.call_id)
        elif kind == APPROVAL_DECIDED:
            payload = open_payload(env)
            run.approvals_decided.add(payload.approval_id)
            decided_at.setdefault(payload.approval_id, payload.decided_at_ms)
            if str(payload.outcome).endswith("APPROVED"):
                call_of = approval_call.get(payload.approval_id, (env.run_id, payload.call_id))
                approved_calls[call_of].append(payload.approval_id)
        elif kind == MODEL_CALL_COMPLETED:
            step = open_payload(env).step
            per_step_models[(env.run_id, step)] += 1
            model_done_at.setdefault((env.run_id, step), env.recorded_at_ms)
        elif kind in OUTCOME_TYPES:
            payload = open_payload(env)
            per_call_outcomes[(env.run_id, payload.call_id)] += 1
            # Surely committed once a reader saw it; without that, its record time (the gateway
            # emits an outcome in a batch whose clock is read after the execution finished).
            at = ev.seen_at_ms.get((env.run_id, env.seq or 0), env.recorded_at_ms)
            committed_at[payload.idem_key] = min(at, committed_at.get(payload.idem_key, at))

    # -- runs ---------------------------------------------------------------------------------
    # Lost is about submissions (a client got an id); every other check covers every run the log
    # answered, with a client or without (a submit that gave up, produced by run-api's sweeper).
    lost = [r for r in ev.submitted if not runs.get(r, _Run()).accepted]
    for r in lost:
        note("lost_runs", r)
    checked = sorted({*ev.submitted, *(r for r, run in runs.items() if run.accepted)})
    stuck = []
    waiting_on_human = 0
    for run_id in checked:
        run = runs.get(run_id)
        if run is None or not run.accepted or run.terminal is not None:
            continue
        open_approvals = sorted(run.approvals_requested - run.approvals_decided)
        if open_approvals and run.tenant not in ev.approver_tenants:
            waiting_on_human += 1  # legitimately parked: a human has not decided yet
            continue
        stuck.append(run_id)
        if open_approvals:
            said = ", ".join(f"{a}: bot {ev.bot_decisions.get(a, 'never decided')}" for a in open_approvals[:3])
            note("stuck_runs", f"{run_id} (approval still open although the bot serves {run.tenant}; {said})")
        else:
            note("stuck_runs", run_id)

    # -- chain ----------------------------------------------------------------------------------
    problems = verify_chain(ev.log)
    for p in problems[:10]:
        note("seq_gaps", f"{p.kind.value} run={p.run_id} seq={p.seq} {p.detail}")

    # -- effects -----------------------------------------------------------------------------------
    attempts: dict[str, list[float]] = defaultdict(list)  # idem key -> sink timestamps (ms)
    applied: Counter[str] = Counter()
    unattributed = 0
    for rec in ev.kv_records:
        if rec.get("op", "put") != "put":
            continue
        key = rec.get("idempotency_key")
        if not key:
            unattributed += 1
            note("silent_reexecutions", f"kv write without an idempotency key: {rec.get('key')}")
            continue
        attempts[key].append(float(rec.get("ts_ms", 0)))
        if rec.get("applied"):
            applied[key] += 1
    mails: Counter[str] = Counter()
    for rec in ev.smtp_records:
        key = rec.get("idempotency_key")
        if not key:
            unattributed += 1
            note("silent_reexecutions", f"email without an idempotency key: {rec.get('subject')}")
            continue
        attempts[key].append(float(rec.get("ts_ms", 0)))
        mails[key] += 1

    duplicate_effects = 0
    for key, n in list(applied.items()) + list(mails.items()):
        if n > 1:
            duplicate_effects += n - 1
            note("duplicate_effects", f"{key} applied {n} times ({tool_of.get(key, '?')})")

    silent = unattributed
    for key, times in attempts.items():
        if key not in budgeted:
            silent += len(times)
            note("silent_reexecutions", f"{key}: {len(times)} effect(s) for a call no ToolCallBudgeted names")
            continue
        # Each rule counts the attempts it proves extra; a key counts the most any rule proves
        # (one extra attempt is one silent re-execution, however many rules see it).
        extra = 0
        done = committed_at.get(key)
        after_commit = [t for t in times if done is not None and t > done]
        if after_commit:
            extra = len(after_commit)
            note("silent_reexecutions", f"{key}: executed at {min(after_commit):.0f}, after its outcome was "
                                        f"committed (by {done:.0f}; {tool_of.get(key, '?')})")
        if len(times) > 1:
            idempotent = tool_of.get(key) != "send_email"
            if not idempotent:
                if key not in unknown_outcomes and len(times) - 1 > extra:
                    extra = len(times) - 1
                    note("silent_reexecutions", f"{key}: non-idempotent call executed {len(times)}x, no OutcomeUnknown")
            elif not _fault_between(ev.faults, TOOL_FAULTS, min(times), max(times)) and len(times) - 1 > extra:
                extra = len(times) - 1
                note("silent_reexecutions", f"{key}: executed {len(times)}x with no gateway/broker/db fault between")
        granted = ev.ledger_attempts.get(key)
        if granted is not None and len(times) - granted > extra:
            extra = len(times) - granted
            note("silent_reexecutions", f"{key}: {len(times)} attempts at the sink, ledger granted {granted}")
        silent += extra

    unapproved = 0
    for key in mails:
        where = budgeted.get(key)
        if where is None:
            continue  # counted as silent above
        approvals = approved_calls.get(where, [])
        if not approvals:
            unapproved += mails[key]
            note("unapproved_effects", f"{key} ({where[0]} {where[1]}) emailed without an APPROVED decision")
            continue
        # The earliest moment any of its approvals can have been granted: the bot's first Decide call
        # for it (its own clock, read before the call), else the decision's decided_at_ms (run-api's
        # clock when the decision came in). The sink stamps a send when it receives it, in whole ms.
        asked = [ev.approval_asked_ms[a] for a in approvals if a in ev.approval_asked_ms]
        granted_from = int(min(asked)) if asked else min(decided_at[a] for a in approvals)
        early = [t for t in attempts[key] if t < granted_from]
        if early:
            unapproved += len(early)
            source = "the bot first asked to approve it" if asked else "its approval was decided"
            note("unapproved_effects", f"{key} ({where[0]} {where[1]}) emailed at {min(early):.0f}, before "
                                       f"{source} at {granted_from}")

    # -- model calls -------------------------------------------------------------------------------
    answers: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    checked_set = set(checked)
    for req in ev.model_requests:
        if req.get("status") != 200:
            continue
        headers = req.get("headers") or {}
        run_id = headers.get("x-tether-run")
        if run_id not in checked_set:
            continue
        answers[(run_id, headers.get("x-tether-step", ""), headers.get("x-tether-call", ""))].append(
            float(req.get("ts_ms", 0)))
    duplicate_models = 0
    redone_after_crash = 0
    for (run_id, step, call), times in answers.items():
        times.sort()
        done_at = model_done_at.get((run_id, int(step) if step.isdigit() else -1))
        for earlier, later in zip(times, times[1:], strict=False):
            committed_before = done_at is not None and done_at < later
            if committed_before or not _fault_between(ev.faults, MODEL_FAULTS, earlier, later):
                duplicate_models += 1
                note("duplicate_model_calls", f"run={run_id} step={step} call={call} answered again at {later:.0f}"
                     + (" after the step was in the log" if committed_before else " with no planner crash between"))
            else:
                redone_after_crash += 1

    duplicate_outcomes = 0
    for (run_id, step), n in per_step_models.items():
        if n > 1:
            duplicate_outcomes += n - 1
            note("duplicate_outcomes", f"run={run_id} step={step}: {n} ModelCallCompleted")
    for (run_id, call_id), n in per_call_outcomes.items():
        if n > 1:
            duplicate_outcomes += n - 1
            note("duplicate_outcomes", f"run={run_id} call={call_id}: {n} terminal outcomes")

    return {
        "runs": len(checked),
        "lost_runs": len(lost),
        "stuck_runs": len(stuck),
        "duplicate_effects": duplicate_effects,
        "silent_reexecutions": silent,
        "seq_gaps": len(problems),
        "duplicate_model_calls": duplicate_models,
        "duplicate_outcomes": duplicate_outcomes,
        "unapproved_effects": unapproved,
        "info": {
            "submitted": len(ev.submitted),
            "completed": sum(1 for r in checked if runs.get(r, _Run()).terminal == "tether.v1.RunCompleted"),
            "terminated": sum(1 for r in checked if runs.get(r, _Run()).terminal == "tether.v1.RunTerminated"),
            "waiting_on_human": waiting_on_human,
            # Runs in the log no client got an id for (a submit that gave up, then was produced by the
            # run-api's sweeper): counted in `runs` and checked like the others, but never lost.
            "runs_without_a_client": sum(1 for r, run in runs.items() if run.accepted and r not in ev.submitted),
            "events": len(ev.log),
            "effects": sum(len(t) for t in attempts.values()),
            "outcome_unknown_calls": len(unknown_outcomes),
            "model_calls_redone_after_a_crash": redone_after_crash,
            "faults": len(ev.faults),
        },
        "details": {k: v for k, v in details.items() if v},
    }


VIOLATIONS = ("lost_runs", "stuck_runs", "duplicate_effects", "silent_reexecutions", "seq_gaps",
              "duplicate_model_calls", "duplicate_outcomes", "unapproved_effects")


def violated(report: Mapping[str, Any]) -> list[str]:
    """The invariants with a non-zero count."""
    return [k for k in VIOLATIONS if report.get(k)]
