"""The metrics and health HTTP server every service runs (Prometheus /metrics, /healthz, /readyz)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = structlog.get_logger("tether_runtime.http")


class HealthServer:
    """Serves GET /metrics, /healthz (the process is alive) and /readyz (`ready()` is true).

    Binds 127.0.0.1 by default; port 0 picks a free port, reported by `port` and in the
    `health_server_listening` log line.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ready: Callable[[], bool] = lambda: True,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self._host = host
        self._port = port
        self._ready = ready
        self._registry = registry
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (after `start`)."""
        if self._server is None:
            raise RuntimeError("HealthServer is not started")
        return self._server.server_address[1]

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port."""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path == "/metrics":
                    self._reply(200, generate_latest(outer._registry), CONTENT_TYPE_LATEST)
                elif self.path == "/healthz":
                    self._reply(200, b"ok\n")
                elif self.path == "/readyz":
                    ok = outer._ready()
                    self._reply(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                else:
                    self._reply(404, b"not found\n")

            def _reply(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass  # probes every few seconds would drown the service's own log

        self._server = ThreadingHTTPServer((self._host, self._port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="health-http", daemon=True)
        self._thread.start()
        log.info("health_server_listening", host=self._host, port=self.port)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
