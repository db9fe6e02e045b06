"""Named errors of the gateway domain and of tool execution."""

from __future__ import annotations

import re


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

    `detail` and `tail` may hold text from the tool (an error body, a server's stderr) and so a
    secret: executors pass them uncut (bounded only for memory, `DETAIL_INPUT_MAX`), and the runner
    redacts each whole before it shortens it, since a secret cut in half no longer matches the
    redactor. `tail` is text whose end matters most (a process's stderr tail): it follows the
    detail and is shortened from its start.
    """

    def __init__(self, code: str, detail: str, retryable: bool = False, *, effect_unknown: bool | None = None,
                 tail: str = "") -> None:
        super().__init__(f"{code}: {detail}{tail}")  # uncut: a log sink's redactor sees any secret whole
        self.code = code
        self.detail = detail
        self.retryable = retryable
        self.effect_unknown = code == "TIMEOUT" if effect_unknown is None else effect_unknown
        self.tail = tail


#: How much of a tool's text (an error body, a bad line, a stderr tail) an executor puts in a ToolError:
#: far more than the ledger keeps (the runner redacts it whole, then shortens it to 1,000 characters).
DETAIL_INPUT_MAX = 8192
_LAST_TOKEN = re.compile(r"\S*\Z")


def head_of(data: bytes, limit: int = DETAIL_INPUT_MAX) -> str:
    """The start of a tool's output for a ToolError detail: bounded for memory, never cut short for display.

    When it is cut, the last token goes too (it may end inside a secret, which the redactor would
    then not match; a text without whitespace is dropped whole)."""
    if len(data) <= limit:
        return data.decode("utf-8", errors="replace")
    return _LAST_TOKEN.sub("", data[:limit].decode("utf-8", errors="replace")) + "…"


def cut_text(text: str, limit: int = DETAIL_INPUT_MAX) -> str:
    """`head_of` for text."""
    return text if len(text) <= limit else _LAST_TOKEN.sub("", text[:limit]) + "…"


def tail_of(data: bytes, *, cut: bool, limit: int = DETAIL_INPUT_MAX) -> str:
    """The end of a tool's output (stderr) for `ToolError.tail`, at most `limit` bytes.

    When the text was cut at its start (here, or by whoever captured it: `cut`), its first line
    is dropped: it may begin inside a secret, and a piece of a secret matches no redaction rule."""
    cut = cut or len(data) > limit
    text = data[-limit:].decode("utf-8", errors="replace")
    if cut:
        text = text.partition("\n")[2]
    return text.strip()


class EgressDenied(ToolError):
    """A tool tried to reach a host outside its configured egress allowlist."""

    def __init__(self, host: str) -> None:
        super().__init__("TOOL_ERROR", f"egress to host {host!r} is not allowed for this tool", retryable=False)
        self.host = host


class InvalidToolResult(ToolError):
    """A tool (or the service behind it) answered with something that is not a valid result."""

    def __init__(self, detail: str) -> None:
        super().__init__("INVALID_RESULT", detail, retryable=False)
