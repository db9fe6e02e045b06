"""Tool outcomes as the model sees them: the platform's one untrusted-content envelope (tether_security).

Untrusted content is never spliced into the system prompt; it reaches the model only as the
content of a tool message, inside `tether_security.wrap_untrusted`'s data envelope: provenance
(tool, call id, whether the tool read outside content), the call's status, the injection
detector's risk and flags, control tokens stripped, size-capped. This module only maps the
planner's vocabulary (outcome status, a dict of error facts) onto it and reads it back.
"""

from __future__ import annotations

from typing import Any

from tether_planner.domain.canonical import canonical_json
from tether_security import (
    HeuristicInjectionDetector,
    InjectionDetector,
    InjectionReport,
    open_envelope,
    wrap_untrusted,
)


def wrap_tool_result(
    *,
    tool_name: str,
    call_id: str,
    status: str,
    content: Any,
    untrusted: bool,
    max_chars: int,
    detector: InjectionDetector | None = None,
) -> str:
    """The tool message content: the data envelope around the call's result or error facts.

    `status` is ok | denied | failed | outcome_unknown | rejected | pending; `content` is the
    result text or a dict describing an error (sent as canonical JSON); `untrusted` is the
    gateway's mark that the tool read content from outside the system (a web page, an email).
    """
    text = content if isinstance(content, str) else canonical_json(content)
    return wrap_untrusted(
        text, source=tool_name, call_id=call_id, status=status, external=untrusted, max_chars=max_chars, detector=detector
    ).text


class ScanOnce:
    """The injection detector, remembering its last report: wrapping the same result again at a
    smaller cap (to fit the state's byte bound) does not scan it again."""

    def __init__(self, detector: InjectionDetector | None = None) -> None:
        self._detector = detector or HeuristicInjectionDetector()
        self._last: tuple[str, InjectionReport] | None = None

    def scan(self, text: str) -> InjectionReport:
        if self._last is None or self._last[0] != text:
            self._last = (text, self._detector.scan(text))
        return self._last[1]


def envelope_content(message_content: str) -> tuple[str, str]:
    """(status, content) of a wrapped tool message; ("", raw text) when it is not an envelope."""
    opened = open_envelope(message_content)
    if opened is None:
        return "", message_content
    return opened.status, opened.content
