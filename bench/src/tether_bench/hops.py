"""Where a hop's time goes: the run loop's latency histograms, read from each service's /metrics.

The loop (tether_messaging.loop) records, per service, how old an input record is when the loop
takes it (the upstream commit, read_committed visibility and the fetch), how long a batch's
handling takes, its commit, and for work (a model call, a tool call) the wait for a worker thread
and the wait for the loop to deliver the result. Snapshots taken before and after a phase give
each figure's mean over that phase alone (histogram sums and counts are exact; bucket-based
percentiles would only be as fine as the buckets).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

#: Histogram name (without _seconds) → the short name the bench reports.
HOP_METRICS = {
    "tether_loop_input_age": "input_age",
    "tether_loop_handle": "handle",
    "tether_loop_commit": "commit",
    "tether_loop_work_start": "work_start",
    "tether_loop_work_deliver": "work_deliver",
}

Snapshot = dict[str, tuple[float, float]]  # short name → (sum of seconds, count)


def parse_hop_metrics(text: str) -> Snapshot:
    """Sum and count of each loop latency histogram in a Prometheus text exposition."""
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        short = HOP_METRICS.get(family.name.removesuffix("_seconds"))
        if short is None:
            continue
        total = count = 0.0
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
        out[short] = (total, count)
    return out


def scrape(metrics_url: str, timeout: float = 5.0) -> Snapshot:
    """One service's loop histograms now; empty if the service does not answer (it may be restarting)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:
            return parse_hop_metrics(resp.read().decode())
    except OSError:
        return {}


def mean_ms_between(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """Each histogram's mean (ms) over what was observed between two snapshots, and its count."""
    out: dict[str, float | None] = {}
    for short in HOP_METRICS.values():
        if short not in after:
            continue
        s0, c0 = before.get(short, (0.0, 0.0))
        s1, c1 = after[short]
        n = c1 - c0
        out[f"{short}_ms_mean"] = round((s1 - s0) / n * 1000, 2) if n > 0 else None
        out[f"{short}_n"] = int(n)
    return out


def hop_means(before: Mapping[str, Snapshot], after: Mapping[str, Snapshot]) -> dict[str, dict[str, float | None]]:
    """Per service (those present in both): `mean_ms_between`."""
    return {name: mean_ms_between(before[name], after[name]) for name in after if name in before and after[name]}
