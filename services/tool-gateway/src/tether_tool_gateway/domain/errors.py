"""Named errors of the gateway domain and of tool execution."""

from __future__ import annotations


class ProtocolViolation(Exception):
    """A run event that contradicts what the gateway folded from the log (unknown run or call).

    `reason` is a stable machine-readable code; the handler dead-letters the record with it.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class UnknownRun(ProtocolViolation):
    """An event for a run whose RunAccepted the gateway never saw."""

    def __init__(self, run_id: str) -> None:
        super().__init__("UNKNOWN_RUN", f"no RunAccepted seen for run {run_id}")


class UnknownCall(ProtocolViolation):
    """An event for a call whose ToolCallRequested the gateway never saw."""

    def __init__(self, run_id: str, call_id: str) -> None:
        super().__init__("UNKNOWN_CALL", f"no ToolCallRequested seen for call {call_id} of run {run_id}")


class ToolError(Exception):
    """A tool failed in a way it understands; becomes ToolCallFailed(code, detail, retryable).

    `code` is one of ToolCallFailed's codes: TIMEOUT, TOOL_ERROR, OVERSIZED_RESULT,
    INVALID_RESULT, EXECUTOR_UNAVAILABLE.

    `effect_unknown`: the request may have reached the other side and taken effect, with the answer
    lost (an HTTP request sent and the connection cut or timed out before the response; an email's
    DATA sent and no reply). For a non-idempotent tool the gateway then records OUTCOME_UNKNOWN and
    the run waits for a human, as after a crash mid-call, instead of telling the model it failed
    (which invites it to do the thing again). Unset, it is true for TIMEOUT (an executor that gave
    up at its deadline cannot in general say how far it got) and false otherwise; an executor that
    knows better says so (a connect that timed out sent nothing).
    """

    def __init__(self, code: str, detail: str, retryable: bool = False, *, effect_unknown: bool | None = None) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.retryable = retryable
        self.effect_unknown = code == "TIMEOUT" if effect_unknown is None else effect_unknown


class EgressDenied(ToolError):
    """A tool tried to reach a host outside its configured egress allowlist."""

    def __init__(self, host: str) -> None:
        super().__init__("TOOL_ERROR", f"egress to host {host!r} is not allowed for this tool", retryable=False)
        self.host = host


class InvalidToolResult(ToolError):
    """A tool (or the service behind it) answered with something that is not a valid result."""

    def __init__(self, detail: str) -> None:
        super().__init__("INVALID_RESULT", detail, retryable=False)
