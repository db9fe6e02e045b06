"""Named errors of the projection domain."""

from __future__ import annotations


class ProjectionError(Exception):
    """An event that can never be projected; `reason` is a stable machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class UnsealedEvent(ProjectionError):
    """A record on the run event log without seq/prev_hash/hash: only the budget writes the log, sealed."""

    def __init__(self, event_id: str, run_id: str) -> None:
        super().__init__("UNSEALED_EVENT", f"event {event_id} of run {run_id} has no seq/prev_hash/hash")
