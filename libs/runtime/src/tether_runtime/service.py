"""Process lifecycle: a stop event set by SIGTERM/SIGINT, and a clean exit code."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger("tether_runtime.service")


def install_stop_handlers(stop: threading.Event) -> None:
    """Set `stop` on SIGTERM and SIGINT (must be called from the main thread)."""

    def _handler(signum: int, _frame: object) -> None:
        log.info("stop_requested", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def run(main: Callable[[threading.Event], int | None], *, stop: threading.Event | None = None) -> int:
    """Run `main(stop)` with signal handlers installed; returns the process exit code.

    `main` returns when `stop` is set (exit 0) or raises; an exception is logged and turns
    into exit code 1 so the supervisor restarts the process. Use as
    ``raise SystemExit(run(main))``.
    """
    stop = stop or threading.Event()
    install_stop_handlers(stop)
    try:
        code = main(stop)
    except Exception:
        log.exception("service_failed")
        return 1
    log.info("service_stopped", exit_code=code or 0)
    return int(code or 0)
