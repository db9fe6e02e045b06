"""e2e fixtures: the whole system as real processes on the real stack, and readers of its evidence."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether_api.v1 import run_service_pb2 as runs_pb
from tether_contracts.records import Envelope
from tether_messaging.logreader import read_to_end
from tether_testing.system import SystemConfig, TetherSystem

#: Few partitions: the tests need a real multi-partition log, not throughput, on a small machine.
PARTITIONS = 2
SCENARIOS = Path(__file__).parent / "scenarios"
#: The goal marker of tests/e2e/scenarios/e2e.json: http_get + kv_put in step 1, send_email in step 2, answer.
SCENARIO = "[scenario:e2e-three-tools]"
TERMINAL_STATUSES = {runs_pb.RUN_STATUS_COMPLETED, runs_pb.RUN_STATUS_TERMINATED, runs_pb.RUN_STATUS_REJECTED}


def live_processes(*, env_entry: str | None = None, in_cmdline: str | None = None) -> list[int]:
    """PIDs of live processes whose environment holds `env_entry` (e.g. TETHER_TOPIC_PREFIX=<ns>.) or
    whose command line contains `in_cmdline` (e.g. a work directory its arguments name)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    continue
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ")
        except OSError:
            continue
        if (env_entry is not None and env_entry.encode() in environ) or \
                (in_cmdline is not None and in_cmdline.encode() in cmdline):
            found.append(pid)
    return found


@pytest.fixture(scope="session")
def tether_system(kafka_bootstrap: str, pg_dsn: str, redis_url: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[TetherSystem]:
    """Sinks, the scripted model, the six services and a tenant, in a namespace of their own."""
    system = TetherSystem(SystemConfig(
        kafka_bootstrap=kafka_bootstrap, pg_dsn=pg_dsn, redis_url=redis_url,
        workdir=tmp_path_factory.mktemp("tether-system"), partitions=PARTITIONS, scenarios=[SCENARIOS],
    ))
    try:
        system.start()
        yield system
    finally:
        system.stop()
        leftovers = live_processes(env_entry=f"TETHER_TOPIC_PREFIX={system.names.topic_prefix}",
                                   in_cmdline=str(system.workdir))
        system.drop_data()
    assert not leftovers, f"processes of the system still running after stop(): {leftovers}"


class EventLog:
    """Reads `tether.run-events.v1` of a system from offset 0 with read_committed, as an auditor would."""

    def __init__(self, system: TetherSystem) -> None:
        self.system = system
        self.topic = system.names.topics.run_events

    def read_all(self, timeout_s: float = 60.0) -> list[tuple[int, int, Envelope]]:
        """(partition, offset, envelope) of every committed record, up to each partition's end
        as the broker reports it when reading begins (`tether_messaging.logreader`, the reader
        `tether audit verify` and the chaos checker use)."""
        records = read_to_end(self.system.config.kafka_bootstrap, self.topic, timeout_s=timeout_s,
                              group_prefix=f"{self.topic}.e2e-auditor")
        return [(r.partition, r.offset, r.envelope) for r in records]

    def run(self, run_id: str) -> list[Envelope]:
        """The run's events in log order."""
        return [env for _, _, env in self.read_all() if env.run_id == run_id]


@pytest.fixture
def event_log(tether_system: TetherSystem) -> EventLog:
    return EventLog(tether_system)


def payload(event: runs_pb.RunEvent) -> dict:
    """The JSON payload of a streamed event."""
    return json.loads(event.payload_json or "{}")


class Runs:
    """Submits scripted runs to a system and waits for them (test modules cannot import each other)."""

    def __init__(self, system: TetherSystem) -> None:
        self.system = system

    def submit(self) -> tuple[str, str]:
        """Submit a run of the e2e scenario; returns (run_id, the unique URL its http_get fetches)."""
        url = f"{self.system.sink_urls['http']}/e2e/{uuid.uuid4().hex}"
        run_id = self.system.client.submit(f"{SCENARIO} Fetch {url}, note the goal and email the on-call.")
        return run_id, url

    def logs(self) -> str:
        names = ("planner", "budget", "tool-gateway", "approval", "projector", "run-api")
        return "\n".join(f"--- {name}\n{self.system.log_tail(name, 20)}" for name in names)

    def wait_for_end(self, run_id: str, timeout_s: float = 120.0) -> runs_pb.Run:
        """GetRun until the read model shows the run ended (the row may trail the stream's terminal event)."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.system.client.get_run(run_id)
            if run.status in TERMINAL_STATUSES:
                return run
            if time.monotonic() > deadline:
                pytest.fail(f"run {run_id} still {runs_pb.RunStatus.Name(run.status)} after {timeout_s:.0f}s\n"
                            + self.logs())
            time.sleep(0.2)


@pytest.fixture
def runs(tether_system: TetherSystem) -> Runs:
    return Runs(tether_system)


@pytest.fixture
def processes_of():
    """`processes_of(env_entry=..., in_cmdline=...)`: see live_processes."""
    return live_processes
