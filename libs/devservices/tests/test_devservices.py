"""The dev services record every effect where it lands, and misbehave only when told to."""

from __future__ import annotations

import concurrent.futures
import json
import smtplib
from email.message import EmailMessage

import httpx
import pytest

from tether_devservices.http_service import GARBAGE, start_http_service
from tether_devservices.kv_service import start_kv_service
from tether_devservices.process import spawn
from tether_devservices.recorder import EffectRecorder, read_records
from tether_devservices.smtp_sink import start_smtp_sink


@pytest.fixture
def record(tmp_path):
    return tmp_path / "effects.jsonl"


# -- recorder ------------------------------------------------------------------------------
def test_recorder_appends_and_continues_numbering_after_restart(record):
    r = EffectRecorder(record, "x")
    r.record(a=1)
    r.record(a=2)
    r.close()
    with record.open("a") as f:
        f.write('{"torn": ')  # a writer that died mid-line
    r2 = EffectRecorder(record, "x")
    r2.record(a=3)
    r2.close()
    recs = read_records(record)
    assert [x["a"] for x in recs] == [1, 2, 3]
    assert [x["seq"] for x in recs] == [1, 2, 3]


# -- HTTP test service ---------------------------------------------------------------------
def test_http_service_echoes_and_records_method_path_body_and_idempotency_key(record):
    with start_http_service(str(record)) as svc:
        r = httpx.post(f"{svc.url}/orders?x=1", json={"n": 1}, headers={"Idempotency-Key": "k-1"})
        g = httpx.get(f"{svc.url}/things")
    assert r.status_code == 200 and r.json()["echo"]["json"] == {"n": 1}
    assert g.status_code == 200
    recs = read_records(record)
    assert [(x["method"], x["path"]) for x in recs] == [("POST", "/orders"), ("GET", "/things")]
    assert recs[0]["idempotency_key"] == "k-1" and recs[0]["query"] == {"x": "1"}
    assert recs[1]["idempotency_key"] is None


def test_http_service_misbehaves_on_demand(record):
    with start_http_service(str(record)) as svc:
        assert httpx.get(f"{svc.url}/status/500").status_code == 500
        garbage = httpx.get(f"{svc.url}/garbage")
        with pytest.raises(json.JSONDecodeError):
            json.loads(garbage.content.decode("utf-8", errors="replace"))
        assert garbage.content == GARBAGE
        huge = httpx.get(f"{svc.url}/huge/300000")
        assert len(huge.content) == 300000
        redirect = httpx.get(f"{svc.url}/redirect?to=http://example.invalid/x")
        assert redirect.status_code == 302 and redirect.headers["location"] == "http://example.invalid/x"
        slow = httpx.get(f"{svc.url}/slow/20")
        assert slow.json()["slept_ms"] == 20
    assert len(read_records(record)) == 5


# -- KV store ------------------------------------------------------------------------------
def test_kv_put_get_and_versioning(record):
    with start_kv_service(str(record)) as svc:
        assert httpx.get(f"{svc.url}/kv/a").status_code == 404
        assert httpx.put(f"{svc.url}/kv/a", json={"value": {"x": 1}}).json() == {"key": "a", "version": 1}
        assert httpx.put(f"{svc.url}/kv/a", json={"value": 2}).json()["version"] == 2
        got = httpx.get(f"{svc.url}/kv/a").json()
    assert got == {"key": "a", "value": 2, "version": 2}
    assert [x["applied"] for x in read_records(record)] == [True, True]


def test_kv_same_idempotency_key_is_recorded_as_duplicate_but_applied_once(record):
    with start_kv_service(str(record)) as svc:
        first = httpx.put(f"{svc.url}/kv/k", json={"value": "v"}, headers={"Idempotency-Key": "idem-1"})
        again = httpx.put(f"{svc.url}/kv/k", json={"value": "v"}, headers={"Idempotency-Key": "idem-1"})
        other = httpx.put(f"{svc.url}/kv/k", json={"value": "w"}, headers={"Idempotency-Key": "idem-1"})
        value = httpx.get(f"{svc.url}/kv/k").json()
    assert first.json() == again.json() == {"key": "k", "version": 1}
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422
    assert value["value"] == "v" and value["version"] == 1
    recs = read_records(record)
    assert len(recs) == 3  # three attempts arrived ...
    assert sum(r["applied"] for r in recs) == 1  # ... one was applied
    assert [r["duplicate"] for r in recs] == [False, True, True]
    assert [r["conflict"] for r in recs] == [False, False, True]


