"""CPU of the projector's pure batch work: 60 runs' events, interleaved as on a partition, through
`project_batch` with a read model that stores nothing (no PostgreSQL, no Redis).

    .venv/bin/python services/projector/bench/batch_cpu.py [--rounds 15]

Prints the median time per batch and per event. Compare trees side by side (same machine, same
minute): the figure moves with the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from tether_projector.domain.rows import Upsert
from tether_projector.domain.state import RunFold
from tether_projector.handlers import Deps, project_batch
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LogEvent
from tether_projector.testing import happy_run, troubled_run


class _NoTx:
    def load_runs(self, run_ids: Sequence[str]) -> dict[str, RunFold]:
        return {}

    def write(self, writes: Sequence[Upsert]) -> None:
        pass


class _NoReadModel:
    def ensure_schema(self) -> None:
        pass

    @contextmanager
    def transaction(self) -> Iterator[_NoTx]:
        yield _NoTx()


def interleaved_events(runs: int) -> list[LogEvent]:
    logs = [(happy_run if i % 2 else troubled_run)(f"run-{i}").log_events() for i in range(runs)]
    out: list[LogEvent] = []
    while any(logs):
        for log in logs:
            if log:
                out.append(log.pop(0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--runs", type=int, default=60)
    args = ap.parse_args()
    events = interleaved_events(args.runs)
    deps = Deps(read_model=_NoReadModel(), live=None, metrics=ProjectorMetrics(CollectorRegistry()))
    times = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        project_batch(events, deps=deps)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    print(f"{len(events)} events per batch: median {median * 1e3:.1f} ms per batch, {median / len(events) * 1e6:.0f} µs per event")


if __name__ == "__main__":
    main()
