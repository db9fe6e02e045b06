"""Redaction on the logging sinks: a structlog processor and a stdlib logging.Filter."""

from __future__ import annotations

import logging
from typing import Any

from tether_security.redaction import Redactor


class RedactingProcessor:
    """structlog processor: redacts every value of the event dict (nested dicts/lists included).

    Put it last before the renderer, after format_exc_info/StackInfoRenderer, so exception text
    and stacks are redacted too:
    `processors=[..., structlog.processors.format_exc_info, RedactingProcessor(r), JSONRenderer()]`.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor

    def __call__(self, logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        return self._redactor.redact_value(event_dict)


_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class RedactingFilter(logging.Filter):
    """stdlib logging filter: redacts the formatted message, exception and stack text, and `extra` fields.

    Attach it to *handlers* (a logger's filters do not see records propagated from child loggers):
    `for h in logging.getLogger().handlers: h.addFilter(RedactingFilter(r))`.
    """

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self._redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        r = self._redactor
        if isinstance(record.msg, dict):
            # structlog's ProcessorFormatter hands the event dict over as msg.
            record.msg = r.redact_value(record.msg)
        else:
            try:
                message = record.getMessage()
            except Exception:  # a bad format string: keep the raw parts, redacted
                message = f"{record.msg} {record.args!r}"
            record.msg = r.redact(message)
            record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = r.redact(record.exc_text)
            # The formatter would render exc_info again if it were kept; the redacted text stands in.
            record.exc_info = None
        if record.stack_info:
            record.stack_info = r.redact(record.stack_info)
        for key, value in list(vars(record).items()):
            if key not in _STANDARD_ATTRS and key != "msg":
                # Through a one-entry dict, so a credential-named field (extra={"password": ...}) is masked.
                setattr(record, key, r.redact_value({key: value})[key])
        return True
