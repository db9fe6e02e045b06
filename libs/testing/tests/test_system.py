"""TetherSystem's naming and its recorded-PID cleanup (the whole system itself is exercised by tests/e2e)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tether_testing.system import Names, TetherSystemError, drop_namespace, stop_recorded


def test_a_namespace_prefixes_every_name_and_the_empty_one_is_production() -> None:
    ns = Names("e2e_abc")
    assert ns.topics.run_events == "e2e_abc.tether.run-events.v1"
    assert ns.topics.group_id("budget") == "e2e_abc.budget"
    assert ns.schemas == ["e2e_abc_run_api", "e2e_abc_read_model", "e2e_abc_gateway", "e2e_abc_blobs"]
    assert ns.live_key_prefix == "e2e_abc:"
    prod = Names("")
    assert prod.topics.run_events == "tether.run-events.v1"
    assert prod.schemas == ["run_api", "read_model", "gateway", "blobs"]
    assert prod.live_key_prefix == ""


def test_the_production_names_are_never_dropped() -> None:
    with pytest.raises(TetherSystemError):
        drop_namespace(Names(""), kafka_bootstrap="unused:1", pg_dsn="unused", redis_url="redis://unused:1")


def _sleeper(seconds: str) -> tuple[subprocess.Popen[bytes], list[str]]:
    argv = [sys.executable, "-c", "import time, sys; time.sleep(float(sys.argv[1]))", seconds]
    return subprocess.Popen(argv, start_new_session=True), argv


def test_stop_recorded_stops_recorded_processes_and_leaves_a_reused_pid_alone(tmp_path) -> None:
    ours, argv = _sleeper("60")
    other, _ = _sleeper("61")
    try:
        (tmp_path / "processes.json").write_text(json.dumps({"processes": [
            {"name": "ours", "pid": ours.pid, "argv": argv},
            # A PID now running something else than what was recorded (PID reuse): not ours.
            {"name": "reused", "pid": other.pid, "argv": argv},
        ]}))
        assert stop_recorded(tmp_path, grace_s=5) == ["ours"]
        assert ours.wait(10) is not None
        assert other.poll() is None
        assert not (tmp_path / "processes.json").exists()
        assert stop_recorded(tmp_path) == []
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()


def test_more_instances_only_of_loop_services_and_never_in_slot_zero(tmp_path) -> None:
    from tether_testing.system import SystemConfig, TetherSystem

    system = TetherSystem(SystemConfig(kafka_bootstrap="unused:1", pg_dsn="unused", redis_url="redis://unused:1",
                                       workdir=tmp_path))
    with pytest.raises(TetherSystemError):
        system.start_instance("run-api", 1)
    with pytest.raises(TetherSystemError):
        system.start_instance("planner", 0)


def test_the_pid_file_survives_writers_on_many_threads(tmp_path) -> None:
    # make chaos kills and restarts services from several threads; two writers of the one temporary
    # file once raced (FileNotFoundError), which ended its kill loop early.
    import threading

    from tether_testing.system import SystemConfig, TetherSystem

    system = TetherSystem(SystemConfig(kafka_bootstrap="127.0.0.1:1", pg_dsn="postgresql://x@127.0.0.1:1/x",
                                       redis_url="redis://127.0.0.1:1/0", workdir=tmp_path))
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(300):
                system._write_state()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads((tmp_path / "processes.json").read_text())["processes"] == []
