"""Named errors of the budget domain: records that break the run protocol and can never be applied."""

from __future__ import annotations


class ProtocolViolation(Exception):
    """A record that contradicts the run's ledger (wrong step, unknown call, ...).

    `reason` is a stable machine-readable code; the handler dead-letters the record with it.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class UnknownRun(ProtocolViolation):
    """A record for a run that has no ledger here (never submitted, or long forgotten)."""

    def __init__(self, run_id: str) -> None:
        super().__init__("UNKNOWN_RUN", f"no ledger for run {run_id}")


class RunAlreadyExists(ProtocolViolation):
    """A SubmitRun for a run id already used by a different request."""

    def __init__(self, run_id: str, request_id: str) -> None:
        super().__init__("RUN_EXISTS", f"run {run_id} already exists for request {request_id}")


class CancelForbidden(ProtocolViolation):
    """A CancelRun from outside the run's tenant."""

    def __init__(self, run_id: str, tenant_id: str) -> None:
        super().__init__("CANCEL_FORBIDDEN", f"tenant {tenant_id} may not cancel run {run_id}")
