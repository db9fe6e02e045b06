"""The idempotency ledger: port, shared rules and the PostgreSQL adapter."""

from tether_tool_gateway.ledger.port import (
    Busy,
    CallRecord,
    Claim,
    Completion,
    Execute,
    IdempotencyLedger,
    Intent,
    IntentMismatch,
    Owner,
    Resolution,
    ResolutionStatus,
    Resolved,
)

__all__ = [
    "Busy",
    "CallRecord",
    "Claim",
    "Completion",
    "Execute",
    "IdempotencyLedger",
    "Intent",
    "IntentMismatch",
    "Owner",
    "Resolution",
    "ResolutionStatus",
    "Resolved",
]
