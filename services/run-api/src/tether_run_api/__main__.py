"""`python -m tether_run_api`: settings → bootstrap → gRPC server (+ metrics/health HTTP) until SIGTERM."""

from __future__ import annotations

import threading
import time

import structlog

from tether_run_api import handlers
from tether_run_api.api.server import start_server
from tether_run_api.bootstrap import App, build_app
from tether_run_api.settings import RunApiSettings
from tether_runtime import logging as runtime_logging
from tether_runtime.http import HealthServer
from tether_runtime.service import run
from tether_runtime.startup import StartupInterrupted

log = structlog.get_logger("tether_run_api")


def sweep_undelivered(app: App, stop: threading.Event) -> None:
    """Every few seconds, produce submits whose acknowledgement never came (see handlers.redeliver_submissions)."""
    s = app.settings
    while not stop.wait(s.redeliver_interval_s):
        try:
            n = handlers.redeliver_submissions(
                ledger=app.services.ledger, publisher=app.services.publisher,
                now_ms=time.time_ns() // 1_000_000, grace_ms=int(s.redeliver_after_s * 1000),
            )
            if n:
                log.info("submits_redelivered", count=n)
        except Exception as exc:  # PostgreSQL or Kafka down: the next round tries again
            log.warning("redelivery_failed", error=f"{type(exc).__name__}: {exc}")


def serve(stop: threading.Event, settings: RunApiSettings | None = None) -> int:
    """Serve until `stop` is set; then stop accepting, drain in-flight calls, flush Kafka."""
    settings = settings or RunApiSettings()
    runtime_logging.configure("run-api", settings.log_level, instance=settings.instance_id)
    app: App | None = None
    server = None
    # Up before PostgreSQL is: /healthz says alive, and /readyz not ready until gRPC is served
    # (build_app may wait for the database first).
    http = HealthServer(host=settings.http_host, port=settings.metrics_port,
                        ready=lambda: server is not None and app is not None and app.ready())
    http.start()
    try:
        try:
            app = build_app(settings, stop=stop)
        except StartupInterrupted:
            return 0
        server = start_server(
            app.services,
            host=settings.host,
            port=settings.port,
            workers=settings.grpc_workers,
            max_receive_message_bytes=settings.max_receive_message_bytes,
            max_send_message_bytes=settings.max_send_message_bytes,
        )
        log.info("grpc_listening", host=settings.host, port=server.port)
        sweeper = threading.Thread(target=sweep_undelivered, args=(app, stop), name="redeliver", daemon=True)
        sweeper.start()
        stop.wait()
        sweeper.join(timeout=5.0)
    finally:
        if server is not None:
            server.stop(grace_s=5.0)
        http.stop()
        if app is not None:
            app.close()
    return 0


def main() -> None:
    """Console entry point `tether-run-api`."""
    raise SystemExit(run(serve))


if __name__ == "__main__":
    main()
