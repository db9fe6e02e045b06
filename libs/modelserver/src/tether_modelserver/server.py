"""The HTTP server: OpenAI chat completions and Anthropic Messages over stdlib http.server, with a request log."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tether_modelserver import wire_anthropic, wire_openai
from tether_modelserver.conversation import BadRequest, Conversation, from_anthropic, from_openai
from tether_modelserver.engine import ErrorReply, Reply, TemplateError, decide
from tether_modelserver.scenarios import ScenarioSet

#: Headers copied into the request log (lower-case). Credentials are never logged, only their kind.
LOGGED_HEADERS = (
    "x-tether-run",
    "x-tether-step",
    "x-tether-call",
    "x-tether-attempt",
    "x-request-id",
    "anthropic-version",
    "user-agent",
    "content-type",
)
DEFAULT_MODEL = "tether-scripted"


class ServerNotStarted(Exception):
    """The server's address was asked for before `start`."""


class RequestLog:
    """Every request received, as JSON lines in a file (if given) and in memory."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, sort_keys=True)
        with self._lock:
            self._records.append(record)
            if self._path is not None:
                with self._path.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)


def read_request_log(path: Path) -> list[dict[str, Any]]:
    """Parse a request log file written by the server."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "tether-modelserver/0.1"
    # Keep-alive, as real providers do: clients (the planner's pooled httpx client) reuse their
    # connections. Under HTTP/1.0 every model call opened a new TCP connection, a cost of the
    # test double that no real deployment pays (≈ a quarter of the planner's CPU in make bench).
    # Every answer carries a Content-Length, except streams, which close their connection.
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        # The request log is the record; the default stderr access log would only duplicate it.
        return

    # -- GET -------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        if path in ("/v1/models", "/models"):
            names = sorted({DEFAULT_MODEL, *self.server.owner.model_names})
            body = {
                "object": "list",
                "data": [{"id": n, "object": "model", "created": 0, "owned_by": "tether-modelserver"} for n in names],
            }
            self._send_json(200, body)
        elif path in ("/healthz", "/health"):
            self._send_json(200, {"status": "ok", "scenarios": self.server.owner.scenarios.names})
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found", "code": None}})

    # -- POST ------------------------------------------------------------------------------
    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0]
        # Read first, whatever the route: on a kept-alive connection an unread body would be
        # taken for the next request.
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path in ("/v1/chat/completions", "/chat/completions"):
            api = "openai"
        elif path in ("/v1/messages", "/messages"):
            api = "anthropic"
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found", "code": None}})
            return
        record: dict[str, Any] = {
            "ts": datetime.now(UTC).isoformat(),
            "ts_ms": int(time.time() * 1000),
            "method": "POST",
            "path": path,
            "api": api,
            "headers": {h: self.headers[h] for h in LOGGED_HEADERS if self.headers.get(h) is not None},
            "auth": "bearer" if self.headers.get("authorization") else "x-api-key" if self.headers.get("x-api-key") else None,
            "scenario": None,
            "turn": None,
            "attempt": None,
            "status": None,
            "stream": False,
        }
        try:
            body: Any = json.loads(raw or b"null")
        except json.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        record["body"] = body
        send = self._answer(api, body, record)
        # Logged before the answer goes out, so a client that has its answer finds the record.
        self.server.owner.log.append(record)
        send()

    def _answer(self, api: str, body: Any, record: dict[str, Any]) -> Callable[[], None]:
        """Decide the answer, fill in the log record, and return what sends it."""
        try:
            conv = from_openai(body) if api == "openai" else from_anthropic(body)
        except BadRequest as exc:
            record["status"] = 400
            bad = ErrorReply(None, 0, 400, "invalid", str(exc), code="bad_request")
            return lambda: self._send_error(api, bad)
        try:
            attempt = int(self.headers.get("x-tether-attempt") or 1)
        except ValueError:
            attempt = 1
        run_id = self.headers.get("x-tether-run") or ""
        try:
            outcome = decide(self.server.owner.scenarios, conv, attempt=attempt, run_id=run_id)
        except TemplateError as exc:
            outcome = ErrorReply(None, conv.turn_index, 500, "server", str(exc), code="scenario_template_error")
        record.update(scenario=outcome.scenario, turn=outcome.turn, attempt=attempt, stream=conv.stream)
        record["status"] = outcome.status if isinstance(outcome, ErrorReply) else 200
        latency_s = outcome.latency_ms / 1000
        if isinstance(outcome, ErrorReply):
            err = outcome
            send = lambda: self._send_error(api, err)  # noqa: E731
        else:
            reply = outcome
            model = conv.model or DEFAULT_MODEL
            if conv.stream:
                send = lambda: self._send_stream(self._events(api, reply, conv))  # noqa: E731
            elif api == "openai":
                send = lambda: self._send_json(200, wire_openai.completion(reply, model))  # noqa: E731
            else:
                send = lambda: self._send_json(200, wire_anthropic.message(reply, model))  # noqa: E731

        def after_latency() -> None:
            # The scripted latency runs after the request is logged, so a client that gives up
            # (timeout) still finds its request in the log.
            if latency_s:
                time.sleep(latency_s)
            try:
                send()
            except (BrokenPipeError, ConnectionResetError):
                return

        return after_latency

    @staticmethod
    def _events(api: str, reply: Reply, conv: Conversation) -> Iterator[bytes]:
        model = conv.model or DEFAULT_MODEL
        if api == "openai":
            return wire_openai.stream_events(reply, model, conv.include_usage)
        return wire_anthropic.stream_events(reply, model)

    # -- sending ---------------------------------------------------------------------------
    def _send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, api: str, err: ErrorReply) -> None:
        body = wire_openai.error_body(err) if api == "openai" else wire_anthropic.error_body(err)
        headers = {}
        if err.retry_after is not None:
            headers["Retry-After"] = f"{err.retry_after:g}"
        self._send_json(err.status, body, headers)

    def _send_stream(self, events: Iterator[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        for event in events:
            self.wfile.write(event)
            self.wfile.flush()
        self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], owner: ModelServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)


class ModelServer:
    """The scripted model server; use in-process (`with ModelServer(...) as s: s.base_url`) or via the CLI."""

    def __init__(
        self,
        scenarios: ScenarioSet,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        request_log: Path | None = None,
        model_names: tuple[str, ...] = (),
    ) -> None:
        self.scenarios = scenarios
        self.model_names = model_names
        self.log = RequestLog(request_log)
        self._address = (host, port)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ModelServer:
        """Bind and serve on a background thread."""
        self._server = _Server(self._address, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="modelserver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = None
        self._thread = None

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise ServerNotStarted("the model server is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._address[0]}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (…/v1), what clients take as their base URL."""
        return f"{self.url}/v1"

    def requests(self) -> list[dict[str, Any]]:
        """Every request received so far (the same records as the request log file)."""
        return self.log.records()
