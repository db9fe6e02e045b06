"""The lag gauge forgets the partitions the loop no longer owns.

The lag alert in deploy/helm sums `tether_loop_lag_records` by service; after a rebalance the new
owner exports the partition's lag, so a series the old owner kept would be counted twice and
frozen at its last value until that process restarts.
"""

from __future__ import annotations

from prometheus_client import REGISTRY

from tether_messaging.loop import LoopConfig, ProcessorLoop

TOPIC = "tether.run-events.v1"


class _Processor:
    name = "lag-metric-test"
    state_codec = None
    inputs = (TOPIC,)


class _Watermarks:
    """Only what _update_lag asks of a consumer: the partition's high watermark."""

    def get_watermark_offsets(self, tp, cached=True):
        return (0, 5000)


def _lag_series() -> dict[str, float]:
    return {
        s.labels["partition"]: s.value
        for m in REGISTRY.collect() if m.name == "tether_loop_lag_records"
        for s in m.samples if s.labels.get("service") == _Processor.name
    }


def test_a_dropped_partitions_lag_is_no_longer_exported() -> None:
    loop = ProcessorLoop(_Processor(), LoopConfig(bootstrap="127.0.0.1:1"))
    loop._consumer = _Watermarks()
    loop._owned = {0: {TOPIC}, 1: {TOPIC}, 2: {TOPIC}}
    loop._next = {(TOPIC, 0): 1000, (TOPIC, 1): 4000, (TOPIC, 2): 4990}
    loop._update_lag()
    assert _lag_series() == {"0": 4000.0, "1": 1000.0, "2": 10.0}

    loop._drop([0, 1], "revoked")
    loop._update_lag()

    assert _lag_series() == {"2": 10.0}
    loop._drop([7], "lost")  # a partition never measured: nothing to forget, no error
    assert _lag_series() == {"2": 10.0}
