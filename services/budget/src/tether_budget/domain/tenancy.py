"""The per-tenant ledger of one partition lane: concurrency slots, the tenant's queue, spend and token rate.

A tenant's runs land on its home partition (or its spread of N partitions), so the runs of
one lane are all handled by the budget instance that owns that partition. The tenant ledger
lives in the same state store as the run ledgers, under the key `tenant:<tenant_id>` (run
ids never contain ':'), and is checkpointed in the same transaction as the events its
decisions produced. Its limits are the lane's share of the tenant's totals, as carried by the
latest SubmitRun (`TenantLimits`).

Everything here is pure: decisions read the ledger and the recorded clock value `now_ms`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, model_validator

from tether_contracts.records import TenantLimits

TENANT_KEY_PREFIX = "tenant:"
MINUTE_MS = 60_000
#: Weight of the newest model call in the tenant's tokens-per-step estimate (the reservation a grant takes).
ESTIMATE_WEIGHT = 0.2


def tenant_key(tenant_id: str) -> str:
    """The state-store key of a tenant's ledger."""
    return f"{TENANT_KEY_PREFIX}{tenant_id}"


def is_tenant_key(key: str) -> bool:
    return key.startswith(TENANT_KEY_PREFIX)


def no_limits(limits: TenantLimits) -> bool:
    """Limits that limit nothing: runs submitted under them are not tracked in the tenant ledger
    (so a tenant without limits costs nothing here, however many runs it has)."""
    return not (limits.max_concurrent_runs > 0 or limits.spend_cap_usd_micros > 0 or limits.tokens_per_minute > 0)


