"""The per-run ledger: what the budget service knows about a run, checkpointed after every batch.

It is a fold over the run's events: caps and deadline, the chain position (seq, last hash),
cumulative usage, the current step and the tool calls with their status, the event ids
already sequenced, the loop guard's memory. It is checkpointed whole after every record, so its
size must not grow with the run: the calls and event ids of steps older than `DETAIL_STEPS` are
folded into counters (`FoldedCalls`), and records of those steps are dropped as stale. After the
run ends the ledger is kept in full for a while, then shrunk to a tombstone that still
recognises late duplicates, then forgotten.
The per-tenant ledger of a partition lane (concurrency, queue, spend, token rate) lives beside
it in the same state store under the key `tenant:<tenant_id>` (domain/tenancy.py).
"""

from __future__ import annotations

import copy
import hashlib
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tether_budget.domain.loopguard import CURRENT_RULES, CallSignature, LoopGuardState, call_signature
from tether_contracts.records import Caps, Usage

GENESIS_HASH = "0" * 64  # prev_hash of a run's first event (tether_messaging.chain.GENESIS_HASH)

# Finished steps whose calls and event ids the ledger keeps in detail (besides the current one).
# Nothing decides on older ones: the loop guard keeps its own window of step signatures, and a
# record of a folded step is dropped (`Ledger.is_stale`). Detail costs ~0.5 kB per one-call step.
DETAIL_STEPS = 16
LAST_ERROR_CHARS = 1_000  # `last_error` is cut to this many characters (marker included)


class RunStatus(StrEnum):
    QUEUED = "QUEUED"  # waiting in the tenant's queue for a concurrency slot; nothing granted yet
    ACTIVE = "ACTIVE"
    COMPLETED = "COMPLETED"
    TERMINATED = "TERMINATED"
    REJECTED = "REJECTED"


class CallStatus(StrEnum):
    """Where a tool call is; the terminal ones let the step finish."""

    NOT_BUDGETED = "NOT_BUDGETED"  # requested when a cap was hit; never ran
    BUDGETED = "BUDGETED"  # the gateway may decide and execute
    APPROVAL_PENDING = "APPROVAL_PENDING"  # waiting for a human (gateway asked)
    APPROVED = "APPROVED"  # approved; the gateway executes next
    DECLINED = "DECLINED"  # approval rejected or expired; the gateway denies next
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # non-idempotent call interrupted; waiting for a human
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    DENIED = "DENIED"
    RESOLVED = "RESOLVED"  # outcome unknown, and a human let the run continue


TERMINAL = frozenset({CallStatus.COMPLETED, CallStatus.FAILED, CallStatus.DENIED, CallStatus.RESOLVED})
NEVER_RAN = frozenset({CallStatus.NOT_BUDGETED})
WAITING_FOR_HUMAN = frozenset({CallStatus.APPROVAL_PENDING, CallStatus.OUTCOME_UNKNOWN})


class Reason(StrEnum):
    """Reason codes of RunTerminated / RunRejected (TerminationReport.reason_code)."""

    STEP_CAP = "STEP_CAP"
    TOKEN_CAP = "TOKEN_CAP"
    COST_CAP = "COST_CAP"
    WALL_CLOCK_CAP = "WALL_CLOCK_CAP"
    TOOL_CALL_CAP = "TOOL_CALL_CAP"
    LOOP_DETECTED = "LOOP_DETECTED"
    CANCELLED = "CANCELLED"
    MODEL_FAILED = "MODEL_FAILED"
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"
    APPROVAL_TIMEOUT = "APPROVAL_TIMEOUT"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # a human declined to continue after an unknown outcome
    INVALID_CAPS = "INVALID_CAPS"
    CAPS_ABOVE_CEILING = "CAPS_ABOVE_CEILING"
    INVALID_TOOLS = "INVALID_TOOLS"
    TENANT_QUEUE_FULL = "TENANT_QUEUE_FULL"  # the tenant's queue on the lane is full
    TENANT_CONCURRENCY_CAP = "TENANT_CONCURRENCY_CAP"  # at the cap and the tenant has no queue
    TENANT_SPEND_CAP = "TENANT_SPEND_CAP"  # the tenant's spend on the lane reached its cap


