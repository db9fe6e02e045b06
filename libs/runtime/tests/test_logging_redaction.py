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


class _Holder:
    """An object whose repr() shows the secret it holds (dataclass-style)."""

    def __init__(self, token: str) -> None:
        self.value = token

    def __repr__(self) -> str:
        return f"_Holder(value={self.value!r})"


def test_a_secret_inside_values_the_redactor_cannot_read_is_redacted_as_printed(capsys):
    # The redactor scans str/dict/list/tuple only; the renderer repr()s everything else after it.
    configure("test-service", "INFO")
    log_redactor().add_secret(CANARY)
    log = structlog.get_logger("t")
    log.warning("webhook_failed", error=ConnectionError(f"refused by https://h.example/{CANARY}"))
    log.info("things", tags={CANARY, "plain"}, raw=CANARY.encode(), nested={"k": [(_Holder(CANARY),)]})
    logging.getLogger("lib").warning("stdlib", extra={"obj": _Holder(CANARY)})
    err = capsys.readouterr().err
    assert CANARY not in err
    failed, things = _lines(err)[:2]
    assert failed["error"] == "ConnectionError: refused by https://h.example/[REDACTED:secret]"
    assert sorted(things["tags"]) == ["[REDACTED:secret]", "plain"]
    assert things["raw"] == "[REDACTED:secret]"
    assert things["nested"] == {"k": [["_Holder(value='[REDACTED:secret]')"]]}


def test_ordinary_values_of_other_types_are_printed_as_before(capsys):
    configure("test-service", "INFO")
    structlog.get_logger().info("mixed", ok=True, n=None, ratio=0.5, pair=(1, "a"), obj=_Holder("x"),
                                exc=ValueError(), data=b"\xffab")
    (event,) = _lines(capsys.readouterr().err)
    assert event["ok"] is True and event["n"] is None and event["ratio"] == 0.5 and event["pair"] == [1, "a"]
    assert event["obj"] == "_Holder(value='x')" and event["exc"] == "ValueError"
    assert event["data"] == "\ufffdab"
