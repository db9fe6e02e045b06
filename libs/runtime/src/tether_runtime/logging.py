"""Structured logging: one JSON object per line on stderr, tagged with service and instance."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import structlog

from tether_security import RedactingProcessor, Redactor

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}

#: HTTP client libraries that log every request at INFO (httpx: "HTTP Request: POST ... 200 OK").
#: In a service that is one JSON line (with redaction) per model call and per tool call, more
#: than the service's own event for the same work, which already says what happened; they log
#: at WARNING and above unless the service runs at DEBUG.
_PER_REQUEST_LOGGERS = ("httpx", "httpcore")


class UnknownLogLevel(ValueError):
    """The configured log level is not one of DEBUG, INFO, WARNING, ERROR."""


# One redactor per process for every log line: it scrubs secret-shaped strings always, and the
# exact values (plus encodings) of every secret registered with it — the gateway's
# SecretRegistry registers each secret it resolves here, so no resolved secret reaches a log.
_LOG_REDACTOR = Redactor()


def log_redactor() -> Redactor:
    """The process-wide redactor applied to every log line (register resolved secrets with it)."""
    return _LOG_REDACTOR


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", errors="replace")
    try:
        if isinstance(value, BaseException):  # its message unescaped, as the redactor must see it
            message = str(value)
            return f"{type(value).__name__}: {message}" if message else type(value).__name__
        return repr(value)
    except Exception:  # a broken __repr__ must not lose the log line
        return f"<{type(value).__name__} (unprintable)>"


def _printable(value: Any) -> Any:
    """`value` as the JSON renderer would print it, in types the redactor reads.

    The redactor scans str, dict, list and tuple and passes anything else through untouched;
    the renderer then prints that thing's repr(), so a secret inside an exception, a set,
    bytes or any object would be printed after redaction. Turning such values into text
    first makes the redactor see exactly what gets printed.
    """
    if value is None or isinstance(value, str | int | float):  # bool is an int
        return value
    if isinstance(value, Mapping):
        return {k if isinstance(k, str | int | float | bool) or k is None else _as_text(k): _printable(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_as_text(_printable(v)) for v in value)
    structlog_form = getattr(type(value), "__structlog__", None)
    if structlog_form is not None:  # what JSONRenderer prints for it
        try:
            return _printable(structlog_form(value))
        except Exception:
            pass
    return _as_text(value)


def _printable_fields(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    return {k: _printable(v) for k, v in event.items()}


def configure(service: str, level: str = "INFO", *, instance: int | str | None = None) -> None:
    """Send structlog (and stdlib logging) output to stderr as JSON lines with service/instance fields."""
    numeric = _LEVELS.get(level.upper())
    if numeric is None:
        raise UnknownLogLevel(f"log level {level!r} is not one of {sorted(_LEVELS)}")
    static: dict[str, Any] = {"service": service}
    if instance is not None:
        static["instance"] = instance

    def add_static(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        # Static fields instead of contextvars: work threads do not inherit context.
        for k, v in static.items():
            event.setdefault(k, v)
        return event

    # Fields the platform itself adds (level, time, service, instance, logger name) cannot carry
    # a secret, so they are added after the redactor: it scans only what the code logged (each
    # value it scans costs every pattern's search).
    ours = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_static,
    ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _printable_fields,
            RedactingProcessor(_LOG_REDACTOR),
            *ours,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries that use stdlib logging end up in the same JSON stream.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _printable_fields,
                RedactingProcessor(_LOG_REDACTOR),
                *ours,
                structlog.processors.JSONRenderer(),
            ],
            foreign_pre_chain=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for name in _PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))


def get_logger(name: str | None = None, **fields: Any) -> Any:
    """A structlog logger (bound to `fields`)."""
    return structlog.get_logger(name).bind(**fields) if fields else structlog.get_logger(name)