class ToolFacts(BaseModel):
    """What the ledger keeps of a tool snapshot from RunAccepted."""

    model_config = ConfigDict(frozen=True)

    pollable: bool = False
    idempotent: bool = True
    risk_class: str = "READ_ONLY"


class CallEntry(BaseModel):
    """One tool call of the run. Frozen: a change replaces the entry (`Ledger.update_call`), so a
    working copy of the ledger can share the entries of the committed one.

    Sized for a checkpoint written after every record: an entry keeps the call's arguments only
    while the call is open, and never its result text. A finished call keeps its loop-guard
    signature (hashes and excerpts of at most `EXCERPT_CHARS`) until its step is signed."""

    model_config = ConfigDict(frozen=True)

    call_id: str
    step: int
    call_index: int
    idem_key: str
    tool_name: str
    args_hash: str = Field(description="SHA-256 of args_json; approvals and authorizations are bound to it.")
    args_json: str | None = Field(None, description="Arguments as requested, while the call is open (None after).")
    status: CallStatus
    approval_id: str | None = None
    signature: CallSignature | None = Field(
        None, description="The finished call's signature (result hashed, not kept), until its step is signed."
    )
    error: str | None = Field(None, description="Error class: error code, or denied:<reason>.")

    @model_validator(mode="before")
    @classmethod
    def _hash_of_args(cls, data: Any) -> Any:
        # Written before args_hash was kept: every entry had its args_json.
        if isinstance(data, dict) and "args_hash" not in data and isinstance(data.get("args_json"), str):
            data = {**data, "args_hash": args_hash(data["args_json"])}
        return data


def args_hash(args_json: str) -> str:
    """The hash tool calls carry and approvals are bound to: lowercase hex SHA-256 of args_json."""
    return hashlib.sha256(args_json.encode()).hexdigest()


def _from_full_texts(data: dict[str, Any]) -> dict[str, Any]:
    """The calls of a checkpoint written before the ledger dropped texts: every call had its
    args_json, a finished one its `observation` (result JSON or error text). A finished call of
    a step not yet signed gets the signature its step will be signed with (as `_sign_step`
    would have made it from those texts); every finished call loses both texts."""
    # An active run's current step is signed when its last call finishes, and then replaced by
    # the next step's, unless the next grant waits for the tenant's token rate.
    current = data.get("current")
    unsigned = data.get("status", RunStatus.ACTIVE) == RunStatus.ACTIVE and data.get("deferred_step") is None
    current_ids = current.get("call_ids", []) if isinstance(current, dict) and unsigned else []
    tools = data.get("tools") or {}
    loop = data.get("loop")
    rules = loop.get("rules", 1) if isinstance(loop, dict) else getattr(loop, "rules", 1)

    def pollable(tool_name: str) -> bool:
        facts = tools.get(tool_name)
        return bool(facts.get("pollable")) if isinstance(facts, dict) else getattr(facts, "pollable", False)

    calls = {}
    for call_id, call in data["calls"].items():
        if isinstance(call, dict) and ("observation" in call or "args_hash" not in call):
            call = dict(call)
            observation = call.pop("observation", None)
            args = call.get("args_json")
            if call.get("status") in TERMINAL | NEVER_RAN and isinstance(args, str):
                call["args_json"] = None
                call.setdefault("args_hash", args_hash(args))
                if call["status"] in TERMINAL and call_id in current_ids and call.get("signature") is None:
                    call["signature"] = call_signature(
                        call["tool_name"], args, observation=observation or "", error=call.get("error"),
                        pollable=pollable(call["tool_name"]), rules=rules,
                    )
        calls[call_id] = call
    return calls


def capped_error(text: str) -> str:
    """`text` cut to `LAST_ERROR_CHARS`, with a marker saying how much was cut: an error detail
    can be any size, and the ledger carrying it is checkpointed after every record."""
    if len(text) <= LAST_ERROR_CHARS:
        return text
    marker = f"… [truncated, {len(text)} chars in all]"
    return text[: LAST_ERROR_CHARS - len(marker)] + marker