def test_kv_concurrent_attempts_with_one_key_apply_once(record):
    with start_kv_service(str(record)) as svc:
        def put(_):
            return httpx.put(f"{svc.url}/kv/c", json={"value": 1}, headers={"Idempotency-Key": "same"}).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(put, range(16)))
    assert codes == [200] * 16
    recs = read_records(record)
    assert len(recs) == 16 and sum(r["applied"] for r in recs) == 1


def test_kv_restart_keeps_values_and_idempotency_keys(record):
    with start_kv_service(str(record)) as svc:
        httpx.put(f"{svc.url}/kv/r", json={"value": 7}, headers={"Idempotency-Key": "idem-r"})
    with start_kv_service(str(record)) as svc:
        again = httpx.put(f"{svc.url}/kv/r", json={"value": 7}, headers={"Idempotency-Key": "idem-r"})
        got = httpx.get(f"{svc.url}/kv/r").json()
    assert again.headers["idempotent-replayed"] == "true"
    assert got == {"key": "r", "value": 7, "version": 1}
    assert [r["applied"] for r in read_records(record)] == [True, False]


def test_kv_rejects_a_body_without_value(record):
    with start_kv_service(str(record)) as svc:
        r = httpx.put(f"{svc.url}/kv/z", content=b"nope")
    assert r.status_code == 400
    assert read_records(record)[0]["applied"] is False


# -- SMTP sink -----------------------------------------------------------------------------
def test_smtp_sink_records_from_to_subject_body(record):
    with start_smtp_sink(str(record)) as svc:
        msg = EmailMessage()
        msg["From"] = "agent@tether.test"
        msg["To"] = "ops@example.test"
        msg["Subject"] = "Disk almost full"
        msg["X-Idempotency-Key"] = "abc"
        msg.set_content("Please look at host 7.")
        with smtplib.SMTP(svc.host, svc.port, timeout=10) as smtp:
            smtp.send_message(msg)
    (rec,) = read_records(record)
    assert rec["mail_from"] == "agent@tether.test"
    assert rec["rcpt_tos"] == ["ops@example.test"]
    assert rec["subject"] == "Disk almost full"
    assert rec["body"].strip() == "Please look at host 7."
    assert rec["idempotency_key"] == "abc"


# -- as separate processes -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["http", "kv", "smtp"])
def test_cli_process_reports_its_port_and_records(tmp_path, kind):
    record = tmp_path / f"{kind}.jsonl"
    with spawn(kind, record) as svc:
        if kind == "http":
            httpx.get(f"{svc.url}/hello")
        elif kind == "kv":
            httpx.put(f"{svc.url}/kv/p", json={"value": 1})
        else:
            with smtplib.SMTP(svc.host, svc.port, timeout=10) as smtp:
                smtp.sendmail("a@x.test", ["b@x.test"], "Subject: hi\r\n\r\nbody\r\n")
        assert len(svc.records()) == 1
    assert svc.process.returncode == 0


@pytest.mark.parametrize("kind", ["kv", "smtp"])
def test_delayed_service_records_the_effect_before_it_answers(record, kind):
    # The client gives up long before the answer; the effect is recorded anyway. (Its timeout is
    # for each step: 2 s, so a slow greeting on a loaded machine does not end it before the send.)
    if kind == "kv":
        with start_kv_service(str(record), delay_ms=8_000) as svc:
            with pytest.raises(httpx.TimeoutException):
                httpx.put(f"{svc.url}/kv/d", json={"value": 1}, timeout=2.0)
            got = httpx.get(f"{svc.url}/kv/d").json()
        assert got["value"] == 1
    else:
        with start_smtp_sink(str(record), delay_ms=8_000) as svc:
            with pytest.raises((TimeoutError, smtplib.SMTPException, OSError)):
                with smtplib.SMTP(svc.host, svc.port, timeout=2.0) as smtp:
                    smtp.sendmail("a@x.test", ["b@x.test"], "Subject: hi\r\n\r\nbody\r\n")
    assert len(read_records(record)) == 1
