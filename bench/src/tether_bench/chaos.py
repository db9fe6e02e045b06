"""`make chaos`: many concurrent runs under random SIGKILLs and broker/database restarts, then the invariant checker.

While clients submit runs with idempotent (kv_put) and non-idempotent (send_email, approved by a
bot through the gRPC API) effects, a fault loop SIGKILLs random service instances (restarting
each after a random short delay), restarts the Kafka broker and restarts PostgreSQL (each by the
PID its stack recorded: deploy/local/stack.py down/up with TETHER_STATE_DIR). A supervisor
restarts any service that exits on its own, as Kubernetes would (counted). Then the clients stop,
the runs drain, everything stops, and `tether_bench.invariants` reads the log from offset 0, the
sinks' files, the model's request log and the gateway's ledger. The last line printed is one JSON
object; the exit status is 1 if any invariant is violated (the namespace is then kept for
inspection). CHAOS_SECONDS (default 600) bounds the fault period.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tether_bench.common import (
    RUN_ACCEPTED,
    BenchError,
    LoadSampler,
    StackControl,
    StackSettings,
    machine,
    stop_cleanly_on_sigterm,
)
from tether_bench.invariants import Evidence, Fault, check, violated
from tether_bench.load import ApproverBot, ClosedLoop, make_tenants
from tether_bench.observer import Approval, LogObserver
from tether_bench.scenarios import chaos_mix, write_scenarios
from tether_devservices.recorder import read_records
from tether_messaging.logreader import read_to_end
from tether_modelserver.server import read_request_log
from tether_testing.processes import ServiceFailed
from tether_testing.system import SERVICES, SystemConfig, TetherSystem

log = logging.getLogger("tether_chaos")


class ChaosSettings(BaseSettings):
    """Knobs of `make chaos` (env prefix TETHER_CHAOS_; CHAOS_SECONDS for the length)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_CHAOS_", extra="ignore", populate_by_name=True)

    seconds: float = Field(600, gt=0, validation_alias=AliasChoices("CHAOS_SECONDS", "TETHER_CHAOS_SECONDS"),
                           description="How long faults are injected (the drain and the check come on top).")
    workdir: Path | None = None
    seed: int | None = None
    partitions: int = 6
    tenants: int = 3
    concurrency: int = Field(24, description="Runs in flight.")
    instances: int = Field(2, ge=1, description="Instances of budget, planner and tool-gateway (slots 0..n-1).")
    kill_every_min_s: float = 3.0
    kill_every_max_s: float = 9.0
    restart_after_min_s: float = 0.5
    restart_after_max_s: float = 5.0
    kafka_restarts: int = Field(0, description="Broker restarts; 0 = one per 4 minutes, at least one.")
    postgres_restarts: int = Field(0, description="Database restarts; 0 = one per 4 minutes, at least one.")
    drain_s: float = Field(300, description="How long the runs may take to finish after the faults stop.")
    kv_delay_ms: int = Field(300, description="The KV sink records a write at once but answers this late.")
    smtp_delay_ms: int = Field(1000, description="The SMTP sink records a message at once but answers this late "
                                                 "(a kill then often falls between an email and its answer).")
    slow_model_ms: int = Field(300, description="Model latency of half of the runs (widens the windows).")
    keep: bool = Field(False, description="Keep the namespace (topics, schemas) even when every invariant holds.")