class FoldedCalls(BaseModel):
    """The finished calls of steps up to `through_step`, folded into counters: all the
    termination report still says of them (`report.py`)."""

    through_step: int = Field(0, description="Steps up to this one are folded (their records are stale).")
    count: int = 0
    outcomes: dict[str, int] = Field(
        default_factory=dict, description="Calls per '<tool_name> <status>', in order of first occurrence."
    )

    def add(self, call: CallEntry) -> None:
        key = f"{call.tool_name} {call.status}"
        self.count += 1
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def summary(self) -> str:
        """One line of the report's done list, standing for the folded calls."""
        outcomes = ", ".join(f"{key} ×{n}" for key, n in self.outcomes.items())
        return f"{self.count} earlier call(s) of steps 1–{self.through_step}: {outcomes}"


class StepEntry(BaseModel):
    """The step currently granted."""

    step: int
    granted_at_ms: int
    model_done: bool = False
    tool_call_count: int | None = None
    call_ids: list[str] = Field(default_factory=list)
    text_hash: str | None = None


class Ledger(BaseModel):
    """The run's ledger (one per run, keyed by run id in the budget's state store)."""

    run_id: str
    tenant_id: str
    principal_id: str
    request_id: str
    partition: int
    submit_event_id: str
    status: RunStatus = RunStatus.ACTIVE
    caps: Caps | None = None
    accepted_at_ms: int = 0
    deadline_ms: int = 0
    human_wait_ms: int = Field(0, description="Time spent waiting for humans; it extends the deadline.")
    waiting_since_ms: int | None = None

    seq: int = 0
    last_hash: str = GENESIS_HASH
    seen_event_ids: dict[str, int] = Field(
        default_factory=dict, description="Event ids sequenced for the run (of unfolded steps), with the step then."
    )

    usage: Usage = Field(default_factory=Usage)
    step: int = Field(0, description="Last step granted.")
    steps_done: int = Field(0, description="Model calls that returned (completed or failed).")
    current: StepEntry | None = None
    calls: dict[str, CallEntry] = Field(default_factory=dict, description="Tool calls of steps not folded.")
    folded: FoldedCalls = Field(default_factory=FoldedCalls, description="The calls of older steps, counted.")
    tool_calls_budgeted: int = 0
    tools: dict[str, ToolFacts] = Field(default_factory=dict)
    loop: LoopGuardState = Field(default_factory=LoopGuardState)
    pending_warning: str | None = Field(None, description="Loop warning to give with the next grant.")
    last_error: str | None = None

    # -- tenancy (domain/tenancy.py) --------------------------------------------------------
    tenant_tracked: bool = Field(False, description="The submit carried tenant limits: the run holds a tenant slot.")
    holds_tenant_slot: bool = Field(
        False, description="Admitted under tenant limits and not ended: one of the tenant ledger's `running` slots."
    )
    queued_at_ms: int | None = None
    queued_submit: dict[str, Any] | None = Field(
        None, description="The SubmitRun datum of a queued run, to accept it when a slot frees."
    )
    deferred_step: int | None = Field(None, description="Step whose grant waits for the tenant's token rate or spend cap (StepDeferred says which).")
    rate_reserved: int = Field(0, description="Tokens the granted step reserved from the tenant's bucket.")
    spend_reserved: int = Field(0, description="µUSD the granted step reserved under the tenant's spend cap.")

    ended_at_ms: int | None = None
    end_reason: str | None = None
    tombstoned: bool = False

    @model_validator(mode="before")
    @classmethod
    def _slot_of_listed_run(cls, data: Any) -> Any:
        # Written before the flag existed: then an open, admitted, tracked run was listed in its
        # tenant ledger's `running` (now a count of them), so it holds a slot.
        if isinstance(data, dict) and "holds_tenant_slot" not in data:
            data = {**data, "holds_tenant_slot": bool(data.get("tenant_tracked"))
                    and data.get("status", RunStatus.ACTIVE) == RunStatus.ACTIVE}
        return data

    @model_validator(mode="before")
    @classmethod
    def _loop_rules_of_old_checkpoint(cls, data: Any) -> Any:
        # Written before the loop guard's rules were versioned: the run was signed and judged by
        # the rules then released (v1), and keeps them; a queued run has signed nothing yet and
        # takes the current rules when it is accepted.
        loop = data.get("loop") if isinstance(data, dict) else None
        if isinstance(loop, dict) and "rules" not in loop:
            queued = data.get("status", RunStatus.ACTIVE) == RunStatus.QUEUED
            data = {**data, "loop": {**loop, "rules": CURRENT_RULES if queued else 1}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _calls_without_texts(cls, data: Any) -> Any:
        # Written before finished calls dropped their texts (a ledger could outgrow a message).
        if isinstance(data, dict) and isinstance(data.get("calls"), dict):
            data = {**data, "calls": _from_full_texts(data)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _event_ids_with_steps(cls, data: Any) -> Any:
        # Written before the ids had their step (a set, kept for the whole run): they count as
        # sequenced at the step then granted, so they are forgotten `DETAIL_STEPS` steps later.
        if isinstance(data, dict) and isinstance(data.get("seen_event_ids"), list | set | frozenset):
            step = data.get("step", 0)
            data = {**data, "seen_event_ids": dict.fromkeys(data["seen_event_ids"], step)}
        return data

    # -- copies -----------------------------------------------------------------------------
    def clone(self) -> Ledger:
        """A working copy for handling one record: the loop keeps the committed ledger to undo an
        aborted batch, and a refused record must leave it untouched.

        Copies what the domain changes in place (the containers, the current step, the loop
        guard's memory) and shares the rest: frozen models (call entries, tool facts, records)
        are replaced when they change, never changed. Pointer copies of the containers, not a
        deep copy of every entry (which cost ~0.2 ms per record for a 4-step run, growing with
        the run). `tests/test_ledger_copy.py` checks that the copy shares nothing mutable."""
        cur = self.current
        return self.model_copy(
            update={
                "seen_event_ids": dict(self.seen_event_ids),
                "calls": dict(self.calls),
                "folded": self.folded.model_copy(update={"outcomes": dict(self.folded.outcomes)}),
                "tools": dict(self.tools),
                "current": None if cur is None else cur.model_copy(update={"call_ids": list(cur.call_ids)}),
                "loop": self.loop.clone(),
                # Only a queued run has one (a plain Avro datum, nested dicts and lists).
                "queued_submit": copy.deepcopy(self.queued_submit),
            }
        )

    def update_call(self, call: CallEntry, **changes: Any) -> CallEntry:
        """Replace a call's (frozen) entry with a copy that has `changes`; returns the new entry."""
        updated = call.model_copy(update=changes)
        self.calls[call.call_id] = updated
        return updated

    # -- chain ----------------------------------------------------------------------------
    def record_appended(self, event_id: str, seq: int, hash_: str) -> None:
        """Note that an event was appended to the run's log at `seq` with `hash_`."""
        self.seq, self.last_hash = seq, hash_
        if not self.tombstoned:
            self.seen_event_ids[event_id] = self.step

    # -- folding old steps -----------------------------------------------------------------
    def fold_old_steps(self) -> None:
        """After a step is finished: fold the finished calls of steps more than `DETAIL_STEPS`
        before the last one granted into `folded`, and forget their event ids. Catches up on
        all of them at once (a checkpoint written before folding)."""
        through = self.step - DETAIL_STEPS
        if through <= self.folded.through_step:
            return
        for call_id, call in list(self.calls.items()):
            if call.step <= through and call.status in TERMINAL | NEVER_RAN:
                self.folded.add(call)
                del self.calls[call_id]
        self.seen_event_ids = {e: s for e, s in self.seen_event_ids.items() if s > through}
        self.folded.through_step = through

    def is_stale(self, step: int) -> bool:
        """A record of a folded step: it was sequenced before (its id is forgotten) or it is
        refused; either way nothing is appended. Steps start at 1: a record of step 0 or below
        was never granted, and is refused as a mismatch instead (dead-lettered, not dropped)."""
        return 0 < step <= self.folded.through_step

    # -- derived facts --------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.status is RunStatus.ACTIVE

    @property
    def queued(self) -> bool:
        return self.status is RunStatus.QUEUED

    @property
    def open(self) -> bool:
        """Queued or active: the run holds a place in its tenant's ledger."""
        return self.status in (RunStatus.QUEUED, RunStatus.ACTIVE)

    @property
    def tokens_used(self) -> int:
        return self.usage.input_tokens + self.usage.output_tokens

    @property
    def waiting_for_human(self) -> bool:
        return any(c.status in WAITING_FOR_HUMAN for c in self.calls.values())

    def deadline_at(self, now_ms: int) -> int:
        """The deadline with the time spent waiting for humans added (a wait in progress counts up to now)."""
        waiting = now_ms - self.waiting_since_ms if self.waiting_since_ms is not None else 0
        return self.deadline_ms + self.human_wait_ms + max(0, waiting)

    def step_calls(self) -> list[CallEntry]:
        if self.current is None:
            return []
        return [self.calls[c] for c in self.current.call_ids]

    def step_finished(self) -> bool:
        """Every call of the current step has been requested and has a terminal outcome."""
        cur = self.current
        if cur is None or not cur.model_done or not cur.tool_call_count:
            return False
        calls = self.step_calls()
        return len(calls) == cur.tool_call_count and all(c.status in TERMINAL for c in calls)

    def track_human_wait(self, now_ms: int) -> None:
        """Start or stop the human-wait clock after a call's status changed."""
        if self.waiting_for_human and self.waiting_since_ms is None:
            self.waiting_since_ms = now_ms
        elif not self.waiting_for_human and self.waiting_since_ms is not None:
            self.human_wait_ms += max(0, now_ms - self.waiting_since_ms)
            self.waiting_since_ms = None

    def add_usage(self, usage: Usage) -> None:
        """Count a model call's usage; a negative count is counted as 0 (it would give caps back:
        a first usage of -5,000 left 6,000 tokens on a 1,000 cap). The record is still appended as
        it came, and the handler reports the anomaly (`negative_usage_fields`)."""
        self.usage = Usage(
            input_tokens=self.usage.input_tokens + max(0, usage.input_tokens),
            output_tokens=self.usage.output_tokens + max(0, usage.output_tokens),
            cost_usd_micros=self.usage.cost_usd_micros + max(0, usage.cost_usd_micros),
        )

    def end(self, status: RunStatus, reason: str, now_ms: int) -> None:
        if self.waiting_since_ms is not None:
            self.human_wait_ms += max(0, now_ms - self.waiting_since_ms)
            self.waiting_since_ms = None
        self.status, self.end_reason, self.ended_at_ms = status, reason, now_ms
        self.pending_warning = None
        self.queued_submit = None
        self.deferred_step = None

    def tombstone(self) -> None:
        """Shrink an ended ledger to what late records can still touch: the chain position and
        the calls (and model call) still open when the run ended. Late duplicates of anything
        else are recognised because nothing else is open."""
        self.calls = {k: c for k, c in self.calls.items() if c.status not in TERMINAL | NEVER_RAN}
        if self.current is not None:
            self.current.call_ids = [c for c in self.current.call_ids if c in self.calls]
        self.seen_event_ids = {}
        self.folded = FoldedCalls()
        self.loop = LoopGuardState()
        self.tools = {}
        self.tombstoned = True


def negative_usage_fields(usage: Usage | None) -> list[str]:
    """The fields of a reported usage below zero (a protocol anomaly: counted as 0, not dead-lettered,
    since the record is a fact the run's log must keep)."""
    if usage is None:
        return []
    return [name for name in ("input_tokens", "output_tokens", "cost_usd_micros") if getattr(usage, name) < 0]
