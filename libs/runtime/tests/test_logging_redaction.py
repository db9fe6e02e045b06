"""Every log line, structlog's and stdlib's, passes through the process-wide redactor."""

from __future__ import annotations

import json
import logging

import structlog

from tether_runtime.logging import configure, log_redactor

CANARY = "tether-canary-9f8e7d6c5b4a39281716"


def _lines(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_registered_secret_and_secret_shaped_strings_never_reach_the_log(capsys):
    configure("test-service", "INFO")
    log_redactor().add_secret(CANARY)
    log = structlog.get_logger("t")
    log.info("calling tool", header=f"Bearer {CANARY}", nested={"k": [CANARY]})
    logging.getLogger("lib").warning("stdlib says %s", CANARY)
    log.info("aws", key="AKIAIOSFODNN7EXAMPLE")
    err = capsys.readouterr().err
    assert CANARY not in err
    assert "AKIAIOSFODNN7EXAMPLE" not in err
    events = _lines(err)
    assert [e["event"] for e in events][:1] == ["calling tool"]
    assert any("REDACTED" in json.dumps(e) for e in events)


def test_ordinary_fields_are_kept(capsys):
    configure("test-service", "INFO")
    structlog.get_logger().info("run accepted", run_id="run-123", seq=4)
    (event,) = _lines(capsys.readouterr().err)
    assert event["run_id"] == "run-123" and event["seq"] == 4 and event["service"] == "test-service"
