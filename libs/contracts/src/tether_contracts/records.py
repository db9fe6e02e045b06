"""Record types generated from schemas/ by tether_contracts.codegen. Do not edit."""

from __future__ import annotations

from enum import Enum
from typing import ClassVar

from pydantic import Field

from tether_contracts.base import AvroRecord


class BlobRef(AvroRecord):
    """Claim check for a payload stored in the content-addressed store."""

    AVRO_NAME: ClassVar[str] = "tether.v1.BlobRef"
    KIND: ClassVar[str] = "types"
    sha256: str = Field(description="Lowercase hex SHA-256 of the stored bytes; the store key.")
    size: int = Field(description="Size in bytes.")
    media_type: str = Field('application/json', description="Media type of the stored bytes.")


class Caps(AvroRecord):
    """Per-run limits enforced by the budget service before work starts."""

    AVRO_NAME: ClassVar[str] = "tether.v1.Caps"
    KIND: ClassVar[str] = "types"
    max_steps: int = Field(description="Maximum number of model-call steps.")
    max_wall_clock_ms: int = Field(description="Maximum run duration from acceptance, in milliseconds.")
    max_tokens: int = Field(description="Maximum input+output tokens over the whole run.")
    max_cost_usd_micros: int = Field(description="Maximum cost in millionths of a US dollar.")
    max_tool_calls: int = Field(200, description="Maximum number of tool calls over the whole run.")


class ModelRef(AvroRecord):
    """Which model a run is pinned to."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ModelRef"
    KIND: ClassVar[str] = "types"
    provider: str = Field(description="Provider adapter: 'openai' (OpenAI-compatible chat completions) or 'anthropic' (Messages API).")
    name: str = Field(description="Model name as the provider knows it.")
    context_window_tokens: int = Field(128000, description="The model's context window, used for compaction decisions.")


class Remaining(AvroRecord):
    """What is left of the run's caps at the moment a grant was given."""

    AVRO_NAME: ClassVar[str] = "tether.v1.Remaining"
    KIND: ClassVar[str] = "types"
    steps: int = Field(description="Model-call steps left after this grant.")
    tokens: int = Field(description="Tokens left.")
    cost_usd_micros: int = Field(description="Cost left, in millionths of a US dollar.")
    wall_clock_ms: int = Field(description="Milliseconds left before the run's deadline.")


class TenantLimits(AvroRecord):
    """A tenant's limits as they apply to one partition lane: run-api splits the tenant's configured totals over its spread of N partitions (each lane gets its share, at least 1 of any non-zero limit) and sends the share of the run's lane with every SubmitRun. The budget service enforces them per lane in its tenant ledger; the latest submit's values apply. Zero means no limit."""

    AVRO_NAME: ClassVar[str] = "tether.v1.TenantLimits"
    KIND: ClassVar[str] = "types"
    max_concurrent_runs: int = Field(0, description="Runs of the tenant that may be admitted (accepted and not ended) on this lane at once; 0 = no cap.")
    max_queued_runs: int = Field(0, description="Runs that may wait in the tenant's queue on this lane beyond max_concurrent_runs; a submit beyond it is refused (RunRejected TENANT_QUEUE_FULL). 0 = no queue.")
    spend_cap_usd_micros: int = Field(0, description="Model spend of the tenant on this lane per window, in millionths of a US dollar; at or over it no step is granted and no tool call budgeted (RunTerminated TENANT_SPEND_CAP). 0 = no cap.")
    spend_window_ms: int = Field(0, description="Length of the spend window, aligned to the epoch (86400000 = a UTC day); 0 = the cap is a lifetime total.")
    tokens_per_minute: int = Field(0, description="Model tokens (input + output) per minute of the tenant on this lane, with bursts up to one minute's worth; over it a step's grant is deferred (StepDeferred), not denied. 0 = no cap.")
    spread: int = Field(1, description="Over how many partition lanes the tenant's totals were split (1 = its home partition only).")


class ToolCall(AvroRecord):
    """One tool call proposed by the model, canonicalised by the planner."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCall"
    KIND: ClassVar[str] = "types"
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    call_index: int = Field(description="Position of the call inside the model response, from 0.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Name of the tool the model asked for (may be unknown; the gateway decides).")
    args_json: str = Field(description="Canonical JSON of the arguments (sorted keys, no whitespace).")
    args_hash: str = Field(description="Lowercase hex SHA-256 of args_json; approvals are bound to it.")
    provider_call_id: str = Field('', description="The provider's own id for the call, echoed back in the tool result message.")


class RiskClass(str, Enum):
    """How reversible a tool's effect is."""

    READ_ONLY = "READ_ONLY"
    WRITE = "WRITE"
    IRREVERSIBLE = "IRREVERSIBLE"


