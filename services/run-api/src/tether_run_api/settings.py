"""The run-api's settings (env prefix TETHER_RUN_API_; infrastructure from the shared TETHER_* names)."""

from __future__ import annotations

import os

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import SettingsConfigDict

from tether_runtime.settings import CapCeilingSettings, ServiceSettings

MIB = 1024 * 1024
SELF_APPROVAL_NAME = "TETHER_FORBID_SELF_APPROVAL"
OLD_SELF_APPROVAL_NAME = "TETHER_RUN_API_FORBID_SELF_APPROVAL"


class RunApiSettings(ServiceSettings, CapCeilingSettings):
    """Everything the run-api's composition root needs; read once, in tether_run_api.__main__.

    The caps ceilings (ceiling_max_*) are the budget service's, read from its TETHER_BUDGET_CEILING_*
    names, so an agent or a submit the budget would reject CAPS_ABOVE_CEILING is refused here first.
    """

    model_config = SettingsConfigDict(env_prefix="TETHER_RUN_API_", extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", description="gRPC listen address (loopback unless deployed).")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 = ephemeral.")
    grpc_workers: int = Field(64, ge=4, description="Threads serving RPCs (each open event stream holds one).")
    max_streams: int = Field(32, ge=1, description="Concurrent StreamRunEvents calls; more get RESOURCE_EXHAUSTED.")
    max_streams_per_tenant: int = Field(
        0,
        ge=0,
        description="Concurrent StreamRunEvents calls of one tenant on this replica, so one tenant watching many "
        "long runs cannot starve the others of MAX_STREAMS; more get RESOURCE_EXHAUSTED / TENANT_TOO_MANY_STREAMS. "
        "0 = a quarter of MAX_STREAMS (at least 1); capped at MAX_STREAMS.",
    )
    max_request_bytes: int = Field(MIB, ge=1024, description="Largest request handled (REQUEST_TOO_LARGE above).")
    max_receive_message_bytes: int = Field(
        4 * MIB, ge=1024, description="gRPC transport ceiling; larger messages are refused before any handler runs."
    )
    max_send_message_bytes: int = Field(16 * MIB, ge=1024, description="Largest response (traces can be big).")
    max_goal_chars: int = Field(32_000, ge=1, description="Longest goal a run may have.")
    max_trace_events: int = Field(10_000, ge=1, description="Most events one GetRunTrace returns.")
    submit_rate_per_s: float = Field(20.0, gt=0, description="Per-tenant submit rate of this replica.")
    submit_burst: int = Field(40, ge=1, description="Per-tenant submit burst of this replica.")
    admission_refresh_ms: int = Field(
        250, ge=0, description="How often a tenant's backlog (queued + running runs) is re-read for the door's check."
    )
    admission_unprojected_window_s: float = Field(
        60.0, gt=0, description="Submits this recent that the read model does not show yet count in the backlog."
    )
    tenant_queue_full_retry_s: float = Field(
        2.0, gt=0, description="RetryInfo of a TENANT_QUEUE_FULL refusal."
    )
    auth_cache_s: float = Field(10.0, ge=0, description="How long a key lookup is cached (revocation delay).")
    pg_schema: str = Field("run_api", description="PostgreSQL schema of the catalog, keys and submit ledger.")
    read_model_schema: str = Field("read_model", description="The projector's read model schema.")
    pg_pool_size: int = Field(16, ge=1, description="PostgreSQL connections.")
    live_key_prefix: str = Field("", description="Prefix of the projector's Redis Stream keys.")
    stream_block_ms: int = Field(1000, ge=10, description="Longest wait on the live feed before polling the read model.")
    stream_gap_wait_s: float = Field(5.0, gt=0, description="How long a seq seen live may be missing from the read model.")
    delivery_timeout_ms: int = Field(10_000, ge=1000, description="How long a command may wait for Kafka's ack.")
    redeliver_after_s: float = Field(
        30.0, gt=0, description="Age after which an unacknowledged submit is produced again by the sweeper."
    )
    redeliver_interval_s: float = Field(5.0, gt=0, description="How often the sweeper looks for them.")
    forbid_self_approval: bool = Field(
        True,
        validation_alias=AliasChoices(SELF_APPROVAL_NAME),
        description="Refuse an approval by the run's own submitter (rejecting stays allowed). One variable for "
        "run-api and the approval service, which must agree: run-api would answer APPROVED for what the approval "
        "service then refuses, and the call would wait until it expired. The old per-service name "
        "TETHER_RUN_API_FORBID_SELF_APPROVAL is refused at start-up unless the shared one is set too (which wins): "
        "alone it made run-api accept self-approvals the approval service refused.",
    )
    declare_topics: bool = Field(True, description="Declare Tether's topics at start-up (idempotent).")

    @model_validator(mode="after")
    def _refuse_the_old_self_approval_name_alone(self) -> RunApiSettings:
        # populate_by_name makes pydantic-settings read the prefixed field name as well. Set alone,
        # TETHER_RUN_API_FORBID_SELF_APPROVAL=false would make run-api accept a self-approval that
        # the approval service (which does not read it) then refuses, leaving the call to expire.
        if OLD_SELF_APPROVAL_NAME in os.environ and SELF_APPROVAL_NAME not in os.environ:
            raise ValueError(
                f"{OLD_SELF_APPROVAL_NAME} is no longer read on its own: set {SELF_APPROVAL_NAME}, "
                "which run-api and the approval service share"
            )
        return self
