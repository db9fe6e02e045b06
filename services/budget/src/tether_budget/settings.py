"""The budget service's settings (env prefix TETHER_BUDGET_; shared infrastructure from TETHER_*)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tether_runtime.settings import CapCeilingSettings, LoopServiceSettings


class BudgetSettings(LoopServiceSettings, CapCeilingSettings):
    """Everything `python -m tether_budget` reads from the environment."""

    model_config = SettingsConfigDict(env_prefix="TETHER_BUDGET_", extra="ignore", populate_by_name=True)

    declare_topics: bool = Field(True, description="Create missing topics at start-up (idempotent).")

    # The ceilings on the caps a run may ask for (ceiling_max_*, TETHER_BUDGET_CEILING_*) come from
    # CapCeilingSettings, which run-api reads too.

    # -- loop detection (safety notes §C4) ------------------------------------------------
    loop_repeat_n: int = Field(4, ge=2, description="R1: identical (action, result) steps in a row.")
    loop_error_n: int = Field(3, ge=2, description="R2: identical (action, error) steps in a row.")
    loop_denial_n: int = Field(3, ge=1, description="R2b: denials of the same action in a run.")
    loop_monologue_n: int = Field(3, ge=2, description="R3: text-only turns in a row.")
    loop_cycle_repeats: int = Field(3, ge=2, description="R4: repetitions of a 2-, 3- or 4-step cycle.")
    loop_novelty_window: int = Field(12, ge=2, description="R5: tool steps without any new (action, result).")
    loop_poll_budget: int = Field(20, ge=0, description="Repeats of a pollable tool's step that are not counted.")

    # -- retention of ended runs ----------------------------------------------------------
    ended_ledger_retention_ms: int = Field(
        3_600_000, ge=0, description="How long an ended run's full ledger is kept before it shrinks to a tombstone."
    )
    tombstone_retention_ms: int = Field(
        8 * 24 * 3_600_000,
        ge=0,
        description="How long a tombstone is kept; must outlive the intake topic's 7-day retention.",
    )