class ToolSpec(AvroRecord):
    """A snapshot of one registered tool version, embedded in the run."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolSpec"
    KIND: ClassVar[str] = "types"
    name: str = Field(description="Tool name, unique within the tenant.")
    version: int = Field(description="Tool version; a run keeps the version it started with.")
    description: str = Field(description="Description shown to the model.")
    args_schema_json: str = Field(description="JSON Schema (draft 2020-12) that the call's arguments must validate against, as JSON text.")
    risk_class: RiskClass = Field(description="READ_ONLY runs freely; WRITE runs logged; IRREVERSIBLE (money, deletion, contacting people) needs approval.")
    idempotent: bool = Field(description="True if re-running the call with the same idempotency key is safe; false means OutcomeUnknown after a crash.")
    untrusted_source: bool = Field(description="True if the tool's output is untrusted content (web pages, emails, documents); reading it taints the run.")
    executor_kind: str = Field(description="Which executor runs the tool: 'builtin', 'http', 'mcp' (MCP over HTTP), 'mcp_stdio' (an MCP server run in the sandbox), 'sandbox'.")
    executor_config_json: str = Field('{}', description="Executor configuration as JSON text (URL, built-in name, ...). Holds secret names, never values.")
    timeout_ms: int = Field(30000, description="Execution timeout; the gateway reports a tool error past it.")
    pollable: bool = Field(False, description="True for status-polling tools, exempt from repeat detection within a poll budget.")
    egress: bool = Field(False, description="True if the tool can move data out or contact people (needs approval on a tainted run).")
    constraints_json: str = Field('{}', description="Argument constraints the gateway checks before any decision to run (egress hosts, path prefixes, amount ceilings, recipient allowlists), as JSON text; see docs/policy.md. '{}' = none.")


class Usage(AvroRecord):
    """Tokens and cost consumed, cumulative or per call depending on the field that holds it."""

    AVRO_NAME: ClassVar[str] = "tether.v1.Usage"
    KIND: ClassVar[str] = "types"
    input_tokens: int = Field(0, description="Prompt tokens billed by the model provider.")
    output_tokens: int = Field(0, description="Completion tokens billed by the model provider.")
    cost_usd_micros: int = Field(0, description="Cost in millionths of a US dollar, from the pricing table version recorded with the call.")


class Envelope(AvroRecord):
    """The record every Tether topic carries. The payload is one command or event in Avro single-object encoding; the run event log adds seq, prev_hash and hash."""

    AVRO_NAME: ClassVar[str] = "tether.v1.Envelope"
    KIND: ClassVar[str] = "envelope"
    event_id: str = Field(description="Unique id of this record; deterministic where the producer can derive it, so a replay is recognised as a duplicate.")
    tenant_id: str = Field(description="Tenant that owns the run; authenticated by run-api, never taken from a request body.")
    run_id: str = Field(description="The run this record belongs to (ULID-like string, unique across tenants).")
    event_type: str = Field(description="Full Avro name of the payload record, e.g. 'tether.v1.StepGranted'.")
    schema_fingerprint: str = Field(description="Lowercase hex CRC-64-AVRO fingerprint of the payload's writer schema.")
    payload: bytes = Field(description="The payload in Avro single-object encoding (0xC3 0x01, 8-byte little-endian fingerprint, body).")
    recorded_at_ms: int = Field(description="Producer's clock when the record was made, ms since the epoch; decisions use this recorded value, never a fresh clock.")
    producer: str = Field(description="Service that produced the record: run-api, budget, planner, tool-gateway, approval.")
    seq: int | None = Field(None, description="Run-local sequence number, from 1, assigned when the record is appended to the run event log; null before.")
    prev_hash: str | None = Field(None, description="Hash of the run's previous log event (64 zeros for seq 1); null before sequencing.")
    hash: str | None = Field(None, description="SHA-256 over prev_hash and this record's content; null before sequencing.")
    causation_id: str | None = Field(None, description="event_id of the record that caused this one.")
    traceparent: str | None = Field(None, description="W3C trace context of the producing span.")


class CancelRun(AvroRecord):
    """Command: stop a run. The budget service ends it with RunTerminated(CANCELLED)."""

    AVRO_NAME: ClassVar[str] = "tether.v1.CancelRun"
    KIND: ClassVar[str] = "commands"
    principal_id: str = Field(description="Authenticated principal asking to cancel.")
    reason: str = Field('', description="Why the run is cancelled.")


class DecideApproval(AvroRecord):
    """Command: an approver's decision on a pending approval. May be refused."""

    AVRO_NAME: ClassVar[str] = "tether.v1.DecideApproval"
    KIND: ClassVar[str] = "commands"
    approval_id: str = Field(description="The approval being decided.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    args_hash: str = Field(description="The args hash the approver saw; must equal the pending approval's.")
    approver_id: str = Field(description="Authenticated approver.")
    approver_roles: list[str] = Field(description="Roles of the approver in the tenant.")
    approve: bool = Field(description="True to approve, false to reject.")
    comment: str = Field('', description="Free text from the approver.")


class ApprovalOutcome(str, Enum):
    """Result of an approval."""

    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    EXPIRED = "EXPIRED"


class ApprovalDecided(AvroRecord):
    """A pending approval was decided (or expired)."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ApprovalDecided"
    KIND: ClassVar[str] = "events"
    approval_id: str = Field(description="The approval.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    args_hash: str = Field(description="The args hash the decision is bound to.")
    outcome: ApprovalOutcome = Field(description="The decision.")
    approver_id: str = Field(description="Who decided; 'system' for expiry.")
    comment: str = Field('', description="Approver's comment.")
    decided_at_ms: int = Field(description="Recorded decision time, ms since the epoch.")


class ApprovalDecisionRefused(AvroRecord):
    """An approver's decision that run-api took in time but that did not take effect: the approval service read it only after the approval had already EXPIRED (its record reached the commands topic later than the expiry grace allows). EXPIRED stays the approval's one decision; this records the human's, so the log shows a call a human allowed that did not run. Emitted by the approval service for the reason DECISION_AFTER_EXPIRY only: every other refusal is checked by run-api before it takes a decision, or is a duplicate."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ApprovalDecisionRefused"
    KIND: ClassVar[str] = "events"
    approval_id: str = Field(description="The approval the decision was for.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    approver_id: str = Field(description="Authenticated approver.")
    approve: bool = Field(description="What the approver decided: true approved the call, false rejected it.")
    comment: str = Field('', description="Free text from the approver.")
    reason: str = Field(description="The approval service's reason code for the refusal: DECISION_AFTER_EXPIRY.")
    detail: str = Field('', description="The refusal for humans.")
    decided_at_ms: int = Field(description="When the approver decided: the command's recorded time (run-api took it), ms since the epoch.")
    expires_at_ms: int = Field(description="When the approval expired, ms since the epoch.")


class ApprovalRequested(AvroRecord):
    """A tool call needs a human decision; the run is parked until ApprovalDecided."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ApprovalRequested"
    KIND: ClassVar[str] = "events"
    approval_id: str = Field(description="Identifier of the approval.")
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Tool to run.")
    args_json: str = Field(description="Arguments as recorded (secrets redacted).")
    args_hash: str = Field(description="The decision is bound to this hash.")
    risk_class: RiskClass = Field(description="Risk class of the tool.")
    reasons: list[str] = Field(description="Why approval is needed: RISK_CLASS, TAINTED_EGRESS, POLICY.")
    provenance_json: str = Field('{}', description="Where each argument came from, shown to the approver.")
    expires_at_ms: int = Field(description="When the request expires (APPROVAL_TIMEOUT), ms since the epoch.")
    policy_version: str = Field(description="Policy version that required approval.")
    inputs_hash: str = Field(description="SHA-256 of the canonical decision inputs.")


class ModelCallCompleted(AvroRecord):
    """The planner's model call for a step returned."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ModelCallCompleted"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    model: ModelRef = Field(description="The model that answered.")
    usage: Usage = Field(description="Usage of this call.")
    assistant_text: str | None = Field(None, description="Assistant text of the response (size-capped; the full message is in message_ref).")
    message_ref: BlobRef | None = Field(None, description="Claim check for the full assistant message when over the inline limit.")
    tool_call_count: int = Field(description="How many tool calls the response proposed (each follows as ToolCallRequested).")
    finish_reason: str = Field(description="Provider finish reason, normalised: stop, tool_calls, length, error.")
    latency_ms: int = Field(description="Model latency in milliseconds.")
    attempts: int = Field(1, description="Provider attempts made (retries on 429/5xx).")
    compacted: bool = Field(False, description="True if the working context was compacted before this call.")
    usage_estimated: bool = Field(False, description="True when part of usage is the planner's estimate, not the provider's count: the provider did not report it, or an attempt was cut before its usage (estimated deliberately high).")


class ModelCallFailed(AvroRecord):
    """The planner could not get a usable model response for a step."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ModelCallFailed"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    error_code: str = Field(description="Machine-readable code: PROVIDER_ERROR, MALFORMED_OUTPUT, CONTEXT_OVERFLOW, TIMEOUT.")
    detail: str = Field(description="Explanation (never contains secrets or raw provider credentials).")
    attempts: int = Field(description="Attempts made.")
    usage: Usage = Field(description="Usage consumed by the failed attempts.")
    usage_estimated: bool = Field(False, description="True when part of usage is the planner's estimate, not the provider's count: an attempt was cut before the provider reported its usage, or the answer's usage was unreadable (estimated deliberately high).")


class RunCompleted(AvroRecord):
    """The model finished with a final answer."""

    AVRO_NAME: ClassVar[str] = "tether.v1.RunCompleted"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    answer: str = Field(description="The final answer (redacted).")
    usage: Usage = Field(description="Cumulative usage.")


class RunRejected(AvroRecord):
    """The budget service refused a SubmitRun."""

    AVRO_NAME: ClassVar[str] = "tether.v1.RunRejected"
    KIND: ClassVar[str] = "events"
    request_id: str = Field(description="The submit's request id.")
    reason_code: str = Field(description="Machine-readable reason, e.g. TENANT_CONCURRENCY_CAP, TENANT_SPEND_CAP, INVALID_CAPS.")
    detail: str = Field(description="Human-readable explanation.")


class StepDeferred(AvroRecord):
    """The budget service would grant the step but the tenant has no room on this lane yet (its token rate, or its spend cap counting the calls already granted): the grant waits (it is not denied). StepGranted for the same step follows once there is room, in the tenant's order of deferral (runs deferred earlier go first)."""

    AVRO_NAME: ClassVar[str] = "tether.v1.StepDeferred"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number whose grant waits.")
    reason_code: str = Field(description="Why the grant waits: TENANT_TOKEN_RATE or TENANT_SPEND_CAP.")
    tokens_available: int = Field(description="The tenant's token bucket on this lane when deferred. Below the grant's reservation (negative when calls already granted used more than the rate allows) only for a TENANT_TOKEN_RATE deferral by the bucket itself; any level while earlier-deferred runs wait, while the lane waits for its first model call's usage (one grant at a time until then), and for a TENANT_SPEND_CAP deferral (the spend, not the bucket, holds the grant); 2^62 when the lane has no token rate.")
    not_before_ms: int = Field(description="Earliest time the grant can be made, ms since the epoch (an estimate; runs deferred earlier go first): when the bucket holds the grant's reservation again and, if the calls in flight hold the spend, the spend window has ended. The time of the deferral when only a record can end the wait: the lane's first model-call usage, or the usage of the calls in flight when the spend cap has no window or their reservations alone reach it.")


class StepGranted(AvroRecord):
    """The budget service allows the next model call of the run."""

    AVRO_NAME: ClassVar[str] = "tether.v1.StepGranted"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    remaining: Remaining = Field(description="What is left of the caps after this grant.")
    loop_warning: str | None = Field(None, description="A one-time deterministic note for the model when a loop was first detected.")


class ToolCallAuthorized(AvroRecord):
    """The gateway's policy allowed a budgeted tool call without a human; it runs next (after the rate limiter, if the policy limits the tool). Carries no argument values: those are in ToolCallRequested."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallAuthorized"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Tool allowed to run.")
    tool_version: int = Field(description="Version of the tool snapshot (RunAccepted.tools) the arguments were checked against.")
    args_hash: str = Field(description="The authorization is bound to this hash of the canonical arguments.")
    risk_class: RiskClass = Field(description="Risk class of the tool.")
    reasons: list[str] = Field(description="The rules that let the call run, in the order they were checked: GRANTED, IN_DELEGATED_SCOPE, ARGS_VALID, CONSTRAINTS_MET, RISK_CLASS_NEEDS_NO_APPROVAL or RISK_CLASS_WAIVED, EGRESS_UNTAINTED or EGRESS_FOLLOWS_LINK (docs/policy.md).")
    policy_version: str = Field(description="Version of the policy the decision was made under.")
    inputs_hash: str = Field(description="SHA-256 of the canonical decision inputs, so an auditor can re-derive the decision.")


class ToolCallBudgeted(AvroRecord):
    """The budget service reserved budget for a tool call; the gateway may now decide on it."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallBudgeted"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    remaining: Remaining = Field(description="What is left of the caps after the reservation.")


class ToolCallCompleted(AvroRecord):
    """A tool call executed and returned a result."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallCompleted"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Tool that ran.")
    result_json: str | None = Field(None, description="Result as JSON text, redacted and size-capped; null when only result_ref is set.")
    result_ref: BlobRef | None = Field(None, description="Claim check for a large result.")
    untrusted: bool = Field(False, description="True if the result is untrusted content (it taints the run).")
    duration_ms: int = Field(description="Execution time.")
    replayed: bool = Field(False, description="True if the result came from the idempotency ledger instead of a fresh execution.")


class ToolCallDeferred(AvroRecord):
    """The gateway allowed a tool call but a rate limit made it wait; the call is retried at not_before_ms (not a terminal outcome)."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallDeferred"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Tool that was asked for.")
    reason_code: str = Field(description="Why the call waits: RATE_LIMITED.")
    retry_after_ms: int = Field(description="The limiter's answer: how long until the call may run.")
    not_before_ms: int = Field(description="When the gateway retries the call: decided_at_ms + retry_after_ms, ms since the epoch.")
    attempt: int = Field(description="Which rate-limit check of the call this was, from 1.")
    decided_at_ms: int = Field(description="The gateway's clock when it asked the limiter, ms since the epoch (a recorded decision input).")
    policy_version: str = Field(description="Version of the policy the decision was made under (it holds the rate limit).")
    inputs_hash: str = Field(description="SHA-256 of the canonical decision inputs, including the limiter's recorded answer.")


class ToolCallDenied(AvroRecord):
    """The gateway refused a tool call; the refusal goes back to the model as the tool result."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallDenied"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Tool that was asked for.")
    reason_code: str = Field(description="Machine-readable reason: UNKNOWN_TOOL, TOOL_NOT_ALLOWED, INVALID_ARGS, CONSTRAINT_VIOLATION, RATE_LIMITED, APPROVAL_REJECTED, APPROVAL_EXPIRED.")
    detail: str = Field(description="Explanation returned to the model.")
    policy_version: str = Field(description="Version of the policy the decision was made under.")
    inputs_hash: str = Field(description="SHA-256 of the canonical decision inputs, so an auditor can re-derive the decision.")


class ToolCallFailed(AvroRecord):
    """A tool call ran (or tried to) and failed with a known error."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallFailed"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Tool that failed.")
    error_code: str = Field(description="Machine-readable code: TIMEOUT, TOOL_ERROR, OVERSIZED_RESULT, INVALID_RESULT, EXECUTOR_UNAVAILABLE.")
    detail: str = Field(description="Explanation (redacted).")
    retryable: bool = Field(description="Whether the model may retry.")


class ToolCallOutcomeUnknown(AvroRecord):
    """A non-idempotent tool's intent has no recorded result after a crash; the run waits for a human."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallOutcomeUnknown"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call_id: str = Field(description="Identifier of the tool call inside the run: '<step>.<call_index>'.")
    idem_key: str = Field(description="H(run_id, step, call_index) as lowercase hex SHA-256; the idempotency key of the call's side effect.")
    tool_name: str = Field(description="Tool whose outcome is unknown.")
    detail: str = Field(description="What is known about the attempt.")


class ToolCallRequested(AvroRecord):
    """The model proposed a tool call. A request, not a permission."""

    AVRO_NAME: ClassVar[str] = "tether.v1.ToolCallRequested"
    KIND: ClassVar[str] = "events"
    step: int = Field(description="Run-local step number: the model-call round this record belongs to, starting at 1.")
    call: ToolCall = Field(description="The canonicalised call.")
    provenance_json: str = Field('{}', description="JSON map from argument path to origin (goal, model, tool:<call_id>), where known.")


class AgentSpec(AvroRecord):
    """A snapshot of one agent version, embedded in the run so the log alone explains the run."""

    AVRO_NAME: ClassVar[str] = "tether.v1.AgentSpec"
    KIND: ClassVar[str] = "types"
    agent_id: str = Field(description="Stable agent identifier within the tenant.")
    version: int = Field(description="Agent version; a run keeps the version it started with.")
    name: str = Field(description="Human-readable agent name.")
    instructions: str = Field(description="System instructions for the model. Never contains secrets or untrusted content.")
    model: ModelRef = Field(description="The model this agent's runs are pinned to.")
    tool_allowlist: list[str] = Field(description="Tool names this agent may call; intersected with tenant grants by the gateway.")
    caps: Caps = Field(description="Default caps for runs of this agent.")
    compaction_threshold: float = Field(0.8, description="Fraction of the context window at which the planner compacts working context.")


class TerminationReport(AvroRecord):
    """What a stopped run did, what is pending and why it stopped."""

    AVRO_NAME: ClassVar[str] = "tether.v1.TerminationReport"
    KIND: ClassVar[str] = "types"
    reason_code: str = Field(description="Machine-readable reason: COMPLETED, STEP_CAP, TOKEN_CAP, COST_CAP, WALL_CLOCK_CAP, TOOL_CALL_CAP, LOOP_DETECTED, CANCELLED, MODEL_FAILED, CONTEXT_OVERFLOW, APPROVAL_TIMEOUT.")
    detail: str = Field(description="Human-readable explanation.")
    steps_done: int = Field(description="Model-call steps completed.")
    tool_calls_done: list[str] = Field(description="Finished tool calls (and calls refused as NOT_BUDGETED), one per entry as 'call_id tool_name status'. The calls of a long run's earliest steps (more than 16 steps before its last grant) are summarised instead, as the first entry: '<N> earlier call(s) of steps 1\u2013<K>: <tool_name> <status> \u00d7<n>, <tool_name> <status> \u00d7<n>, ...' (N calls in all, of steps 1 to K; each tool name and status with its count, in order of first occurrence; an en dash between 1 and K, a multiplication sign before each count), and the later calls follow one per entry.")
    pending: list[str] = Field(description="Calls or approvals still open when the run stopped.")
    usage: Usage = Field(description="Cumulative usage at the stop.")
    last_error: str | None = Field(None, description="The last error the run saw, if any.")
    suggested_next_action: str = Field('', description="What a human could do next.")


class SubmitRun(AvroRecord):
    """Command: start a run of an agent on a goal. May be refused (RunRejected)."""

    AVRO_NAME: ClassVar[str] = "tether.v1.SubmitRun"
    KIND: ClassVar[str] = "commands"
    request_id: str = Field(description="Client-chosen id that makes the submit idempotent per tenant.")
    principal_id: str = Field(description="Authenticated principal submitting the run.")
    goal: str = Field(description="The user's goal, trusted as the principal's own words.")
    agent: AgentSpec = Field(description="The agent version the run uses.")
    tools: list[ToolSpec] = Field(description="Snapshots of the tools on the agent's allowlist that the tenant has registered.")
    caps: Caps = Field(description="Caps for this run (the agent's defaults, possibly tightened by the request).")
    tenant_grants: list[str] = Field(default_factory=lambda: [], description="Tools the tenant has granted to this principal at submit time.")
    delegated_scope: list[str] | None = Field(None, description="Tools a delegating principal scoped this run to; capabilities = tenant grants \u2229 agent allowlist \u2229 this scope. Null = not delegated (no further restriction); an empty list allows no tool.")
    tenant_limits: TenantLimits | None = Field(None, description="The tenant's limits for the run's partition lane (run-api's tenant catalog, split over the tenant's spread). Null = the tenant has no limits (no concurrency cap, queue, spend or token-rate cap).")


class RunAccepted(AvroRecord):
    """The budget service admitted the run; its caps and snapshots are now fixed."""

    AVRO_NAME: ClassVar[str] = "tether.v1.RunAccepted"
    KIND: ClassVar[str] = "events"
    principal_id: str = Field(description="Principal who submitted the run.")
    request_id: str = Field(description="The submit's request id.")
    goal: str = Field(description="The user's goal.")
    agent: AgentSpec = Field(description="Agent snapshot.")
    tools: list[ToolSpec] = Field(description="Tool snapshots.")
    caps: Caps = Field(description="Caps in force.")
    tenant_grants: list[str] = Field(default_factory=lambda: [], description="Tools granted by the tenant at submit time.")
    delegated_scope: list[str] | None = Field(None, description="Copied from SubmitRun: tools a delegating principal scoped this run to (null = not delegated). The gateway intersects it with tenant grants and the agent allowlist.")
    deadline_ms: int = Field(description="Wall-clock deadline, ms since the epoch.")
    loop_guard_version: int | None = Field(None, description="The loop guard's rules version the budget judges this run by, from acceptance to its end (tether_budget.domain.loopguard.LOOP_RULES; docs/loop-detection.md). An auditor re-derives the run's loop warnings and stops under it. Null: recorded before the version was (the rules are unknown).")


class RunQueued(AvroRecord):
    """The budget service took the submit into the tenant's queue: the tenant is at its concurrency cap on this partition lane. RunAccepted follows, in queue order, when one of the tenant's runs on the lane ends (RunRejected if the tenant is then over its spend cap; RunTerminated(CANCELLED) if cancelled while queued). The run's wall-clock cap starts at RunAccepted."""

    AVRO_NAME: ClassVar[str] = "tether.v1.RunQueued"
    KIND: ClassVar[str] = "events"
    principal_id: str = Field(description="Principal who submitted the run.")
    request_id: str = Field(description="The submit's request id.")
    goal: str = Field(description="The user's goal.")
    agent: AgentSpec = Field(description="Agent snapshot the run will use.")
    position: int = Field(description="Place in the tenant's queue on this lane when queued, from 1 (1 = admitted next).")
    running: int = Field(description="Runs of the tenant admitted and not ended on this lane when this run was queued.")
    max_concurrent_runs: int = Field(description="The lane's concurrency cap in force (TenantLimits.max_concurrent_runs).")


class RunTerminated(AvroRecord):
    """The run was stopped: a cap, a loop, a cancel or a failure. Nothing runs after it."""

    AVRO_NAME: ClassVar[str] = "tether.v1.RunTerminated"
    KIND: ClassVar[str] = "events"
    reason_code: str = Field(description="Same as report.reason_code.")
    report: TerminationReport = Field(description="What was done, what is pending, why it stopped.")


RECORD_TYPES: dict[str, type[AvroRecord]] = {
    "tether.v1.BlobRef": BlobRef,
    "tether.v1.Caps": Caps,
    "tether.v1.ModelRef": ModelRef,
    "tether.v1.Remaining": Remaining,
    "tether.v1.TenantLimits": TenantLimits,
    "tether.v1.ToolCall": ToolCall,
    "tether.v1.ToolSpec": ToolSpec,
    "tether.v1.Usage": Usage,
    "tether.v1.Envelope": Envelope,
    "tether.v1.CancelRun": CancelRun,
    "tether.v1.DecideApproval": DecideApproval,
    "tether.v1.ApprovalDecided": ApprovalDecided,
    "tether.v1.ApprovalDecisionRefused": ApprovalDecisionRefused,
    "tether.v1.ApprovalRequested": ApprovalRequested,
    "tether.v1.ModelCallCompleted": ModelCallCompleted,
    "tether.v1.ModelCallFailed": ModelCallFailed,
    "tether.v1.RunCompleted": RunCompleted,
    "tether.v1.RunRejected": RunRejected,
    "tether.v1.StepDeferred": StepDeferred,
    "tether.v1.StepGranted": StepGranted,
    "tether.v1.ToolCallAuthorized": ToolCallAuthorized,
    "tether.v1.ToolCallBudgeted": ToolCallBudgeted,
    "tether.v1.ToolCallCompleted": ToolCallCompleted,
    "tether.v1.ToolCallDeferred": ToolCallDeferred,
    "tether.v1.ToolCallDenied": ToolCallDenied,
    "tether.v1.ToolCallFailed": ToolCallFailed,
    "tether.v1.ToolCallOutcomeUnknown": ToolCallOutcomeUnknown,
    "tether.v1.ToolCallRequested": ToolCallRequested,
    "tether.v1.AgentSpec": AgentSpec,
    "tether.v1.TerminationReport": TerminationReport,
    "tether.v1.SubmitRun": SubmitRun,
    "tether.v1.RunAccepted": RunAccepted,
    "tether.v1.RunQueued": RunQueued,
    "tether.v1.RunTerminated": RunTerminated,
}
