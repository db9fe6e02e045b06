"""A key-value store over HTTP that honours Idempotency-Key and records every write attempt.

  PUT /kv/<key>  body {"value": <any JSON>}, optional header Idempotency-Key
  GET /kv/<key>  {"key", "value", "version"} or 404

A PUT whose Idempotency-Key was seen before with the same request is recorded as a duplicate
attempt (applied=false, duplicate=true) and answered with the first response plus the header
`Idempotent-Replayed: true`; the same key with a different request is a 422 conflict. So the
record file shows both facts: how many attempts arrived, and how many were applied.
The store's state is rebuilt from the record file at start-up, so a restart keeps both the
values and the idempotency keys. With `delay_ms`, every write is applied and recorded at once
but answered only after the delay (a client can die between the effect and the answer).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from tether_devservices.recorder import EffectRecorder, read_records
from tether_devservices.server import JsonHandler, RunningService, serve_http


@dataclass
class KvState:
    """Values and remembered idempotency keys; guarded by `lock`."""

    values: dict[str, tuple[Any, int]] = field(default_factory=dict)
    idempotency: dict[str, tuple[str, int, dict[str, Any]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_records(cls, records: list[dict[str, Any]]) -> KvState:
        state = cls()
        for r in records:
            if r.get("op") != "put" or not r.get("applied"):
                continue
            state.values[r["key"]] = (r["value"], r["version"])
            if r.get("idempotency_key"):
                state.idempotency[r["idempotency_key"]] = (r["fingerprint"], r["status"], r["response"])
        return state


def _key_from_path(path: str) -> str | None:
    p = urlsplit(path).path
    if not p.startswith("/kv/") or len(p) <= 4:
        return None
    return unquote(p[4:])


class _KvHandler(JsonHandler):
    recorder: EffectRecorder
    state: KvState
    delay_ms: int = 0

    def do_GET(self) -> None:
        key = _key_from_path(self.path)
        if key is None:
            self.send_json(404, {"error": "not_found"})
            return
        with self.state.lock:
            found = self.state.values.get(key)
        if found is None:
            self.send_json(404, {"error": "not_found", "key": key})
        else:
            self.send_json(200, {"key": key, "value": found[0], "version": found[1]})

    def do_PUT(self) -> None:
        key = _key_from_path(self.path)
        body = self.read_body()
        idem = self.headers.get("Idempotency-Key") or None
        if key is None:
            self.send_json(404, {"error": "not_found"})
            return
        try:
            value = json.loads(body)["value"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            self.recorder.record(op="put", key=key, idempotency_key=idem, applied=False, duplicate=False,
                                 conflict=False, status=400, error="body must be JSON {\"value\": ...}")
            self.send_json(400, {"error": "bad_request", "detail": "body must be JSON {\"value\": ...}"})
            return
        fingerprint = hashlib.sha256(b"PUT\x1f" + key.encode() + b"\x1f" + body).hexdigest()
        # The check, the apply and the record happen under one lock so two concurrent attempts
        # with the same key cannot both apply.
        with self.state.lock:
            seen = self.state.idempotency.get(idem) if idem else None
            if seen is not None:
                first_fp, first_status, first_response = seen
                conflict = first_fp != fingerprint
                status = 422 if conflict else first_status
                response = {"error": "idempotency_key_reused", "key": key} if conflict else first_response
                self.recorder.record(op="put", key=key, value=value, idempotency_key=idem, applied=False,
                                     duplicate=True, conflict=conflict, status=status, fingerprint=fingerprint)
                headers = {} if conflict else {"Idempotent-Replayed": "true"}
            else:
                version = self.state.values.get(key, (None, 0))[1] + 1
                self.state.values[key] = (value, version)
                status = 200
                response = {"key": key, "version": version}
                if idem:
                    self.state.idempotency[idem] = (fingerprint, status, response)
                self.recorder.record(op="put", key=key, value=value, idempotency_key=idem, applied=True,
                                     duplicate=False, conflict=False, status=status, version=version,
                                     fingerprint=fingerprint, response=response)
                headers = {}
        if self.delay_ms:
            time.sleep(self.delay_ms / 1000)
        self.send_json(status, response, headers)


def start_kv_service(record: str, host: str = "127.0.0.1", port: int = 0, delay_ms: int = 0) -> RunningService:
    """Start the KV store on a background thread; its state is rebuilt from `record` if it exists."""
    state = KvState.from_records(read_records(record))
    recorder = EffectRecorder(record, "kv")
    handler = type("KvHandler", (_KvHandler,), {"recorder": recorder, "state": state, "delay_ms": delay_ms})
    return serve_http("kv", handler, host, port, recorder.close)
