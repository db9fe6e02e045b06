"""Start-up steps that wait for a dependency (PostgreSQL): retried with backoff for a bounded time.

A service that cannot reach its database at start-up (the database restarts, or starts after
the service) waits for it instead of exiting at once; its health server is already up, so
`/healthz` says alive and `/readyz` says not ready meanwhile. Only after `timeout_s` does the
last error end the process (exit 1), for its supervisor to restart it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import structlog
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    stop_when_event_set,
    wait_exponential_jitter,
)

log = structlog.get_logger("tether_runtime.startup")

T = TypeVar("T")


class StartupInterrupted(Exception):
    """The process was asked to stop while it was still waiting for a dependency at start-up."""


def wait_for_dependency(
    step: Callable[[], T],
    *,
    what: str,
    retry_on: tuple[type[Exception], ...],
    stop: threading.Event,
    timeout_s: float,
) -> T:
    """Run `step` until it succeeds and return its result.

    An error of a `retry_on` type (the dependency is unreachable) is retried after a jittered,
    exponentially growing pause (0.2 s, doubling, at most 5 s, plus up to 0.2 s) until `timeout_s` has passed since
    the first attempt; then it is raised. Any other error is raised at once. Raises
    `StartupInterrupted` when `stop` is set while waiting (a SIGTERM ends a pause at once).
    """

    def report(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.warning("dependency_unavailable", dependency=what, attempt=state.attempt_number,
                    waited_s=round(state.seconds_since_start or 0.0, 1),
                    retry_in_s=round(state.upcoming_sleep, 2), error=f"{type(error).__name__}: {error}")

    retrying = Retrying(
        retry=retry_if_exception_type(retry_on),
        stop=stop_after_delay(timeout_s) | stop_when_event_set(stop),
        wait=wait_exponential_jitter(multiplier=0.2, max=5.0, jitter=0.2),
        sleep=stop.wait,
        before_sleep=report,
        reraise=True,
    )
    try:
        result = retrying(step)
    except retry_on as exc:
        if stop.is_set():
            raise StartupInterrupted(f"stopped while waiting for {what}") from exc
        log.error("dependency_unavailable_at_start_up", dependency=what, timeout_s=timeout_s,
                  error=f"{type(exc).__name__}: {exc}")
        raise
    attempts = retrying.statistics.get("attempt_number", 1)
    if attempts > 1:
        log.info("dependency_available", dependency=what, attempts=attempts)
    return result
