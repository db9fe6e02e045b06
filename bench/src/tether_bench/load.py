"""The load generator: tenants, N concurrent gRPC clients submitting runs in a closed loop, an approver bot."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from tether_api.v1 import run_service_pb2
from tether_bench.observer import Approval, LogObserver
from tether_bench.scenarios import Workload
from tether_testing.system import ApiClient, TetherSystem

log = logging.getLogger("tether_bench")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.INTERNAL}


@dataclass
class Tenant:
    """A tenant with a user key (submits) and an approver key (decides its approvals)."""

    tenant_id: str
    client: ApiClient
    approver: ApiClient


def make_tenants(system: TetherSystem, count: int) -> list[Tenant]:
    """`count` tenants (`t0`, `t1`, ...) set up like the system's own, each with its own keys."""
    tenants = []
    for i in range(count):
        setup = system.bootstrap_tenant(f"t{i}", principal_id=f"user-{i}", approver_id=f"approver-{i}")
        tenants.append(Tenant(setup.tenant_id, ApiClient(system.address, setup.api_key, timeout_s=30),
                              ApiClient(system.address, setup.approver_key, timeout_s=30)))
    return tenants


@dataclass
class Submitted:
    """A run as the client submitted it."""

    run_id: str
    tenant_id: str
    workload: str
    request_id: str
    submit_start_ms: float
    submit_end_ms: float


def submit_until_accepted(client: ApiClient, goal: str, *, request_id: str | None = None,
                          give_up_after_s: float = 300.0, stop: threading.Event | None = None
                          ) -> tuple[str, str, float, float]:
    """SubmitRun with one request_id, retried on transient errors until run-api answers (idempotent:
    the same request_id never makes a second run). Returns (run_id, request_id, start_ms, end_ms)."""
    request_id = request_id or str(uuid.uuid4())
    request = run_service_pb2.SubmitRunRequest(request_id=request_id, agent_id="demo", goal=goal)
    start_ms = time.time() * 1000
    deadline = time.monotonic() + give_up_after_s
    delay = 0.05
    while True:
        try:
            response = client.runs.SubmitRun(request, metadata=client.metadata, timeout=client.timeout_s)
            return response.run_id, request_id, start_ms, time.time() * 1000
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE or time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise
            time.sleep(delay)
            delay = min(2.0, delay * 2)


class ClosedLoop:
    """`concurrency` clients, each submitting a run of a workload, waiting (through the observer) for it to
    end, and submitting the next, until the phase's deadline; tenants are taken round-robin by client."""

    def __init__(self, observer: LogObserver, tenants: list[Tenant], workloads: list[Workload], *,
                 concurrency: int, submit_threads: int = 8, choose: Callable[[int, int], int] | None = None) -> None:
        self.observer = observer
        self.tenants = tenants
        self.workloads = workloads
        self.concurrency = concurrency
        self.submit_threads = submit_threads
        self.choose = choose or (lambda slot, n: slot % n)  # which workload a client's next run uses
        self.submitted: dict[str, Submitted] = {}
        self.submit_errors: list[str] = []
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {}
        self._ended_early: set[str] = set()
        self._free: queue.Queue[int] = queue.Queue()
        self._deadline = 0.0
        self._stop = threading.Event()
        observer.on_terminal.append(self._ended)

    def _ended(self, run_id: str, _event_type: str) -> None:
        with self._lock:
            slot = self._inflight.pop(run_id, None)
            if slot is None:
                self._ended_early.add(run_id)
                return
        self._free.put(slot)

    def _client_loop(self) -> None:
        while not self._stop.is_set():
            try:
                slot = self._free.get(timeout=0.2)
            except queue.Empty:
                continue
            if time.monotonic() >= self._deadline:
                return
            tenant = self.tenants[slot % len(self.tenants)]
            workload = self.workloads[self.choose(slot, len(self.workloads))]
            try:
                run_id, request_id, start_ms, end_ms = submit_until_accepted(tenant.client, workload.goal(),
                                                                             stop=self._stop)
            except grpc.RpcError as err:
                self.submit_errors.append(f"{err.code().name}: {err.details()}")
                time.sleep(0.5)
                self._free.put(slot)
                continue
            with self._lock:
                self.submitted[run_id] = Submitted(run_id, tenant.tenant_id, workload.name, request_id, start_ms,
                                                   end_ms)
                if run_id in self._ended_early:
                    self._ended_early.discard(run_id)
                    requeue = True
                else:
                    self._inflight[run_id] = slot
                    requeue = False
            if requeue:
                self._free.put(slot)

    def run(self, seconds: float) -> tuple[float, float]:
        """Drive the load for `seconds`; returns the phase's (start, end) wall clock in ms. Runs still in
        flight at the end are left to finish (see `drain`)."""
        self._deadline = time.monotonic() + seconds
        start_ms = time.time() * 1000
        for slot in range(self.concurrency):
            self._free.put(slot)
        threads = [threading.Thread(target=self._client_loop, name=f"client-{i}", daemon=True)
                   for i in range(self.submit_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 600)
        return start_ms, time.time() * 1000

    def finish(self) -> None:
        """End the phase now: clients stop submitting (runs in flight go on)."""
        self._deadline = 0.0

    def inflight(self) -> list[str]:
        with self._lock:
            return list(self._inflight)

    def drain(self, timeout_s: float) -> list[str]:
        """Wait until every submitted run ended (or `timeout_s`); returns the ones still running."""
        deadline = time.monotonic() + timeout_s
        while self.inflight() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.inflight()

    def close(self) -> None:
        self._stop.set()
        if self._ended in self.observer.on_terminal:
            self.observer.on_terminal.remove(self._ended)


@dataclass
class ApproverBot:
    """Decides every approval the log asks for, through the gRPC API with the tenant's approver key."""

    tenants: dict[str, Tenant]
    approve: Callable[[Approval], bool] = lambda _a: True
    threads: int = 4
    decided: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    enabled: bool = True

    def __post_init__(self) -> None:
        self._queue: queue.Queue[tuple[Approval, int]] = queue.Queue()
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._work, name=f"approver-{i}", daemon=True)
                         for i in range(self.threads)]

    def attach(self, observer: LogObserver) -> ApproverBot:
        observer.on_approval.append(self.submit)
        for w in self._workers:
            w.start()
        return self

    def submit(self, approval: Approval) -> None:
        if self.enabled and approval.tenant_id in self.tenants:
            self._queue.put((approval, 0))

    def pending(self) -> int:
        return self._queue.qsize()

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                approval, tries = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            approver = self.tenants[approval.tenant_id].approver
            verdict = self.approve(approval)
            try:
                approver.decide(approval.approval_id, approval.args_hash, approve=verdict,
                                comment="bench approver bot")
                self.decided[approval.approval_id] = "APPROVED" if verdict else "REJECTED"
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    # Already decided (a repeat) or expired: nothing left to decide.
                    self.decided.setdefault(approval.approval_id, f"refused:{err.details()}")
                elif tries < 50:
                    time.sleep(1.0)
                    self._queue.put((approval, tries + 1))
                else:
                    self.failures.append(f"{approval.approval_id}: {code.name} {err.details()}")

    def close(self) -> None:
        self._stop.set()
        for w in self._workers:
            if w.is_alive():
                w.join(timeout=5)
