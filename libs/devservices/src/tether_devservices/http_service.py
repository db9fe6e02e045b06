"""An HTTP test service that records every request and can misbehave on demand.

Endpoints (any method):
  /slow/<ms>          wait <ms> milliseconds, then echo
  /status/<code>      answer with that status code and a JSON body
  /garbage            200 with Content-Type application/json and a body that is not JSON (nor UTF-8)
  /huge/<bytes>       200 text/plain body of exactly <bytes> bytes
  /redirect?to=<url>  302 to <url>
  anything else       200 JSON echo of the request
Every request is recorded (method, path, query, body, Idempotency-Key) before it is answered,
so an effect is counted even when the client gives up waiting. `delay_ms` delays every answer.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tether_devservices.recorder import EffectRecorder
from tether_devservices.server import JsonHandler, RunningService, serve_http

GARBAGE = b"\xff\xfe{not json at all \x00\x81"
_HUGE_CHUNK = 64 * 1024


class _HttpTestHandler(JsonHandler):
    recorder: EffectRecorder
    delay_ms: int = 0

    def _handle(self) -> None:
        parts = urlsplit(self.path)
        path = parts.path
        query = {k: v[0] if len(v) == 1 else v for k, v in parse_qs(parts.query).items()}
        body = self.read_body()
        text = body.decode("utf-8", errors="replace")
        try:
            parsed: Any = json.loads(text) if text else None
        except json.JSONDecodeError:
            parsed = None
        request = {
            "method": self.command,
            "path": path,
            "query": query,
            "body": text,
            "json": parsed,
            "idempotency_key": self.headers.get("Idempotency-Key"),
            # So a test can see that a header the gateway added (e.g. a secret) arrived.
            "authorization": self.headers.get("Authorization"),
        }
        self.recorder.record(**request)
        if self.delay_ms:
            time.sleep(self.delay_ms / 1000)
        segments = [s for s in path.split("/") if s]
        head = segments[0] if segments else ""
        arg = segments[1] if len(segments) > 1 else ""
        if head == "slow" and arg.isdigit():
            time.sleep(int(arg) / 1000)
            self.send_json(200, {"echo": request, "slept_ms": int(arg)})
        elif head == "status" and arg.isdigit() and 200 <= int(arg) <= 599:
            self.send_json(int(arg), {"status": int(arg), "echo": request})
        elif head == "garbage":
            self.send_bytes(200, GARBAGE, "application/json")
        elif head == "huge" and arg.isdigit():
            self._send_huge(int(arg))
        elif head == "redirect" and isinstance(query.get("to"), str):
            self.send_json(302, {"redirect": query["to"]}, {"Location": query["to"]})
        else:
            self.send_json(200, {"echo": request})

    def _send_huge(self, size: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        left = size
        while left > 0 and self.command != "HEAD":
            n = min(left, _HUGE_CHUNK)
            self.wfile.write(b"x" * n)
            left -= n

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle


def start_http_service(record: str, host: str = "127.0.0.1", port: int = 0, delay_ms: int = 0) -> RunningService:
    """Start the HTTP test service on a background thread, recording to `record`."""
    recorder = EffectRecorder(record, "http")
    handler = type("HttpTestHandler", (_HttpTestHandler,), {"recorder": recorder, "delay_ms": delay_ms})
    return serve_http("http", handler, host, port, recorder.close)
