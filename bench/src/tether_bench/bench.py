"""`make bench`: Tether's six services on the local stack under a scripted load; prints one JSON line last.

Phases (all in one run, side by side on the same machine):
  0. warm: the throughput workload, unmeasured, so the broker's JVM has compiled its hot paths;
  1. light: a few runs in flight of a zero-latency scripted agent with an instant tool (kv_get) →
     per-step platform overhead (from the log's recorded_at_ms, minus the model's and the tool's
     own durations) and submit → first event, without queueing;
  2. throughput: N concurrent clients over several tenants submit runs of the same agent in a
     closed loop → steps/s (and the overhead at that load);
  3. latency-bound: the same agent with a slow model (TETHER_BENCH_LATENCY_MS, 1000 ms per turn),
     1 then 2 planner instances (slots 0, 1);
  4. peer: the same agent on LangGraph + AsyncPostgresSaver on the same PostgreSQL → steps/s ratio;
  5. recovery: under load, each service SIGKILLed and restarted; time until its runs progress;
  6. parking: runs park on an approval, N/2 then N (within a time bound); the six service processes'
     RSS slope between the two levels, per 10,000 parked runs (optionally, the heap's growth by site).
Durations scale with TETHER_BENCH_SCALE (e.g. 3 for a longer bench). See docs/benchmarks.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tether_bench.analysis import all_steps, submit_to_first_event, throughput
from tether_bench.common import (
    CpuProbe,
    LoadSampler,
    StackControl,
    StackSettings,
    machine,
    percentile,
    rounded,
    rss_kb,
    stop_cleanly_on_sigterm,
)
from tether_bench.heap import consumer_lag, heap_growth, marginal_kb_per_run, mb_per_10k, request_snapshots
from tether_bench.hops import Snapshot, hop_means, scrape
from tether_bench.load import ApproverBot, ClosedLoop, make_tenants, submit_until_accepted
from tether_bench.observer import LogObserver, Seen
from tether_bench.peer_langgraph import run_peer
from tether_bench.scenarios import kv_get_steps, park_on_approval, write_scenarios
from tether_testing.system import CHANGELOG_SERVICES, SERVICES, SystemConfig, TetherSystem

log = logging.getLogger("tether_bench")

# How long the recovery phase waits for a restarted service to progress before it counts it as unrecovered.
RECOVERY_TIMEOUT_S = 120.0


class BenchSettings(BaseSettings):
    """Knobs of `make bench` (env prefix TETHER_BENCH_); durations are seconds before scaling."""

    model_config = SettingsConfigDict(env_prefix="TETHER_BENCH_", extra="ignore", populate_by_name=True)

    scale: float = Field(1.0, gt=0, validation_alias=AliasChoices("TETHER_BENCH_SCALE", "BENCH_SCALE"),
                         description="Multiplies every phase's duration (a longer bench: 3).")
    workdir: Path | None = Field(None, description="Logs, sinks, results (default .state/bench/<time>).")
    partitions: int = 6
    tenants: int = 4
    concurrency: int = Field(128, description="Runs in flight in the throughput phase (clients).")
    submit_threads: int = 16
    steps: int = Field(5, ge=2, description="Steps per run (model-call rounds; the last one answers).")
    warmup_s: float = 10.0
    warm_s: float = Field(60.0, description="The `warm` phase: the throughput workload, unmeasured, so the later "
                          "phases meet a broker whose JVM has compiled its hot paths (a freshly started one "
                          "answers ~2.5x slower at first; docs/benchmarks.md).")
    throughput_s: float = 35.0
    light_concurrency: int = Field(4, description="Runs in flight in the light-load phase (overhead, submit latency).")
    light_s: float = 25.0
    latency_ms: int = Field(1000, description="Model latency of the latency-bound variant (per turn).")
    latency_concurrency: int = 64
    latency_s: float = 20.0
    peer_s: float = 20.0
    peer_processes: int = 0  # 0 = one per CPU
    recovery_rounds: int = 1
    recovery_concurrency: int = 16
    park_runs: int = Field(4_000, ge=2, description="Runs to park (N): RSS is read at N/2 and at N parked.")
    park_s: float = Field(100.0, description="Time bound for parking them (half for each half; the readings' "
                          "waits for the consumers to catch up come on top).")
    park_settle_s: float = Field(5.0, description="Pause before each RSS reading (batches commit, buffers drain).")
    park_inflight: int = Field(256, description="Most runs submitted but not yet parked (bounded backlog).")
    park_heap: bool = Field(False, description="Trace the services' heaps (tracemalloc) from the first level on and "
                            "report what grew per parked run by allocation site (the second RSS reading then "
                            "includes tracemalloc's own memory, so the RSS slope is not meaningful).")
    phases: str = Field("warm,light,throughput,latency,peer,recovery,park", description="Which phases to run.")
    profile: bool = Field(False, description="py-spy record the six services, and JFR the broker, during the throughput phase.")
    start_at: float = Field(0.0, description="Wall-clock time (Unix seconds) to begin the first phase at, once "
                            "the system is up: two benches on one machine then measure side by side, "
                            "under the same load (0 = at once).")


def _py_spy() -> str | None:
    # `make bench` runs the venv's python without activating the venv, so its bin/ (where the py-spy
    # wheel, a bench dependency, puts the binary) need not be on PATH.
    beside_python = Path(sys.executable).parent / "py-spy"
    return str(beside_python) if beside_python.is_file() else shutil.which("py-spy")


class Bench:
    """One bench run: a TetherSystem in a fresh namespace, the observer, tenants, then the phases."""

    def __init__(self, settings: BenchSettings, stack: StackSettings) -> None:
        self.s = settings
        self.stack = stack
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.workdir = Path(settings.workdir or stack.state_dir / "bench" / stamp)
        self.fast = kv_get_steps("bench-fast", settings.steps)
        self.slow = kv_get_steps("bench-slow", settings.steps, latency_ms=settings.latency_ms)
        self.park = park_on_approval("bench-park")
        self.approve = park_on_approval("bench-approve")
        self.results: dict[str, Any] = {}
        self.load = LoadSampler()
        self._sampling = threading.Event()

    def scaled(self, seconds: float) -> float:
        return seconds * self.s.scale

    # -- set-up ----------------------------------------------------------------------------------
    def start(self) -> None:
        scenarios = write_scenarios(self.workdir / "scenarios", [self.fast, self.slow, self.park, self.approve])
        huge = "1000000"
        extra_env: dict[str, dict[str, str]] = {name: {} for name in SERVICES}
        extra_env["run-api"].update(TETHER_RUN_API_SUBMIT_RATE_PER_S=huge, TETHER_RUN_API_SUBMIT_BURST=huge)
        if self.s.park_heap:
            # SIGUSR1 writes heap snapshots to TMPDIR (tether_runtime.service.install_heap_snapshot_handler).
            (self.workdir / "heap").mkdir(parents=True, exist_ok=True)
            for env in extra_env.values():
                env["TMPDIR"] = str(self.workdir / "heap")
        self.system = TetherSystem(SystemConfig(
            kafka_bootstrap=self.stack.kafka_bootstrap, pg_dsn=self.stack.pg_dsn, redis_url=self.stack.redis_url,
            workdir=self.workdir, namespace=f"bench_{uuid.uuid4().hex[:8]}", partitions=self.s.partitions,
            scenarios=[scenarios], extra_env=extra_env,
        ))
        began = time.monotonic()
        self.system.start()
        self.results["startup_s"] = round(time.monotonic() - began, 1)
        self.observer = LogObserver(self.stack.kafka_bootstrap, self.system.names.topics.run_events,
                                    self.s.partitions, schema_registry_url=self.stack.schema_registry_url).start()
        self.tenants = make_tenants(self.system, self.s.tenants)
        self.bot = ApproverBot({t.tenant_id: t for t in self.tenants}).attach(self.observer)
        self.bot.enabled = False
        threading.Thread(target=self._sample_load, daemon=True).start()

    def _sample_load(self) -> None:
        while not self._sampling.is_set():
            self.load.sample()
            self._sampling.wait(5)

    def stop(self) -> None:
        self._sampling.set()
        if getattr(self, "bot", None) is not None:
            self.bot.close()
        if getattr(self, "observer", None) is not None:
            self.observer.stop()
        system = getattr(self, "system", None)
        if system is not None:
            system.stop()
            system.drop_data()

    def cpu_pids(self) -> dict[str, int]:
        """The processes whose CPU the throughput phase accounts: the six services, the scripted
        model server and the sinks, this bench process (clients, log observer, approver bot), and
        the Kafka broker if this state dir started it."""
        pids = {name: proc.pid for name, proc in self.system.processes.items() if proc.running}
        pids["bench"] = os.getpid()
        broker = StackControl(self.stack.state_dir, sys.executable).pid("kafka")
        if broker is not None:
            pids["kafka"] = broker
        return pids

    def service_pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.system.processes.items()
                if name.split("#")[0] in SERVICES and proc.running}

    # -- phases ------------------------------------------------------------------------------------
    def closed_loop(self, workloads, concurrency: int, seconds: float, choose=None) -> tuple[ClosedLoop, tuple]:
        driver = ClosedLoop(self.observer, self.tenants, workloads, concurrency=concurrency,
                            submit_threads=min(self.s.submit_threads, concurrency), choose=choose)
        try:
            window = driver.run(seconds)
            left = driver.drain(60)
            if left:
                log.warning("runs still in flight after the drain: %d", len(left))
        finally:
            driver.close()
        return driver, window

    def phase_throughput(self) -> None:
        warmup, seconds = self.scaled(self.s.warmup_s), self.scaled(self.s.throughput_s)
        profilers = self._start_profilers(warmup, seconds) if self.s.profile else []
        cpu = CpuProbe(self.cpu_pids())
        hops: dict[str, dict[str, Snapshot]] = {}

        def window_starts() -> None:
            cpu.start()
            hops["before"] = self._scrape_hops()

        def window_ends() -> None:
            cpu.stop()
            hops["after"] = self._scrape_hops()

        window = [threading.Timer(warmup, window_starts), threading.Timer(warmup + seconds, window_ends)]
        for timer in window:
            timer.start()
        driver, (start, end) = self.closed_loop([self.fast], self.s.concurrency, warmup + seconds)
        for timer in window:
            timer.join()
        for proc in profilers:
            proc.wait(timeout=120)
        runs = self.observer.snapshot()
        steps = all_steps(runs, driver.submitted)
        figures = throughput(steps, (start + warmup * 1000, end))
        # The CPU window is the planned one; the phase's own window ends when the last client
        # returns, which on a loaded machine can be much later.
        cpu_steps = throughput(steps, cpu.window_ms)["steps"]
        figures.update(cpu_figures(cpu.used_s(), cpu_steps, (cpu.window_ms[1] - cpu.window_ms[0]) / 1000))
        figures["cpu_window_steps"] = cpu_steps
        latencies = submit_to_first_event({r: s.submit_start_ms for r, s in driver.submitted.items()}, runs)
        figures["submit_to_first_event_ms_p50_under_load"] = rounded(percentile(latencies, 50), 1)
        figures["runs"] = len(driver.submitted)
        figures["submit_errors"] = len(driver.submit_errors)
        figures["concurrency"] = self.s.concurrency
        figures["tenants"] = self.s.tenants
        figures["steps_per_run"] = self.s.steps
        # Means over the CPU window of the loop's hop histograms, per service (tether_bench.hops).
        figures["loop_ms_mean"] = hop_means(hops.get("before", {}), hops.get("after", {}))
        self.results["throughput"] = figures

    def _start_profilers(self, warmup: float, seconds: float) -> list[subprocess.Popen]:
        spy = _py_spy()
        if spy is None:
            log.warning("TETHER_BENCH_PROFILE set but py-spy is neither in the venv nor on PATH; no profile")
            return []
        procs = []
        for name in SERVICES:
            out = self.workdir / f"profile-{name}.txt"
            # Starts after the warm-up, so the profile covers the measured window. --gil keeps only
            # the samples of the thread holding the GIL: Python's CPU, not threads blocked in I/O
            # or runnable-but-waiting on a busy machine (which otherwise dominate the samples).
            cmd = (f"sleep {warmup:.0f}; exec {spy} record --pid {self.system.processes[name].pid} "
                   f"--duration {int(seconds)} --rate 50 --format raw --nonblocking --gil --output {out}")
            procs.append(subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.DEVNULL,
                                          stderr=open(self.workdir / f"profile-{name}.log", "w")))
        procs += self._start_broker_recording(warmup, seconds)
        return procs

    def _start_broker_recording(self, warmup: float, seconds: float) -> list[subprocess.Popen]:
        """A Java Flight Recording of the broker over the same window (`profile-kafka.jfr`; summarise it
        with `python -m tether_bench.profile`): the broker is the largest single part of a step's CPU."""
        broker = StackControl(self.stack.state_dir, sys.executable).pid("kafka")
        jcmd = shutil.which("jcmd")
        if broker is None or jcmd is None:
            log.warning("no broker profile: %s", "jcmd (part of the JDK) is not on PATH" if broker else
                        "the broker was not started by this state dir")
            return []
        out = self.workdir / "profile-kafka.jfr"
        cmd = (f"sleep {warmup:.0f}; exec {jcmd} {broker} JFR.start name=tether-bench-{uuid.uuid4().hex[:8]} "
               f"duration={int(seconds)}s settings=profile filename={out}")
        return [subprocess.Popen(["bash", "-c", cmd], stdout=open(self.workdir / "profile-kafka.log", "w"),
                                 stderr=subprocess.STDOUT)]

    def phase_warm(self) -> None:
        """The throughput workload for `warm_s`, not measured: `make bench` starts the broker when it is
        not running, and a JVM that has just started runs Kafka's request paths interpreted until the
        JIT compiles them (light-load overhead p50 fell 520 → 230 ms over five back-to-back light
        phases on a restarted broker). Production brokers run warm; so should the measurement."""
        driver, (start, end) = self.closed_loop([self.fast], self.s.concurrency, self.scaled(self.s.warm_s))
        steps = all_steps(self.observer.snapshot(), driver.submitted)
        self.results["warm"] = {"steps_per_s": throughput(steps, (start, end))["steps_per_s"],
                                "runs": len(driver.submitted), "seconds": round((end - start) / 1000, 1)}

    def phase_light(self) -> None:
        """A light load (a few runs in flight): the platform's own time per step and submit → first
        event, without the queueing a saturated pipeline adds."""
        seconds = self.scaled(self.s.light_s)
        hops_before = self._scrape_hops()
        driver, (start, end) = self.closed_loop([self.fast], self.s.light_concurrency, seconds)
        hops_after = self._scrape_hops()
        runs = self.observer.snapshot()
        figures = throughput(all_steps(runs, driver.submitted), (start, end))
        latencies = submit_to_first_event({r: s.submit_start_ms for r, s in driver.submitted.items()}, runs)
        figures["submit_to_first_event_ms_p50"] = rounded(percentile(latencies, 50), 1)
        figures["submit_to_first_event_ms_p99"] = rounded(percentile(latencies, 99), 1)
        figures["runs"] = len(driver.submitted)
        figures["concurrency"] = self.s.light_concurrency
        # Means over the phase of the loop's hop histograms, per service (tether_bench.hops).
        figures["loop_ms_mean"] = hop_means(hops_before, hops_after)
        self.results["light"] = figures

    def _scrape_hops(self) -> dict[str, Snapshot]:
        return {name: scrape(self.system.processes[name].health_url.rsplit("/", 1)[0] + "/metrics")
                for name in CHANGELOG_SERVICES if name in self.system.processes}

    def phase_latency(self) -> None:
        seconds = self.scaled(self.s.latency_s)
        warmup = min(5.0, seconds / 4)
        out: dict[str, Any] = {"model_latency_ms": self.s.latency_ms, "concurrency": self.s.latency_concurrency,
                               "planner_work_threads": 8}
        for instances in (1, 2):
            if instances == 2:
                self.system.start_instance("planner", 1)
            driver, (start, end) = self.closed_loop([self.slow], self.s.latency_concurrency, warmup + seconds)
            figures = throughput(all_steps(self.observer.snapshot(), driver.submitted), (start + warmup * 1000, end))
            out[f"planners_{instances}"] = {"steps_per_s": figures["steps_per_s"],
                                            "step_overhead_ms_p50": figures["step_overhead_ms_p50"],
                                            "step_overhead_ms_p99": figures["step_overhead_ms_p99"]}
        self.system.stop_instance("planner#1")
        one, two = out["planners_1"]["steps_per_s"], out["planners_2"]["steps_per_s"]
        out["scale_out_ratio"] = round(two / one, 2) if one else None
        self.results["latency_bound"] = out

    def phase_peer(self) -> None:
        processes = self.s.peer_processes or (self.results["machine"]["nproc"] or 1)
        self.results["peer"] = run_peer(
            dsn=self.stack.pg_dsn, model_url=self.system.model_base_url or "", kv_url=self.system.sink_urls["kv"],
            goal_marker=self.fast.marker, steps_per_run=self.fast.steps, processes=processes,
            concurrency=self.s.concurrency, seconds=self.scaled(self.s.warmup_s + self.s.peer_s),
            warmup_s=self.scaled(self.s.warmup_s), workdir=self.workdir, python=sys.executable)

    def phase_recovery(self) -> None:
        self.bot.enabled = True
        order = ["budget", "planner", "tool-gateway", "approval", "projector", "run-api"]
        samples: list[dict[str, Any]] = []
        driver = ClosedLoop(self.observer, self.tenants, [self.fast, self.approve],
                            concurrency=self.s.recovery_concurrency, submit_threads=8,
                            choose=lambda slot, n: 1 if slot % 4 == 0 else 0)
        runner = threading.Thread(target=driver.run, args=(24 * 3600,), daemon=True)
        runner.start()
        try:
            time.sleep(5)
            for _round in range(max(1, round(self.s.recovery_rounds * self.s.scale))):
                for name in order:
                    samples.append(self._recover_once(name))
                    time.sleep(2)
        finally:
            driver.finish()
            runner.join(timeout=60)
            driver.drain(60)
            driver.close()
            self.bot.enabled = False
        # A service that never recovered counts as the timeout (a lower bound of its recovery): dropping
        # it would report the services that did come back as the whole story.
        values = [RECOVERY_TIMEOUT_S if s["recovery_s"] is None else s["recovery_s"] for s in samples]
        self.results["recovery"] = {
            "samples": samples,
            "recovery_s_p50": rounded(percentile(values, 50), 2),
            "recovery_s_p99": rounded(percentile(values, 99), 2),
            "unrecovered": sum(1 for s in samples if s["recovery_s"] is None),
            "timeout_s": RECOVERY_TIMEOUT_S,
        }

    def _recover_once(self, name: str, timeout_s: float = RECOVERY_TIMEOUT_S) -> dict[str, Any]:
        progressed = threading.Event()
        seen_at: list[float] = []
        kill_ms = time.time() * 1000

        def watch(event: Seen) -> None:
            # The log's `producer` is the service name; after the kill only its successor records.
            if event.producer == name and event.recorded_at_ms > kill_ms and not progressed.is_set():
                seen_at.append(event.seen_ms)
                progressed.set()

        if name in ("budget", "planner", "tool-gateway", "approval"):
            self.observer.on_event.append(watch)
        self.system.kill(name)
        kill_ms = time.time() * 1000  # the process is gone now: anything recorded later is its successor's
        restart_began = time.monotonic()
        try:
            self.system.restart(name)
            restart_s = time.monotonic() - restart_began
            if name == "projector":
                at = self._wait_projected_after(kill_ms, timeout_s)
            elif name == "run-api":
                at = self._wait_submit_ok(timeout_s)
            else:
                progressed.wait(timeout_s)
                at = seen_at[0] if seen_at else None
        finally:
            if watch in self.observer.on_event:
                self.observer.on_event.remove(watch)
        return {"service": name, "restart_s": round(restart_s, 2),
                "recovery_s": None if at is None else round((at - kill_ms) / 1000, 2)}

    def _wait_projected_after(self, kill_ms: float, timeout_s: float) -> float | None:
        schema = self.system.names.read_model_schema
        deadline = time.monotonic() + timeout_s
        with psycopg.connect(self.stack.pg_dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(f'SELECT max(recorded_at_ms) FROM "{schema}".events').fetchone()
                if row and row[0] is not None and row[0] > kill_ms:
                    return time.time() * 1000
                time.sleep(0.05)
        return None

    def _wait_submit_ok(self, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                submit_until_accepted(self.tenants[0].client, self.fast.goal(), give_up_after_s=timeout_s)
                return time.time() * 1000
            except Exception:  # noqa: BLE001 - not back yet
                time.sleep(0.05)
        return None

    def phase_park(self) -> None:
        """Park runs on an approval in two halves (to `park_runs` / 2, then to `park_runs`, within `park_s`),
        with at most `park_inflight` submitted but not parked yet (a flood would only measure the backlog).
        After each half, once every submitted run has parked and a settle pause has passed, read the
        services' RSS: the slope between the two readings is the marginal cost of a parked run
        (`parked_rss_mb_per_10k`); RSS after minus before the phase is kept as `..._growth_...`."""
        pids = self.service_pids()
        settle = self.s.park_settle_s
        time.sleep(settle)
        before = {name: rss_kb(pid) for name, pid in pids.items()}
        submitted: set[str] = set()
        parked: set[str] = set()
        early: set[str] = set()
        lock = threading.Lock()
        clients = [t.client for t in self.tenants]

        def on_approval(approval) -> None:
            with lock:
                (parked if approval.run_id in submitted else early).add(approval.run_id)

        def park_until(target: int, deadline: float) -> None:
            def submitter(i: int) -> None:
                client = clients[i % len(clients)]
                while time.monotonic() < deadline:
                    with lock:
                        if len(submitted) >= target:
                            return
                        backlog = len(submitted) - len(parked)
                    if backlog >= self.s.park_inflight:
                        time.sleep(0.05)
                        continue
                    try:
                        run_id, *_ = submit_until_accepted(client, self.park.goal(), give_up_after_s=30)
                    except Exception:  # noqa: BLE001 - overload shows as errors; count what parked
                        time.sleep(0.2)
                        continue
                    with lock:
                        submitted.add(run_id)
                        if run_id in early:
                            parked.add(run_id)

            with ThreadPoolExecutor(self.s.submit_threads) as pool:
                list(pool.map(submitter, range(self.s.submit_threads)))
            self.observer.wait_count(lambda: len(parked) >= len(submitted), 120)

        def level(number: int) -> dict[str, Any]:
            """Once every consumer has caught up (the projector, the slowest, may still be working
            through the last runs' events, holding them and its fetch buffers) and a settle pause
            has passed, read every service at the current number of parked runs."""
            lag_wait = time.monotonic()
            lag = self._wait_caught_up(timeout_s=180)
            lag_wait = time.monotonic() - lag_wait
            time.sleep(settle)
            with lock:
                count = len(parked)
            reading = {"parked": count, "rss_kb": {name: rss_kb(pid) for name, pid in pids.items()},
                       "catch_up_s": round(lag_wait, 1), "lag_left": lag}
            if self.s.park_heap:
                reading["snapshots"] = request_snapshots(pids, number, self.workdir / "heap")
            return reading

        if self.s.park_heap:
            # The first snapshot starts tracing, before the first half: what the first half put in
            # bounded caches (an LRU of states) is traced too, so its turnover in the second half
            # nets out instead of looking like growth.
            request_snapshots(pids, 1, self.workdir / "heap")
        self.observer.on_approval.append(on_approval)
        began = time.monotonic()
        bound = self.scaled(self.s.park_s)
        try:
            park_until(self.s.park_runs // 2, began + bound / 2)
            park_s = time.monotonic() - began
            low = level(2)
            # The second half gets its own half of the bound: the first reading's wait for the
            # consumers to catch up must not shorten it (fewer runs between readings, more noise).
            second = time.monotonic()
            park_until(self.s.park_runs, second + bound / 2)
            park_s += time.monotonic() - second
            high = level(3)
        finally:
            self.observer.on_approval.remove(on_approval)
        # A service that exited or was restarted during the phase: its readings compare nothing.
        same = {name: pid for name, pid in pids.items()
                if self.system.processes[name].pid == pid and self.system.processes[name].running}
        after = {name: rss_kb(pid) for name, pid in same.items()}
        growth_kb = sum(after[n] - before[n] for n in same)
        count = len(parked)
        low_kb = {n: v for n, v in low["rss_kb"].items() if n in same}
        high_kb = {n: v for n, v in high["rss_kb"].items() if n in same}
        per_run = marginal_kb_per_run(low_kb, high_kb, low["parked"], high["parked"])
        result: dict[str, Any] = {
            "submitted": len(submitted), "parked_runs": count, "park_s": round(park_s, 1),
            "parked_per_s": round(count / max(0.001, park_s), 1),
            "parked_at_levels": [low["parked"], high["parked"]],
            "rss_mb_before": {k: round(v / 1024, 1) for k, v in before.items()},
            "rss_mb_at_levels": [{k: round(v / 1024, 1) for k, v in r["rss_kb"].items()} for r in (low, high)],
            "catch_up_s_at_levels": [low["catch_up_s"], high["catch_up_s"]],
            "lag_left_at_levels": [low["lag_left"], high["lag_left"]],
            "rss_kb_per_parked_run": per_run,
            "parked_rss_mb_per_10k": mb_per_10k(per_run) if len(same) == len(pids) else None,
            "rss_growth_mb_per_service": {n: round((after[n] - before[n]) / 1024, 1) for n in same},
            "rss_growth_mb": round(growth_kb / 1024, 1),
            "parked_rss_growth_mb_per_10k": round(growth_kb / 1024 / count * 10_000, 1) if count else None,
            "services_restarted_during_phase": sorted(set(pids) - set(same)),
        }
        if self.s.park_heap:
            runs = high["parked"] - low["parked"]
            result["heap"] = {name: heap_growth(low["snapshots"][name], high["snapshots"][name], runs)
                              for name in same if name in low["snapshots"] and name in high["snapshots"]}
        self.results["park"] = result

    def _wait_caught_up(self, timeout_s: float) -> dict[str, int]:
        """Wait until no service's consumer group has uncommitted input; returns what is left
        (empty when caught up in time)."""
        topics = self.system.names.topics
        groups = [topics.group_id(name) for name in CHANGELOG_SERVICES]
        inputs = [topics.commands, topics.run_intake, topics.run_events]
        deadline = time.monotonic() + timeout_s
        while True:
            lag = {g: n for g, n in consumer_lag(self.stack.kafka_bootstrap, groups, inputs,
                                                 self.s.partitions).items() if n}
            if not lag or time.monotonic() > deadline:
                return lag
            time.sleep(1)

    def check_services(self, phase: str) -> None:
        """A service that died during a phase is recorded (a finding) and started again."""
        for name, proc in list(self.system.processes.items()):
            if name.split("#")[0] in SERVICES and not proc.running:
                self.results.setdefault("service_crashes", []).append(
                    {"phase": phase, "service": name, "returncode": proc.returncode})
                log.warning("%s exited with %s during %s; restarting it", name, proc.returncode, phase)
                self.system.restart(name)

    # -- the whole ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.results["machine"] = machine()
        began = time.monotonic()
        try:
            # Inside the try: a start that fails after the services are up (tenants, the
            # observer) must still stop them and drop the namespace.
            self.start()
            if self.s.start_at > time.time():
                print(f"bench: waiting {self.s.start_at - time.time():.0f}s for TETHER_BENCH_START_AT",
                      file=sys.stderr, flush=True)
                time.sleep(self.s.start_at - time.time())
            phases = [p.strip() for p in self.s.phases.split(",") if p.strip()]
            for phase in phases:
                t0 = time.monotonic()
                print(f"bench: phase {phase} ...", file=sys.stderr, flush=True)
                getattr(self, f"phase_{phase}")()
                self.check_services(phase)
                self.results.setdefault("phase_s", {})[phase] = round(time.monotonic() - t0, 1)
                print(f"bench: phase {phase} done in {time.monotonic() - t0:.0f}s: "
                      f"{json.dumps(self.results.get(_RESULT_KEY.get(phase, phase)))}", file=sys.stderr, flush=True)
        finally:
            self.results["load_during_run"] = self.load.summary()
            self.stop()
        self.results["wall_s"] = round(time.monotonic() - began, 1)
        self.results["workdir"] = str(self.workdir)
        return self.results


_RESULT_KEY = {"latency": "latency_bound"}


def cpu_figures(used_s: dict[str, float], steps: int, seconds: float) -> dict[str, Any]:
    """CPU of each process in the measured window: milliseconds per finished step (what a step
    costs, comparable across runs on a shared machine) and cores busy on average."""
    return {
        "cpu_ms_per_step": {name: round(s * 1000 / steps, 2) if steps else None for name, s in used_s.items()},
        "cpu_cores": {name: round(s / seconds, 2) for name, s in used_s.items()},
    }


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The one JSON object `make bench` ends with."""
    tp = results.get("throughput", {})
    peer = results.get("peer", {})
    lat = results.get("latency_bound", {})
    steps = tp.get("steps_per_s")
    light = results.get("light", {})
    return {
        "steps_per_s": steps,
        "step_overhead_ms_p50": light.get("step_overhead_ms_p50"),
        "step_overhead_ms_p99": light.get("step_overhead_ms_p99"),
        "submit_to_first_event_ms_p50": light.get("submit_to_first_event_ms_p50"),
        "step_overhead_ms_p50_at_peak": tp.get("step_overhead_ms_p50"),
        "step_overhead_ms_p99_at_peak": tp.get("step_overhead_ms_p99"),
        "submit_to_first_event_ms_p50_at_peak": tp.get("submit_to_first_event_ms_p50_under_load"),
        "concurrency_at_peak": tp.get("concurrency"),
        "parked_runs": results.get("park", {}).get("parked_runs"),
        "parked_rss_mb_per_10k": results.get("park", {}).get("parked_rss_mb_per_10k"),
        "parked_rss_growth_mb_per_10k": results.get("park", {}).get("parked_rss_growth_mb_per_10k"),
        "recovery_s_p99": results.get("recovery", {}).get("recovery_s_p99"),
        "recovery_unrecovered": results.get("recovery", {}).get("unrecovered"),
        "peer_steps_per_s": peer.get("steps_per_s"),
        "peer_ratio_steps_per_s": round(steps / peer["steps_per_s"], 2) if steps and peer.get("steps_per_s") else None,
        "latency_bound_steps_per_s_1_planner": lat.get("planners_1", {}).get("steps_per_s"),
        "latency_bound_steps_per_s_2_planners": lat.get("planners_2", {}).get("steps_per_s"),
        "service_crashes": len(results.get("service_crashes", [])),
        "nproc": results.get("machine", {}).get("nproc"),
        "loadavg_during_run": results.get("load_during_run"),
        "wall_s": results.get("wall_s"),
    }


def main() -> int:
    stop_cleanly_on_sigterm()
    # A closed terminal or an ended ssh session (SIGHUP) goes through the same cleanup.
    signal.signal(signal.SIGHUP, signal.getsignal(signal.SIGTERM))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    settings = BenchSettings()
    bench = Bench(settings, StackSettings())
    results = bench.run()
    bench.workdir.mkdir(parents=True, exist_ok=True)
    (bench.workdir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"bench: full results in {bench.workdir / 'results.json'}", file=sys.stderr, flush=True)
    print(json.dumps(summary(results)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