class TenantLedger(BaseModel):
    """One tenant's ledger on one partition lane."""

    kind: Literal["tenant"] = Field("tenant", description="Tells the changelog codec this is not a run ledger.")
    tenant_id: str
    limits: TenantLimits = Field(default_factory=TenantLimits)
    running: int = Field(0, ge=0, description="Runs admitted and not ended: the slots in use. A count, not their ids "
                         "(each run's own ledger says whether it holds a slot), so a tenant's many parked runs do not "
                         "grow this ledger.")
    queue: list[str] = Field(default_factory=list, description="Runs waiting for a slot, first in line first.")
    deferred: list[str] = Field(default_factory=list, description="Runs whose next grant waits for the token rate.")
    spend_window_start_ms: int = 0
    spent_usd_micros: int = Field(0, description="Model spend in the current window.")
    spend_reserved_usd_micros: int = Field(0, ge=0, description="Expected cost of granted model calls that have "
                                           "not returned yet (checked with the spend against the cap).")
    step_cost_estimate: float = Field(0.0, description="Moving average of µUSD per model call.")
    last_step_cost: int = Field(0, ge=0, description="µUSD of the latest model call that cost something.")
    tokens: float | None = Field(None, description="Token bucket level (None = full); negative after overuse.")
    tokens_at_ms: int = 0
    step_tokens_estimate: float = Field(0.0, description="Moving average of tokens per model call.")
    last_step_tokens: int = Field(0, ge=0, description="Tokens of the latest model call that used any.")
    usage_samples: int = Field(0, ge=0, description="Model calls that reported a usage above zero on this lane. "
                               "At most this many grants (at least one) hold a reservation at a time: until one "
                               "was recorded the estimate is unknown, and one tiny sample must not open the gate "
                               "for many.")
    reservations_open: int = Field(0, ge=0, description="Grants holding a token reservation whose model call has "
                                   "not returned yet.")

    _touched: bool = PrivateAttr(False)

    @model_validator(mode="before")
    @classmethod
    def _count_listed_runs(cls, data: Any) -> Any:
        # Changelog records written before `running` became a count listed the runs' ids.
        if isinstance(data, dict) and isinstance(data.get("running"), list):
            data = {**data, "running": len(data["running"])}
        return data

    # -- bookkeeping ------------------------------------------------------------------------
    def clone(self) -> TenantLedger:
        """A working copy. Containers are copied (not their immutable items), so this stays cheap
        with thousands of queued runs; the loop keeps the committed object for undo."""
        copy = self.model_copy(update={"queue": list(self.queue), "deferred": list(self.deferred)})
        copy._touched = False
        return copy

    @property
    def touched(self) -> bool:
        """Whether a decision changed the ledger (so it must be checkpointed)."""
        return self._touched

    def touch(self) -> None:
        self._touched = True

    def apply_limits(self, limits: TenantLimits) -> None:
        """The latest submit's limits apply to the lane from now on."""
        if limits != self.limits:
            self.limits = limits
            self.touch()

    # -- concurrency and queue ----------------------------------------------------------------
    def has_free_slot(self) -> bool:
        cap = self.limits.max_concurrent_runs
        return cap <= 0 or self.running < cap

    def queue_full(self) -> bool:
        return len(self.queue) >= max(0, self.limits.max_queued_runs)

    def take_slot(self) -> None:
        """A run was admitted: it holds a slot until it ends (its ledger records that it does)."""
        self.running += 1
        self.touch()

    def enqueue(self, run_id: str) -> int:
        """Put the run at the back of the queue; returns its position (1 = next)."""
        if run_id not in self.queue:
            self.queue.append(run_id)
            self.touch()
        return self.queue.index(run_id) + 1

    def next_queued(self) -> str | None:
        """Take the first queued run if a slot is free (the caller admits or rejects it)."""
        if not self.queue or not self.has_free_slot():
            return None
        self.touch()
        return self.queue.pop(0)

    def release(self, run_id: str, *, held_slot: bool, reserved_tokens: int = 0, reserved_cost: int = 0) -> None:
        """The run ended (or was cancelled while queued): free its slot (if its ledger says it held
        one), its place and deferral, and give back a token reservation its granted step never used."""
        if held_slot and self.running > 0:
            self.running -= 1
            self.touch()
        for line in (self.queue, self.deferred):
            if run_id in line:
                line.remove(run_id)
                self.touch()
        if reserved_tokens or reserved_cost:
            self.reservations_open = max(0, self.reservations_open - 1)
            self.spend_reserved_usd_micros = max(0, self.spend_reserved_usd_micros - reserved_cost)
            if reserved_tokens and self.tokens is not None:
                self.tokens += reserved_tokens
            self.touch()

    # -- spend ----------------------------------------------------------------------------------
    def _roll_window(self, now_ms: int) -> None:
        window = self.limits.spend_window_ms
        if window <= 0:
            return
        start = now_ms - now_ms % window
        if start != self.spend_window_start_ms:
            self.spend_window_start_ms, self.spent_usd_micros = start, 0
            self.touch()

    def spend_breach(self, now_ms: int) -> str | None:
        """Why no more work may start for the tenant on this lane (its spend cap), or None."""
        cap = self.limits.spend_cap_usd_micros
        if cap <= 0:
            return None
        self._roll_window(now_ms)
        if self.spent_usd_micros < cap:
            return None
        window = self.limits.spend_window_ms
        period = f"in the current {window} ms window" if window > 0 else "in total"
        return f"tenant {self.tenant_id} spent {self.spent_usd_micros} of {cap} µUSD {period} on this partition lane"

    def _spent_at(self, now_ms: int) -> int:
        window = self.limits.spend_window_ms
        if window > 0 and now_ms - now_ms % window != self.spend_window_start_ms:
            return 0  # a new window (rolled when the ledger next changes)
        return self.spent_usd_micros

    def cost_reservation(self) -> int:
        """The µUSD a grant reserves under a spend cap: the moving average of a model call's or the
        latest call's, whichever is larger (at least 1)."""
        if self.limits.spend_cap_usd_micros <= 0:
            return 0
        return max(1, round(self.step_cost_estimate), self.last_step_cost)

    def _spend_held(self, now_ms: int) -> bool:
        # Under the cap, but the calls granted and not returned are expected to reach it: the
        # grant waits for their usage (it may be less) instead of spending past the cap on a
        # call per running run. At or over the cap by what was really spent, `spend_breach` stops it.
        cap = self.limits.spend_cap_usd_micros
        spent = self._spent_at(now_ms)
        return 0 < cap and spent < cap <= spent + self.spend_reserved_usd_micros

    # -- token rate -----------------------------------------------------------------------------
    def level_at(self, now_ms: int) -> float:
        """The bucket's level at `now_ms` without changing the ledger (inf without a rate cap)."""
        tpm = self.limits.tokens_per_minute
        if tpm <= 0:
            return float("inf")
        if self.tokens is None:
            return float(tpm)
        return min(float(tpm), self.tokens + max(0, now_ms - self.tokens_at_ms) * tpm / MINUTE_MS)

    def _refill(self, now_ms: int) -> float:
        level = self.level_at(now_ms)
        if self.limits.tokens_per_minute > 0 and (self.tokens != level or self.tokens_at_ms < now_ms):
            self.tokens, self.tokens_at_ms = level, max(now_ms, self.tokens_at_ms)
            self.touch()
        return level

    def rate_room(self, now_ms: int) -> float:
        """Tokens the tenant may still start model calls with now (inf without a rate cap)."""
        return self._refill(now_ms)

    def reservation(self) -> int:
        """The tokens a grant reserves: the moving average of a model call's or the latest call's,
        whichever is larger (at least 1), so calls growing past the average are reserved at once."""
        return max(1, round(self.step_tokens_estimate), self.last_step_tokens)

    def _limits_calls(self) -> bool:
        return self.limits.tokens_per_minute > 0 or self.limits.spend_cap_usd_micros > 0

    def _waits_for_first_usage(self) -> bool:
        # Until a model call's usage was recorded on the lane, a reservation says nothing about
        # what a call costs: a guessed default can be off by any factor, and N runs granted at
        # once on it overshoot the bucket N times over (50 runs on a 1,000-token bucket used
        # 250,000 tokens before the first usage arrived). One call at a time until the first
        # usage is recorded bounds the overshoot by that one call, which keeps the promise of
        # bursts of (about) one minute's worth; the price is the latency of one model call, once
        # per lane.
        # One sample is not much better: a 10-token first answer made every later reservation
        # 10 tokens and let 29 grants through at once. So no more grants hold a reservation
        # than calls have reported usage (slow start: each returned call lets one more go), and
        # a call that reported none (a provider error) is no sample.
        # The same holds for the spend cap's cost reservations.
        return self._limits_calls() and self.reservations_open >= max(1, self.usage_samples)

    def _needed(self) -> float:
        # A call larger than a minute's worth still goes once the bucket is full, or never would.
        return float(min(self.reservation(), self.limits.tokens_per_minute))

    def grant_wait(self, now_ms: int) -> str | None:
        """Why a grant must wait now (TENANT_TOKEN_RATE, TENANT_SPEND_CAP), or None: the bucket
        must hold at least the reservation (so grants never draw it below zero on an estimate),
        the spend plus the reservations of calls in flight must be under the cap, and while the
        lane's usage per call is unknown no other grant may hold a reservation. Read-only."""
        rate = "TENANT_TOKEN_RATE" if self.limits.tokens_per_minute > 0 else "TENANT_SPEND_CAP"
        if self._waits_for_first_usage():
            return rate
        if self.limits.tokens_per_minute > 0 and self.level_at(now_ms) < self._needed():
            return "TENANT_TOKEN_RATE"
        if self._spend_held(now_ms):
            return "TENANT_SPEND_CAP"
        return None

    def rate_allows(self, now_ms: int) -> bool:
        """Whether a grant may take its reservations now (`grant_wait` has no reason). Read-only."""
        return self.grant_wait(now_ms) is None

    def refill_at(self, now_ms: int) -> int:
        """When a deferred grant may go: the bucket holds its reservation again and the spend is not
        held (at the latest, the spend window's end). An estimate recorded with a deferral; `now_ms`
        while the grant waits for a record no clock can tell of (the lane's first usage, or the
        usage of the calls in flight while their reservations alone reach the cap)."""
        due = self._due_at()
        return now_ms if due is None else max(now_ms, due)

    def _due_at(self) -> int | None:
        # A grant goes once both hold: the bucket has the reservation, and the spend is not held.
        if self._waits_for_first_usage():
            return None
        due = self._bucket_due_at()
        # The spend is judged at the latest clock value the ledger recorded (not at the bucket's
        # time alone: on a lane without a token rate that stays 0, a window long gone), so the
        # answer holds for every later clock value until the ledger changes.
        at = max(self.tokens_at_ms, self.spend_window_start_ms)
        if self._spend_held(at):
            window = self.limits.spend_window_ms
            if window <= 0 or self.spend_reserved_usd_micros >= self.limits.spend_cap_usd_micros:
                return None  # held in every window: only the usage of the calls in flight (records) frees it
            due = max(due, at - at % window + window)  # the next window starts with nothing spent
        return due

    def _bucket_due_at(self) -> int:
        tpm = self.limits.tokens_per_minute
        if tpm <= 0 or self.tokens is None:
            return 0
        need = self._needed()
        if self.tokens >= need:
            return 0
        # level_at(now) >= need  ⇔  now - tokens_at_ms >= (need - tokens) * MINUTE_MS / tpm
        return self.tokens_at_ms + math.ceil((need - self.tokens) * MINUTE_MS / tpm)

    def reserve(self, now_ms: int) -> tuple[int, int]:
        """A grant takes the expected tokens of one model call from the bucket and its expected
        cost from the spend cap's room (each at least 1, under its limit); the real usage replaces
        the reservations when it is recorded. Returns (tokens, µUSD) reserved."""
        if not self._limits_calls():
            return 0, 0
        tokens = 0
        if self.limits.tokens_per_minute > 0:
            self._refill(now_ms)
            tokens = self.reservation()
            self.tokens = (self.tokens or 0.0) - tokens
        cost = self.cost_reservation()
        self.spend_reserved_usd_micros += cost
        self.reservations_open += 1
        self.touch()
        return tokens, cost

    def defer(self, run_id: str) -> None:
        if run_id not in self.deferred:
            self.deferred.append(run_id)
            self.touch()

    def deferred_due_at(self) -> int | None:
        """The earliest clock value at which deferred grants may go (`rate_allows`), or None
        without deferred runs or while they wait for the lane's first usage (a record, not the
        clock, ends that wait): the loop's timer index for the tenant ledger."""
        if not self.deferred:
            return None
        return self._due_at()

    def next_deferred(self, now_ms: int) -> str | None:
        """Take the run deferred longest ago if the bucket has room for its grant again."""
        if not self.deferred or not self.rate_allows(now_ms):
            return None
        self.touch()
        return self.deferred.pop(0)

    # -- usage ----------------------------------------------------------------------------------
    def record_usage(self, tokens: int, cost_usd_micros: int, *, reserved_tokens: int, now_ms: int,
                     reserved_cost: int = 0) -> None:
        """A model call's usage was recorded for one of the tenant's runs on this lane (a negative
        count as 0: usage never gives spend or tokens back)."""
        tokens, cost_usd_micros = max(0, tokens), max(0, cost_usd_micros)
        self._roll_window(now_ms)
        self.spent_usd_micros += cost_usd_micros
        if self.limits.tokens_per_minute > 0:
            self._refill(now_ms)
            self.tokens = (self.tokens or 0.0) + reserved_tokens - tokens
        if reserved_tokens or reserved_cost:
            self.reservations_open = max(0, self.reservations_open - 1)
            self.spend_reserved_usd_micros = max(0, self.spend_reserved_usd_micros - reserved_cost)
        if tokens > 0 or cost_usd_micros > 0:
            self.usage_samples += 1
        if cost_usd_micros > 0:
            self.last_step_cost = cost_usd_micros
            self.step_cost_estimate = (
                float(cost_usd_micros) if self.step_cost_estimate <= 0
                else (1 - ESTIMATE_WEIGHT) * self.step_cost_estimate + ESTIMATE_WEIGHT * cost_usd_micros
            )
        if tokens > 0:
            self.last_step_tokens = tokens
            self.step_tokens_estimate = (
                float(tokens) if self.step_tokens_estimate <= 0
                else (1 - ESTIMATE_WEIGHT) * self.step_tokens_estimate + ESTIMATE_WEIGHT * tokens
            )
        self.touch()
