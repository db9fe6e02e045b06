"""Start-up waits for an unreachable dependency with backoff, for a bounded time, and stops when asked."""

from __future__ import annotations

import threading
import time

import pytest
from structlog.testing import capture_logs

from tether_runtime.startup import StartupInterrupted, wait_for_dependency


class Unreachable(Exception):
    """Stands for the driver's connection error."""


class FlakyStep:
    """Fails with `Unreachable` the first `failures` times, then returns 'schema ready'."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise Unreachable(f"connection refused ({self.calls})")
        return "schema ready"


def test_an_unreachable_dependency_is_retried_until_it_answers() -> None:
    step = FlakyStep(failures=3)
    with capture_logs() as logs:
        result = wait_for_dependency(step, what="db", retry_on=(Unreachable,), stop=threading.Event(), timeout_s=60)
    assert result == "schema ready" and step.calls == 4
    waits = [e for e in logs if e["event"] == "dependency_unavailable"]
    assert [e["attempt"] for e in waits] == [1, 2, 3]
    assert waits[0]["error"] == "Unreachable: connection refused (1)" and waits[0]["dependency"] == "db"
    assert [e["attempts"] for e in logs if e["event"] == "dependency_available"] == [4]


def test_the_last_error_ends_start_up_once_the_wait_is_over() -> None:
    step = FlakyStep(failures=10**6)
    with capture_logs() as logs, pytest.raises(Unreachable):
        wait_for_dependency(step, what="db", retry_on=(Unreachable,), stop=threading.Event(), timeout_s=0.5)
    assert [e["event"] for e in logs][-1] == "dependency_unavailable_at_start_up"
    assert 1 < step.calls < 10  # backoff between attempts, and no attempt after the wait


def test_other_errors_are_not_retried() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise ValueError("bad schema name")

    with pytest.raises(ValueError):
        wait_for_dependency(broken, what="db", retry_on=(Unreachable,), stop=threading.Event(), timeout_s=60)
    assert len(calls) == 1


def test_a_stop_request_ends_the_wait_at_once() -> None:
    stop = threading.Event()
    step = FlakyStep(failures=10**6)
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    with capture_logs(), pytest.raises(StartupInterrupted):
        wait_for_dependency(step, what="db", retry_on=(Unreachable,), stop=stop, timeout_s=600)
    assert time.monotonic() - started < 60  # not the 600 s wait
