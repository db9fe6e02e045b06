"""The health server answers /healthz, /readyz (following the readiness callable) and /metrics."""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Counter

from tether_runtime.http import HealthServer


def test_health_ready_and_metrics_on_an_ephemeral_loopback_port() -> None:
    registry = CollectorRegistry()
    Counter("tether_test_things_total", "Things.", registry=registry).inc(3)
    ready = {"value": False}
    server = HealthServer(port=0, ready=lambda: ready["value"], registry=registry)
    port = server.start()
    try:
        assert port > 0
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/readyz").status_code == 503
        ready["value"] = True
        assert httpx.get(f"{base}/readyz").status_code == 200
        metrics = httpx.get(f"{base}/metrics")
        assert metrics.status_code == 200
        assert "tether_test_things_total 3.0" in metrics.text
        assert httpx.get(f"{base}/nope").status_code == 404
    finally:
        server.stop()
