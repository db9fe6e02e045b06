"""Nothing `make bench` or `make chaos` started outlives them: `make services-down` (and so `make down`)
stops what they recorded under .state/bench/<time>/ and .state/chaos/<time>/, and a SIGHUP (a closed
terminal) or SIGTERM sends them through their cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tether_testing.stack import find_repo_root

REPO = find_repo_root(Path(__file__).resolve().parent)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _record(workdir: Path, names: list[str]) -> list[subprocess.Popen]:
    """Start stand-ins for services the way TetherSystem does (a session of their own) and record them."""
    workdir.mkdir(parents=True)
    procs = []
    entries = []
    for name in names:
        argv = [sys.executable, "-c", "import time; time.sleep(600)", name]
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
        procs.append(proc)
        entries.append({"name": name, "pid": proc.pid, "argv": argv, "log": str(workdir / f"{name}.log")})
    (workdir / "processes.json").write_text(json.dumps({"processes": entries}))
    return procs


def test_services_down_stops_what_the_demo_the_bench_and_the_fault_run_recorded(tmp_path):
    procs = [
        *_record(tmp_path / "demo", ["demo-planner"]),
        *_record(tmp_path / "bench" / "20261201-091500", ["bench-planner", "bench-model"]),
        *_record(tmp_path / "chaos" / "20261201-091600", ["chaos-tool-gateway"]),
    ]
    try:
        done = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "services-down"],
                              env={**os.environ, "TETHER_STATE_DIR": str(tmp_path)}, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        for proc in procs:
            proc.wait(timeout=30)  # reaped here: the test started them
        assert "stopped" in done.stdout and "bench-model" in done.stdout and "chaos-tool-gateway" in done.stdout
        assert not list(tmp_path.rglob("processes.json"))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_services_down_with_nothing_recorded_is_a_no_op(tmp_path):
    done = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "services-down"],
                          env={**os.environ, "TETHER_STATE_DIR": str(tmp_path / "none")}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_hangup_or_term_runs_the_fault_runs_cleanup(tmp_path, signum):
    # The fault run restarts the broker and PostgreSQL of its stack, so a stand-in replaces its
    # run(); what is under test is chaos.main's handling of the signal.
    marker = tmp_path / "aborted"
    code = textwrap.dedent(f"""
        import sys, time
        from tether_bench import chaos

        class StandIn:
            seed = 0
            workdir = {str(tmp_path)!r}

            def __init__(self, settings, stack):
                self.s = settings

            def run(self):
                print("ready", flush=True)
                time.sleep(120)

            def abort(self):
                open({str(marker)!r}, "w").write("aborted: restarts stopped, system stopped")

        chaos.Chaos = StandIn
        sys.exit(chaos.main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 128 + signum
    finally:
        proc.kill()
        proc.wait()
    assert marker.read_text().startswith("aborted")


@pytest.mark.e2e
def test_a_hangup_stops_the_bench_and_everything_it_started(tmp_path):
    """The real bench (one tenant, one partition, no phases) against the local stack, hung up on
    while it waits for TETHER_BENCH_START_AT: every process it recorded is gone."""
    workdir = tmp_path / "bench"
    stderr = tmp_path / "bench.stderr"
    env = {**os.environ, "TETHER_BENCH_WORKDIR": str(workdir), "TETHER_BENCH_PHASES": "",
           "TETHER_BENCH_TENANTS": "1", "TETHER_BENCH_PARTITIONS": "1",
           "TETHER_BENCH_START_AT": str(time.time() + 3600)}
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tether_bench.bench"], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while "for TETHER_BENCH_START_AT" not in stderr.read_text():
            assert proc.poll() is None, stderr.read_text()[-3000:]
            assert time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.5)
        recorded = json.loads((workdir / "processes.json").read_text())["processes"]
        assert {p["name"] for p in recorded} >= {"run-api", "planner", "tool-gateway"}
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=180) == 128 + signal.SIGHUP, stderr.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
        subprocess.run([sys.executable, "-m", "tether_testing.system", "stop", str(workdir)], cwd=REPO,
                       capture_output=True, timeout=120)
    assert [p["name"] for p in recorded if _alive(p["pid"])] == []
