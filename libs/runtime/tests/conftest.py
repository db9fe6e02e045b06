"""Shared fixtures of the runtime library's tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Put structlog and the root logger back as they were after each test.

    `tether_runtime.logging.configure` points both at the `sys.stderr` of the moment, which under
    `capsys` is a capture stream closed after the test: left configured, every later test in the
    process that logs would write to a closed file."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**saved)
    root.handlers[:] = handlers
    root.setLevel(level)
