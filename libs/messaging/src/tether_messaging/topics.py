"""Names of Tether's topics (see docs/architecture.md). Declaration lives beside them."""

from __future__ import annotations

COMMANDS = "tether.commands.v1"
RUN_INTAKE = "tether.run-intake.v1"
RUN_EVENTS = "tether.run-events.v1"
DEAD_LETTERS = "tether.dead-letters.v1"


def changelog(service: str) -> str:
    """The compacted topic holding a service's per-run state checkpoints."""
    return f"tether.{service}.changelog.v1"
