"""Names of Tether's topics (see docs/architecture.md). Declaration lives beside them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

COMMANDS = "tether.commands.v1"
RUN_INTAKE = "tether.run-intake.v1"
RUN_EVENTS = "tether.run-events.v1"
DEAD_LETTERS = "tether.dead-letters.v1"

DAY_MS = 24 * 60 * 60 * 1000


def changelog(service: str) -> str:
    """The compacted topic holding a service's per-run state checkpoints."""
    return f"tether.{service}.changelog.v1"


@dataclass(frozen=True)
class TopicSpec:
    """How a topic is declared: its name and the broker configs it is created with."""

    name: str
    config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Topics:
    """Topic names under an optional prefix (``TETHER_TOPIC_PREFIX``), so tests can isolate them.

    Services take their topic names from one instance of this (built from settings) rather
    than the module constants, which are the unprefixed production names.
    """

    prefix: str = ""

    @property
    def commands(self) -> str:
        return self.prefix + COMMANDS

    @property
    def run_intake(self) -> str:
        return self.prefix + RUN_INTAKE

    @property
    def run_events(self) -> str:
        return self.prefix + RUN_EVENTS

    @property
    def dead_letters(self) -> str:
        return self.prefix + DEAD_LETTERS

    def changelog(self, service: str) -> str:
        return self.prefix + changelog(service)

    def group_id(self, service: str) -> str:
        """Consumer group of a service (the prefix isolates tests' groups too)."""
        return self.prefix + service

    def specs(self, services: Iterable[str]) -> list[TopicSpec]:
        """Every topic with its configs: the shared topics plus one changelog per service."""
        seven_days = str(7 * DAY_MS)
        specs = [
            TopicSpec(self.commands, {"cleanup.policy": "delete", "retention.ms": seven_days}),
            TopicSpec(self.run_intake, {"cleanup.policy": "delete", "retention.ms": seven_days}),
            # The run event log is the source of truth: kept forever, never compacted.
            TopicSpec(self.run_events, {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}),
            TopicSpec(self.dead_letters, {"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)}),
        ]
        for service in services:
            # Only the latest checkpoint per run matters; tombstones of finished runs go after a day.
            specs.append(
                TopicSpec(
                    self.changelog(service),
                    {"cleanup.policy": "compact", "delete.retention.ms": str(DAY_MS), "min.compaction.lag.ms": "0"},
                )
            )
        return specs
