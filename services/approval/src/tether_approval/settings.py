"""The approval service's settings (env prefix TETHER_APPROVAL_; shared infrastructure from TETHER_*)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import SettingsConfigDict

from tether_approval.domain.decisions import DAY_MS
from tether_runtime.settings import LoopServiceSettings


class ApprovalSettings(LoopServiceSettings):
    """Everything `python -m tether_approval` reads from the environment."""

    model_config = SettingsConfigDict(env_prefix="TETHER_APPROVAL_", extra="ignore", populate_by_name=True)

    declare_topics: bool = Field(True, description="Create missing topics at start-up (idempotent).")

    # -- who may decide ---------------------------------------------------------------------
    # run-api checks both before it sends a DecideApproval: were the two services to disagree, a
    # decision run-api accepted would be refused here, logged only, and the call would wait until
    # it expired. So the role is run-api's fixed one, and self-approval is one shared variable.
    approver_role: Literal["approver"] = Field(
        "approver",
        description="Role a decider must hold in the tenant. Fixed: it is the role run-api requires to decide "
        "(the only approving role its keys can hold); any other value is refused at start-up.",
    )
    forbid_self_approval: bool = Field(
        True,
        validation_alias=AliasChoices("TETHER_FORBID_SELF_APPROVAL", "TETHER_APPROVAL_FORBID_SELF_APPROVAL"),
        description="The run's submitter may not approve its calls (rejecting stays allowed). One variable for "
        "run-api and the approval service, which must agree. The old approval-only name is still read when the "
        "shared one is unset (deprecated).",
    )

    # -- time limits -------------------------------------------------------------------------
    outcome_unknown_ttl_ms: int = Field(
        7 * DAY_MS, ge=1, description="Time a human has to decide after a tool call's outcome became unknown."
    )
    early_decision_ttl_ms: int = Field(
        DAY_MS, ge=1, description="How long a decision read before its ApprovalRequested waits for it."
    )
    max_early_decisions: int = Field(32, ge=0, description="Early decisions kept per run.")
    expiry_grace_ms: int = Field(
        30_000, ge=0,
        description="The longest a decision run-api recorded by an approval's expiry may take to reach the commands "
        "topic (run-api's produce, which its TETHER_RUN_API_DELIVERY_TIMEOUT_MS, 10 s, bounds; the two hosts' clocks): "
        "the service emits EXPIRED only once it has read the commands partition through expiry + this, so such a "
        "decision wins however far behind the service is (a backlog after a restart, a slow or starved consumer). "
        "A decision recorded after the expiry is refused either way.",
    )

    # -- the approver webhook (best-effort) -----------------------------------------------------
    webhook_url: SecretStr | None = Field(
        None, description="POST a JSON notification here for each new approval (http(s); logs name only scheme and "
        "host: a webhook URL's path is a credential)."
    )
    webhook_timeout_s: float = Field(5.0, gt=0, description="Timeout of one webhook attempt.")
    webhook_max_attempts: int = Field(4, ge=1, description="Attempts per notification (retries on 408/429/5xx/network).")
    webhook_max_seconds: float = Field(30.0, gt=0, description="Total time budget of one notification's attempts.")
    webhook_secret: SecretStr | None = Field(None, description="Signs the body: X-Tether-Signature: sha256=<HMAC>.")