class Chaos:
    """One chaos run (see the module doc)."""

    def __init__(self, settings: ChaosSettings, stack: StackSettings) -> None:
        self.s = settings
        self.stack = stack
        self.seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(1 << 30)
        self.rng = random.Random(self.seed)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.workdir = Path(settings.workdir or stack.state_dir / "chaos" / stamp)
        self.control = StackControl(stack.state_dir)
        self.fast = chaos_mix("chaos-mix")
        self.slow = chaos_mix("chaos-mix-slow", latency_ms=settings.slow_model_ms)
        self.faults: list[Fault] = []
        self.timeline: list[dict[str, Any]] = []
        self.service_exits: list[dict[str, Any]] = []
        self._down: set[str] = set()  # components the fault loop took down (the supervisor leaves them)
        self._lock = threading.Lock()
        self._stop_faults = threading.Event()
        self._stop_supervisor = threading.Event()
        #: Set when the run is cut short (SIGTERM, an error): nothing starts a process any more.
        self._aborted = threading.Event()
        self._restarts: list[threading.Thread] = []
        self._supervisor: threading.Thread | None = None
        #: approval_id -> wall clock (ms) when the bot first asked to decide it (read before the call).
        self.approval_asked_ms: dict[str, float] = {}
        self.load = LoadSampler()

    def abort(self) -> None:
        """Stop every thread that could start a service again, and wait for a restart already under
        way, before the system is stopped: a restart after `system.stop()` would leave a process
        behind (a SIGTERM did, once). Once `_aborted` is set (under the lock every restart checks it
        under), no restart begins."""
        with self._lock:
            self._aborted.set()
        self._stop_faults.set()
        self._stop_supervisor.set()
        for thread in self._restarts:
            thread.join(timeout=120)  # a restart waits up to 60 s for its health check
        if self._supervisor is not None:
            self._supervisor.join(timeout=120)

    def _approve(self, approval: Approval) -> bool:
        """The bot's verdict (always approve), noting when it first asked: an email sent before that
        cannot have been approved (the invariant checker's `unapproved_effects`)."""
        now_ms = time.time() * 1000
        with self._lock:
            self.approval_asked_ms.setdefault(approval.approval_id, now_ms)
        return True

    def note(self, **entry: Any) -> None:
        entry["t_ms"] = round(time.time() * 1000)
        with self._lock:
            self.timeline.append(entry)
        print(f"chaos: {json.dumps(entry)}", file=sys.stderr, flush=True)

    # -- set-up -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.control.require_ours("kafka")
        self.control.require_ours("postgres")
        scenarios = write_scenarios(self.workdir / "scenarios", [self.fast, self.slow])
        huge = "1000000"
        self.system = TetherSystem(SystemConfig(
            kafka_bootstrap=self.stack.kafka_bootstrap, pg_dsn=self.stack.pg_dsn, redis_url=self.stack.redis_url,
            workdir=self.workdir, namespace=f"chaos_{uuid.uuid4().hex[:8]}", partitions=self.s.partitions,
            scenarios=[scenarios], sink_delay_ms={"kv": self.s.kv_delay_ms, "smtp": self.s.smtp_delay_ms},
            extra_env={"run-api": {"TETHER_RUN_API_SUBMIT_RATE_PER_S": huge, "TETHER_RUN_API_SUBMIT_BURST": huge}},
        ))
        self.system.start()
        for name in ("budget", "planner", "tool-gateway"):
            for slot in range(1, self.s.instances):
                self.system.start_instance(name, slot)
        self.observer = LogObserver(self.stack.kafka_bootstrap, self.system.names.topics.run_events,
                                    self.s.partitions, schema_registry_url=self.stack.schema_registry_url).start()
        self.tenants = make_tenants(self.system, self.s.tenants)
        self.bot = ApproverBot({t.tenant_id: t for t in self.tenants}, approve=self._approve,
                               threads=4).attach(self.observer)
        self.driver = ClosedLoop(self.observer, self.tenants, [self.fast, self.slow], concurrency=self.s.concurrency,
                                 submit_threads=8)

    def services(self) -> list[str]:
        return [name for name in self.system.processes if name.split("#")[0] in SERVICES]

    # -- faults -----------------------------------------------------------------------------------
    def _kill_and_restart(self, name: str) -> None:
        with self._lock:
            if name in self._down:
                return
            self._down.add(name)
        start_ms = time.time() * 1000
        try:
            pid = self.system.processes[name].pid
            self.system.kill(name)
            self.note(fault="sigkill", target=name, pid=pid)
        except ServiceFailed:
            with self._lock:
                self._down.discard(name)
            return  # already dead: the supervisor restarts it

        def later() -> None:
            if self._aborted.wait(self.rng.uniform(self.s.restart_after_min_s, self.s.restart_after_max_s)):
                return
            with self._lock:
                if self._aborted.is_set():
                    return
            try:
                self.system.restart(name)
                self.note(fault="restarted", target=name, pid=self.system.processes[name].pid)
            except Exception as exc:  # noqa: BLE001 - the supervisor tries again
                self.note(fault="restart_failed", target=name, error=str(exc)[:300])
            finally:
                with self._lock:
                    self.faults.append(Fault(name, start_ms, time.time() * 1000))
                    self._down.discard(name)

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        self._restarts.append(thread)

    def _restart_stack(self, component: str) -> None:
        start_ms = time.time() * 1000
        self.note(fault=f"{component}_restart", phase="stopping")
        try:
            timings = self.control.restart(component, down_s=self.rng.uniform(1.0, 5.0))
            self.note(fault=f"{component}_restart", phase="started", **timings)
        finally:
            with self._lock:
                self.faults.append(Fault(component, start_ms, time.time() * 1000))

    def _stack_schedule(self) -> list[tuple[float, str]]:
        per = max(1, int(self.s.seconds // 240))
        kafka = self.s.kafka_restarts or per
        pg = self.s.postgres_restarts or per
        plan = []
        for count, comp, offset in ((kafka, "kafka", 0.2), (pg, "postgres", 0.55)):
            for i in range(count):
                slot = (i + offset) / count
                plan.append((self.s.seconds * min(0.9, slot + self.rng.uniform(-0.05, 0.05)), comp))
        return sorted(plan)

    def _kill_loop(self) -> None:
        """SIGKILL a random service instance every few seconds (each restarted after a short delay)."""
        while not self._stop_faults.wait(self.rng.uniform(self.s.kill_every_min_s, self.s.kill_every_max_s)):
            with self._lock:
                candidates = [n for n in self.services() if n not in self._down]
            if not candidates:
                continue
            name = self.rng.choice(candidates)
            try:
                self._kill_and_restart(name)
            except Exception as exc:  # noqa: BLE001 - one failed fault must not end the faults
                # (a harness error once ended this loop after 220 s of a 600 s run, unnoticed)
                self.note(fault="sigkill_failed", target=name, error=f"{type(exc).__name__}: {exc}"[:300])
                with self._lock:
                    self._down.discard(name)

    def _stack_loop(self, began: float) -> None:
        """Restart the broker and the database at their planned times (every planned restart happens,
        even when an earlier one ran long)."""
        for at, component in self._stack_schedule():
            wait = at - (time.monotonic() - began)
            if wait > 0:
                time.sleep(wait)
            try:
                self._restart_stack(component)
            except BenchError as exc:
                self.note(fault=f"{component}_restart", phase="failed", error=str(exc)[:300])
                raise

    def _supervise(self) -> None:
        """Restart services that exited on their own (as a Kubernetes controller would), and count them."""
        while not self._stop_supervisor.is_set():
            for name in self.services():
                proc = self.system.processes[name]
                with self._lock:
                    # Checked under the lock abort() sets it under: no restart begins after abort().
                    if name in self._down or proc.running or self._aborted.is_set():
                        continue
                    self._down.add(name)
                self.service_exits.append({"component": name, "returncode": proc.returncode,
                                           "t_ms": round(time.time() * 1000)})
                self.note(event="service_exited", target=name, returncode=proc.returncode)
                start_ms = time.time() * 1000
                try:
                    self.system.restart(name)
                    self.note(event="service_restarted", target=name)
                except Exception as exc:  # noqa: BLE001 - tried again next round
                    self.note(event="service_restart_failed", target=name, error=str(exc)[:300])
                finally:
                    with self._lock:
                        self.faults.append(Fault(name, start_ms, time.time() * 1000))
                        self._down.discard(name)
            self._stop_supervisor.wait(1.0)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        began_wall = time.monotonic()
        info: dict[str, Any] = {"seed": self.seed, "machine": machine(), "seconds": self.s.seconds}
        self.start()
        info["namespace"] = self.system.namespace
        supervisor = self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        supervisor.start()
        clients = threading.Thread(target=self.driver.run, args=(24 * 3600,), daemon=True)
        clients.start()
        began = time.monotonic()
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(5):
                self.load.sample()

        threading.Thread(target=sample, daemon=True).start()
        kills = threading.Thread(target=self._kill_loop, daemon=True)
        stack = threading.Thread(target=self._stack_loop, args=(began,), daemon=True)
        kills.start()
        stack.start()
        stack.join(self.s.seconds)
        remaining = self.s.seconds - (time.monotonic() - began)
        if remaining > 0:
            time.sleep(remaining)
        stack.join()  # a restart still under way finishes (it may outlast the period)
        self._stop_faults.set()
        kills.join()
        for thread in self._restarts:
            thread.join(timeout=300)
        self.note(event="faults_stopped", after_s=round(time.monotonic() - began, 1))
        # Every service back and ready before the drain (the supervisor restarts the stragglers).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not all(self.system.processes[n].healthy() for n in self.services()):
            time.sleep(1)
        self.driver.finish()
        clients.join(timeout=120)
        drain_began = time.monotonic()
        left = self.driver.drain(self.s.drain_s)
        # Runs no client waits for (accepted by run-api's sweeper after their submit gave up) are
        # checked too: they get what is left of the drain.
        deadline = drain_began + self.s.drain_s
        while self._clientless_in_flight() and time.monotonic() < deadline:
            time.sleep(0.5)
        info["drain_s"] = round(time.monotonic() - drain_began, 1)
        info["in_flight_after_drain"] = len(left)
        info["clientless_in_flight_after_drain"] = len(self._clientless_in_flight())
        self._stop_supervisor.set()
        supervisor.join(timeout=120)  # a restart under way finishes before the system stops
        if supervisor.is_alive():
            self.note(event="supervisor_still_restarting")
        self.driver.close()
        self.bot.close()
        self.observer.stop()
        sampler_stop.set()
        info["submit_errors"] = len(self.driver.submit_errors)
        info["approvals_decided_by_bot"] = len(self.bot.decided)
        info["bot_failures"] = self.bot.failures[:5]
        info["service_exits"] = self.service_exits
        info["sigkills"] = sum(1 for t in self.timeline if t.get("fault") == "sigkill")
        info["sigkill_failures"] = sum(1 for t in self.timeline if t.get("fault") == "sigkill_failed")
        info["kafka_restarts"] = sum(1 for t in self.timeline if t.get("fault") == "kafka_restart"
                                     and t.get("phase") == "started")
        info["postgres_restarts"] = sum(1 for t in self.timeline if t.get("fault") == "postgres_restart"
                                        and t.get("phase") == "started")
        info["load_during_run"] = self.load.summary()
        self.system.stop()
        report = self.check()
        report["info"].update(info)
        report["info"]["wall_s"] = round(time.monotonic() - began_wall, 1)
        return report

    def _clientless_in_flight(self) -> list[str]:
        submitted = self.driver.submitted
        return [run for run, events in self.observer.snapshot().items()
                if run not in submitted and not self.observer.is_terminal(run)
                and any(e.event_type == RUN_ACCEPTED for e in events)]

    def check(self) -> dict[str, Any]:
        names = self.system.names
        # Either wire format: with TETHER_SCHEMA_REGISTRY_URL set the services wrote the registry's.
        entries = read_to_end(self.stack.kafka_bootstrap, names.topics.run_events,
                              schema_registry_url=self.stack.schema_registry_url, timeout_s=300,
                              group_prefix="chaos-auditor")
        with psycopg.connect(self.stack.pg_dsn, autocommit=True) as conn:
            rows = conn.execute(f'SELECT idem_key, attempt FROM "{names.gateway_schema}".tool_calls').fetchall()
        evidence = Evidence(
            submitted={run: sub.tenant_id for run, sub in self.driver.submitted.items()},
            log=[entry.envelope for entry in entries],
            kv_records=read_records(self.system.sink_record_path("kv")),
            smtp_records=read_records(self.system.sink_record_path("smtp")),
            model_requests=read_request_log(self.system.model_request_log),
            ledger_attempts={key: attempt for key, attempt in rows},
            faults=list(self.faults),
            approver_tenants=frozenset(self.bot.tenants),
            approval_asked_ms=dict(self.approval_asked_ms),
            bot_decisions=dict(self.bot.decided),
            seen_at_ms={(run, e.seq): e.seen_ms for run, events in self.observer.snapshot().items()
                        for e in reversed(events)},  # reversed: a repeat keeps the first read
        )
        return check(evidence)

    def finish(self, report: dict[str, Any]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "report.json").write_text(json.dumps(report, indent=1))
        (self.workdir / "timeline.json").write_text(json.dumps(self.timeline, indent=1))
        if violated(report) or self.s.keep:
            print(f"chaos: namespace {self.system.namespace} kept for inspection (logs in {self.workdir})",
                  file=sys.stderr, flush=True)
        else:
            self.system.drop_data()


def main() -> int:
    stop_cleanly_on_sigterm()
    # A closed terminal or an ended ssh session (SIGHUP) goes through the same cleanup.
    signal.signal(signal.SIGHUP, signal.getsignal(signal.SIGTERM))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    chaos = Chaos(ChaosSettings(), StackSettings())
    print(f"chaos: seed {chaos.seed}, {chaos.s.seconds:.0f}s of faults, workdir {chaos.workdir}", file=sys.stderr,
          flush=True)
    try:
        report = chaos.run()
    except BaseException:
        chaos.abort()
        system = getattr(chaos, "system", None)
        if system is not None:
            system.stop()
        raise
    chaos.finish(report)
    print(f"chaos: details {json.dumps(report['details'])}", file=sys.stderr, flush=True)
    print(f"chaos: info {json.dumps(report['info'])}", file=sys.stderr, flush=True)
    summary = {k: v for k, v in report.items() if k not in ("details", "info")}
    summary["wall_s"] = report["info"]["wall_s"]
    print(json.dumps(summary), flush=True)
    return 1 if violated(report) else 0


if __name__ == "__main__":
    raise SystemExit(main())
