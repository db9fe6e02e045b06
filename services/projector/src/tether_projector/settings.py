"""The projector's settings (env prefix TETHER_PROJECTOR_; shared infrastructure from TETHER_*)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tether_messaging.topics import Topics
from tether_runtime.settings import LoopServiceSettings

DAY_S = 24 * 3600


class ProjectorSettings(LoopServiceSettings):
    """Everything `python -m tether_projector` reads from the environment."""

    model_config = SettingsConfigDict(env_prefix="TETHER_PROJECTOR_", extra="ignore", populate_by_name=True)

    declare_topics: bool = Field(True, description="Create missing topics at start-up (idempotent).")
    events_topic: str = Field(
        "", description="The run event log to project; empty = the run-events topic under TETHER_TOPIC_PREFIX."
    )
    read_model_schema: str = Field(
        "read_model",
        pattern=r"^[a-z_][a-z0-9_]{0,50}$",
        description="PostgreSQL schema of the read model (a rebuild stages it in '<schema>__rebuild').",
    )
    redis_key_prefix: str = Field("", description="Prepended to every Redis key (isolates tests).")
    stream_maxlen: int = Field(10_000, ge=100, description="Approximate cap on entries in a run's live stream.")
    live_ttl_s: int = Field(
        30 * DAY_S, ge=60, description="Lifetime of a live run's Redis keys, renewed by each of its events."
    )
    ended_ttl_s: int = Field(DAY_S, ge=1, description="How long an ended run's Redis keys stay after its last event.")
    read_model_attempts: int = Field(
        8, ge=1, description="Attempts at a read-model transaction while PostgreSQL is unavailable before exiting."
    )
    rebuild_batch: int = Field(2_000, ge=1, description="Events per read-model transaction during a rebuild.")
    rebuild_idle_timeout_s: float = Field(
        300.0, gt=0,
        description="A rebuild fails (STALLED) after reading nothing for this long; its total duration is not limited.",
    )

    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    def input_topic(self) -> str:
        """The topic the projector consumes."""
        return self.events_topic or self.topics().run_events
