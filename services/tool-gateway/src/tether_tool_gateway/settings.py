"""The tool-gateway's settings (env prefix TETHER_GATEWAY_; shared infrastructure from TETHER_*)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from tether_runtime.settings import LoopServiceSettings


class GatewaySettings(LoopServiceSettings):
    """Everything `python -m tether_tool_gateway` reads from the environment."""

    model_config = SettingsConfigDict(env_prefix="TETHER_GATEWAY_", extra="ignore", populate_by_name=True)

    declare_topics: bool = Field(True, description="Create missing topics at start-up (idempotent).")

    # -- PostgreSQL -------------------------------------------------------------------------
    ledger_schema: str = Field("gateway", description="Schema of the idempotency ledger (created at start-up).")
    blob_schema: str = Field("blobs", description="Schema of the shared content-addressed store (claim checks).")
    pg_pool_max: int = Field(10, ge=1, description="Most PostgreSQL connections this instance opens.")

    # -- execution and leases ---------------------------------------------------------------
    lease_ms: int = Field(30_000, ge=1_000, description="How long an execution's lease lasts without a heartbeat.")
    heartbeat_ms: int = Field(10_000, ge=100, description="How often a running execution extends its lease.")
    recheck_ms: int = Field(2_000, ge=100, description="Wait before looking again at a call another instance holds.")
    stall_ms: int = Field(120_000, ge=1_000, description="When an unfinished execution's work is started again.")
    sweep_interval_ms: int = Field(5_000, ge=100, description="How often each owned partition's expired leases are swept.")
    sweep_limit: int = Field(100, ge=1, description="Most intents one sweep takes over.")
    execution_threads: int = Field(16, ge=1, description="Threads running tool executions (besides the loop's work threads).")

    # -- results and policy -----------------------------------------------------------------
    inline_result_max_bytes: int = Field(64 * 1024, ge=1, description="Larger results go to the blob store.")
    result_max_bytes: int = Field(8 * 1024 * 1024, ge=1, description="Larger results fail with OVERSIZED_RESULT.")

    # -- sandbox ------------------------------------------------------------------------------
    sandbox_enabled: bool = Field(True, description="Offer executor_kinds 'sandbox' and 'mcp_stdio' (bubblewrap); probed "
                                                    "at start-up, left out (EXECUTOR_UNAVAILABLE) if it cannot work here.")
    mcp_stdio_roots: list[str] = Field(
        default_factory=list,
        description="Host directories whose contents 'mcp_stdio' tools may bind read-only into their sandbox (where "
                    "the operator installed MCP servers, e.g. [\"/opt/tether-mcp\"]); JSON list. Empty: none.")

    # -- secrets ------------------------------------------------------------------------------
    secrets_path: str | None = Field(None, description="Secret store for tools (tether_security.FileSecretProvider): "
                                                       "a 0700 directory, or a 0600 .json/.toml file.")
    secrets_env_prefix: str | None = Field(None, description="Read secrets from environment variables with this "
                                                             "prefix instead (stripe/test → <PREFIX>STRIPE_TEST).")

    # -- policy and rate limits ---------------------------------------------------------------
    policy_file: str | None = Field(None, description="Path of the policy document (JSON, docs/policy.md); "
                                                      "unset = the built-in default (approval for IRREVERSIBLE).")
    policy_json: str | None = Field(None, description="The policy document inline (instead of policy_file).")
    rate_limit_key_prefix: str = Field("tether:gateway:", description="Prefix of the rate limiter's Redis keys.")
    rate_limit_max_wait_ms: int = Field(300_000, ge=1, description="Longest wait a rate-limited call may reserve; "
                                                                  "later calls are told to come back.")
    rate_limit_grant_ttl_ms: int = Field(
        24 * 3_600_000, ge=1_000, description="How long a call's token is remembered (replays are not charged twice).")

    @model_validator(mode="after")
    def _consistent(self) -> GatewaySettings:
        if self.heartbeat_ms >= self.lease_ms:
            raise ValueError("heartbeat_ms must be shorter than lease_ms, or leases lapse while tools run")
        if self.inline_result_max_bytes > self.result_max_bytes:
            raise ValueError("inline_result_max_bytes must not exceed result_max_bytes")
        if self.policy_file is not None and self.policy_json is not None:
            raise ValueError("set policy_file or policy_json, not both")
        if self.secrets_path is not None and self.secrets_env_prefix is not None:
            raise ValueError("set secrets_path or secrets_env_prefix, not both")
        return self
