"""Prometheus metrics of the run-api (registered once per process on the default registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RPCS = Counter("tether_run_api_rpcs_total", "RPCs handled, by method and status code.", ["method", "code"])
RPC_SECONDS = Histogram(
    "tether_run_api_rpc_seconds",
    "Time to handle a unary RPC (streams: time to the first byte is not measured).",
    ["method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
REFUSALS = Counter("tether_run_api_refusals_total", "Refused requests, by ErrorInfo reason.", ["reason"])
SUBMITS = Counter("tether_run_api_submits_total", "SubmitRun calls answered with a run id.", ["outcome"])
STREAMS = Gauge("tether_run_api_streams_active", "Open StreamRunEvents calls.")
STREAMED_EVENTS = Counter("tether_run_api_streamed_events_total", "Events sent on StreamRunEvents.")
