"""The whole of Tether as real processes on loopback: effect sinks, a model, the six services and a bootstrapped tenant.

`TetherSystem` is what the e2e tests and `make run` (deploy/local/run-demo) stand on. It needs
every workspace package (the root project installs them all) but imports nothing of pytest, so
scripts can use it as well as fixtures.

    system = TetherSystem(SystemConfig(kafka_bootstrap=..., pg_dsn=..., redis_url=..., workdir=...))
    system.start()               # sinks, model, topics, tenant + keys + agent, six services (ready)
    run_id = system.client.submit("Look up ...")
    ...
    system.stop()                # nothing left running
    system.drop_data()           # topics, schemas and Redis keys of its namespace (not for namespace "")

Every name it uses is under one namespace (`SystemConfig.namespace`, a fresh `e2e_<hex>` by
default): topics, consumer groups and transactional ids under `TETHER_TOPIC_PREFIX=<ns>.`,
PostgreSQL schemas `<ns>_run_api`, `<ns>_read_model`, `<ns>_gateway`, `<ns>_blobs`, Redis keys
under `<ns>:`. The empty namespace means the production names (the demo uses it).

The PIDs of everything it starts are written to `<state_dir>/processes.json` (kept up to date on
restart), so another process can stop them (`stop_recorded`, `python -m tether_testing.system
stop STATE_DIR`, used by `make down`) when the one that started them died.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psycopg
import redis
from confluent_kafka.admin import AdminClient
from google.rpc import error_details_pb2, status_pb2
from psycopg import sql

from tether_api.v1 import (
    agent_service_pb2_grpc,
    approval_service_pb2,
    approval_service_pb2_grpc,
    run_service_pb2,
    run_service_pb2_grpc,
    tool_service_pb2_grpc,
)
from tether_messaging.admin import declare_topics
from tether_messaging.topics import Topics
from tether_testing.names import unique_name
from tether_testing.processes import ServiceFailed, ServiceProcess, _group_members, free_port

#: The six services: name → the module `python -m` runs and the env prefix of its settings.
SERVICES: dict[str, tuple[str, str]] = {
    "run-api": ("tether_run_api", "TETHER_RUN_API_"),
    "budget": ("tether_budget", "TETHER_BUDGET_"),
    "planner": ("tether_planner", "TETHER_PLANNER_"),
    "tool-gateway": ("tether_tool_gateway", "TETHER_GATEWAY_"),
    "approval": ("tether_approval", "TETHER_APPROVAL_"),
    "projector": ("tether_projector", "TETHER_PROJECTOR_"),
}
#: Services on the shared loop, each with a changelog topic (the projector's stays empty).
CHANGELOG_SERVICES = ("budget", "planner", "tool-gateway", "approval", "projector")
SINKS = ("http", "smtp", "kv")
MODEL = "model"
SCRIPTED_MODEL_NAME = "tether-scripted"
_STATE_FILE = "processes.json"


class TetherSystemError(Exception):
    """The system could not be started or a component misbehaved; the message says which and why."""


@dataclass(frozen=True)
class ModelChoice:
    """The model the demo agent is pinned to.

    `scripted=True` (the default) runs the scripted model server (libs/modelserver) and points the
    planner at it. Otherwise the planner talks to the provider itself with the credentials of its
    environment (OPENAI_API_KEY / ANTHROPIC_API_KEY), at `base_url` (TETHER_LLM_BASE_URL) if given.
    """

    provider: str = "openai"
    name: str = SCRIPTED_MODEL_NAME
    scripted: bool = True
    base_url: str | None = None
    context_window_tokens: int = 128_000


@dataclass(frozen=True)
class SystemConfig:
    """Where the stack is, where files go, and how the system is named and shaped."""

    kafka_bootstrap: str
    pg_dsn: str
    redis_url: str
    #: Logs (`logs/<component>.log`), sink records (`sinks/`), the model request log.
    workdir: Path
    #: None: a fresh `e2e_<hex>`. "": the production names (topics unprefixed, schema `run_api` ...).
    namespace: str | None = None
    partitions: int = 6
    #: Replicas of every topic (TETHER_TOPIC_REPLICATION_FACTOR of the services): the local stack has one broker.
    replication_factor: int = 1
    model: ModelChoice = field(default_factory=ModelChoice)
    #: Extra scenario files/directories for the scripted model (the bundled ones, incl. the demo, stay).
    scenarios: Sequence[Path] = ()
    #: Where processes.json goes (default: workdir).
    state_dir: Path | None = None
    tenant_id: str = "demo"
    principal_id: str = "demo-user"
    approver_id: str = "demo-approver"
    email_from: str = "tether-demo@localhost"
    #: Fixed ports for the sinks / model / gRPC (0 = a free one), e.g. so a demo's tool specs stay the same.
    ports: Mapping[str, int] = field(default_factory=dict)
    #: Extra environment per component (service name, "http", "smtp", "kv", "model").
    extra_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: Per sink ("http", "smtp", "kv"): answer every request this many ms late (the effect is recorded
    #: at once), so a test can kill a caller between an effect and its answer.
    sink_delay_ms: Mapping[str, int] = field(default_factory=dict)
    start_timeout_s: float = 180.0
    python: str = sys.executable


@dataclass(frozen=True)
class Names:
    """Every name a system with this namespace uses."""

    namespace: str

    @property
    def topic_prefix(self) -> str:
        return f"{self.namespace}." if self.namespace else ""

    def schema(self, base: str) -> str:
        return f"{self.namespace}_{base}" if self.namespace else base

    @property
    def run_api_schema(self) -> str:
        return self.schema("run_api")

    @property
    def read_model_schema(self) -> str:
        return self.schema("read_model")

    @property
    def gateway_schema(self) -> str:
        return self.schema("gateway")

    @property
    def blob_schema(self) -> str:
        return self.schema("blobs")

    @property
    def schemas(self) -> list[str]:
        return [self.run_api_schema, self.read_model_schema, self.gateway_schema, self.blob_schema]

    @property
    def live_key_prefix(self) -> str:
        return f"{self.namespace}:" if self.namespace else ""

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)


# -- the gRPC client ------------------------------------------------------------------------------


def _stream_hole_next_stored_seq(err: grpc.RpcError) -> int | None:
    """The `next_stored_seq` of a DATA_LOSS / STREAM_HOLE answer (where the run's log goes on after a
    hole in the read model), or None for any other error."""
    if err.code() is not grpc.StatusCode.DATA_LOSS:
        return None
    for key, value in err.trailing_metadata() or ():
        if key != "grpc-status-details-bin":
            continue
        for detail in status_pb2.Status.FromString(value).details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.reason == "STREAM_HOLE" and info.metadata.get("next_stored_seq", "").isdigit():
                return int(info.metadata["next_stored_seq"])
    return None



class ApiClient:
    """The run-api's stubs over one channel; every call carries the API key.

    `runs`, `agents`, `tools`, `approvals` are the generated stubs (pass `metadata=client.metadata`);
    the methods below are the few calls the demo and the tests make all the time.
    """

    def __init__(self, address: str, api_key: str, *, timeout_s: float = 30.0) -> None:
        self.address = address
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(address)
        self.runs = run_service_pb2_grpc.RunServiceStub(self.channel)
        self.agents = agent_service_pb2_grpc.AgentServiceStub(self.channel)
        self.tools = tool_service_pb2_grpc.ToolServiceStub(self.channel)
        self.approvals = approval_service_pb2_grpc.ApprovalServiceStub(self.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    def submit(self, goal: str, *, agent_id: str = "demo", request_id: str | None = None) -> str:
        """Submit a run and return its id (retried on UNAVAILABLE; the request id makes that safe)."""
        request = run_service_pb2.SubmitRunRequest(request_id=request_id or str(uuid.uuid4()), agent_id=agent_id,
                                                   goal=goal)
        return self._retry(self.runs.SubmitRun, request).run_id

    def get_run(self, run_id: str) -> run_service_pb2.Run:
        return self._retry(self.runs.GetRun, run_service_pb2.GetRunRequest(run_id=run_id)).run

    def events(self, run_id: str, from_seq: int = 1, *, timeout_s: float | None = None
               ) -> Iterator[run_service_pb2.RunEvent]:
        """One StreamRunEvents call from `from_seq`, as it comes (ends after the terminal event)."""
        stream = self.runs.StreamRunEvents(run_service_pb2.StreamRunEventsRequest(run_id=run_id, from_seq=from_seq),
                                           metadata=self.metadata, timeout=timeout_s)
        try:
            for response in stream:
                yield response.event
        finally:
            stream.cancel()

    def follow(self, run_id: str, from_seq: int = 1, *, timeout_s: float | None = None, max_reconnects: int = 20,
               on_missing: Callable[[int, int], None] | None = None) -> Iterator[run_service_pb2.RunEvent]:
        """Every event from `from_seq` up to the terminal one, each exactly once, reconnecting from
        the next seq when the stream breaks (as `tether watch` does). With `timeout_s`, the whole
        follow ends with DEADLINE_EXCEEDED after that long.

        A hole in the read model (DATA_LOSS / STREAM_HOLE, permanent) is not retried: it is raised,
        or with `on_missing` handed to it as (first, last) missing seq and followed past at once
        from the server's `next_stored_seq`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_seq, failures = from_seq, 0
        while True:
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                for event in self.events(run_id, next_seq, timeout_s=left):
                    if event.seq < next_seq:
                        continue  # never hand out an event twice, whatever the server sends
                    next_seq, failures = event.seq + 1, 0
                    yield event
                    if event.terminal:
                        return
                return  # the server ended the stream without a terminal event
            except grpc.RpcError as err:
                hole = _stream_hole_next_stored_seq(err)
                if hole is not None and on_missing is not None and hole > next_seq:
                    on_missing(next_seq, hole - 1)
                    next_seq, failures = hole, 0
                    continue
                failures += 1
                expired = deadline is not None and time.monotonic() >= deadline
                if expired or failures > max_reconnects or err.code() not in (
                        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                time.sleep(min(5.0, 0.2 * 2 ** min(failures, 5)))

    def decide(self, approval_id: str, args_hash: str, *, approve: bool, comment: str = ""
               ) -> approval_service_pb2.DecideApprovalResponse:
        """DecideApproval; retried while the approval is not yet in the read model or the API is busy."""
        request = approval_service_pb2.DecideApprovalRequest(approval_id=approval_id, args_hash=args_hash,
                                                             approve=approve, comment=comment)
        return self._retry(self.approvals.DecideApproval, request, also=(grpc.StatusCode.NOT_FOUND,))

    def _retry(self, method, request, *, also: tuple[grpc.StatusCode, ...] = (), attempts: int = 20):
        retryable = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, *also}
        attempt = 0
        while True:
            try:
                return method(request, metadata=self.metadata, timeout=self.timeout_s)
            except grpc.RpcError as err:
                attempt += 1
                if err.code() not in retryable or attempt >= attempts:
                    raise
                time.sleep(min(2.0, 0.1 * 2**attempt))

    def close(self) -> None:
        self.channel.close()


# -- processes ------------------------------------------------------------------------------------


class _PortProcess(ServiceProcess):
    """A process without a health endpoint: healthy once it accepts TCP connections on its port."""

    def __init__(self, module: str, *, port: int, **kwargs: Any) -> None:
        super().__init__(module, health_port=port, **kwargs)
        self.port = port

    def healthy(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                return True
        except OSError:
            return False


def _cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [part.decode(errors="replace") for part in fh.read().split(b"\0") if part]
    except OSError:
        return None


def stop_recorded(state_dir: Path, *, grace_s: float = 15.0) -> list[str]:
    """Stop every process a TetherSystem recorded in `state_dir` and that still runs; return their names.

    A PID is signalled only if its command line is still the recorded one (a reused PID is left
    alone). SIGTERM to its process group, SIGKILL to what is left after `grace_s`.
    """
    path = Path(state_dir) / _STATE_FILE
    try:
        recorded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    ours = [p for p in recorded.get("processes", []) if _cmdline(int(p["pid"])) == p["argv"]]
    for proc in ours:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(proc["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_members(int(p["pid"])) for p in ours):
        time.sleep(0.1)
    for proc in ours:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(proc["pid"]), signal.SIGKILL)
    path.unlink(missing_ok=True)
    return [p["name"] for p in ours]


# -- the system -----------------------------------------------------------------------------------


@dataclass
class Bootstrap:
    """What was set up in the run_api schema: the tenant's keys and the demo agent's tools."""

    tenant_id: str
    api_key: str
    approver_key: str
    agent_id: str
    agent_version: int
    tools: list[str]


class TetherSystem:
    """Effect sinks, a model, topics, a tenant and the six services as real processes (see the module doc).

    After `start()`: `client` (user key: member + admin), `approver` (approver key), `address`
    (gRPC host:port), `processes[name]` (ServiceProcess of every component), `sink_records(kind)`,
    `model_requests()`, `kill(name, sig)`, `restart(name)`, `stop()`.
    """

    def __init__(self, config: SystemConfig) -> None:
        self.config = config
        namespace = config.namespace if config.namespace is not None else unique_name("e2e", sep="_")
        self.names = Names(namespace)
        self.workdir = Path(config.workdir)
        self.state_dir = Path(config.state_dir or config.workdir)
        self.log_dir = self.workdir / "logs"
        self.processes: dict[str, ServiceProcess] = {}
        #: Kills and restarts come from several threads (make chaos): one writer of the PID file at a time.
        self._state_lock = threading.Lock()
        self.sink_urls: dict[str, str] = {}
        self.smtp_port = 0
        self.model_base_url: str | None = None
        self.address = ""
        self.bootstrap: Bootstrap | None = None
        self.client: ApiClient | None = None
        self.approver: ApiClient | None = None
        self._ports: dict[str, int] = {}
        self._argv: dict[str, list[str]] = {}

    # -- paths -------------------------------------------------------------------------------
    @property
    def namespace(self) -> str:
        return self.names.namespace

    def sink_record_path(self, kind: str) -> Path:
        """The JSONL file the sink `kind` ("http", "smtp", "kv") appends every effect to."""
        if kind not in SINKS:
            raise ValueError(f"no sink {kind!r}; sinks are {SINKS}")
        return self.workdir / "sinks" / f"{kind}.jsonl"

    @property
    def model_request_log(self) -> Path:
        """The scripted model server's request log (one JSON line per request)."""
        return self.workdir / "model-requests.jsonl"

    def sink_records(self, kind: str) -> list[dict[str, Any]]:
        from tether_devservices.recorder import read_records

        return read_records(self.sink_record_path(kind))

    def kv_store_key(self, key: str, tenant_id: str | None = None) -> str:
        """The key the shared KV sink records for a tenant's `key` (the system's tenant by default): the
        gateway's kv_put/kv_get put every key under its tenant's id, so tenants never read each other's."""
        return f"{tenant_id or self.bootstrap.tenant_id}/{key}"

    def model_requests(self) -> list[dict[str, Any]]:
        from tether_modelserver.server import read_request_log

        return read_request_log(self.model_request_log)

    def log_path(self, name: str) -> Path:
        return self.processes[name].log_path

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last lines of a component's log (for failure messages)."""
        text = self.processes[name].log_text().splitlines() if name in self.processes else []
        return "\n".join(text[-lines:])

    @property
    def status_page_url(self) -> str:
        """A URL on the HTTP sink that the demo's http_get may fetch (its host is allow-listed)."""
        return f"{self.sink_urls['http']}/service-status"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> TetherSystem:
        """Start everything and return once all six services are ready; on failure stop what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._start_sinks_and_model()
        declare_topics(self.config.kafka_bootstrap, self.config.partitions, CHANGELOG_SERVICES,
                       prefix=self.names.topic_prefix, replication_factor=self.config.replication_factor)
        self.bootstrap = self._bootstrap_tenant()
        self._start_services()
        self.client = ApiClient(self.address, self.bootstrap.api_key)
        self.approver = ApiClient(self.address, self.bootstrap.approver_key)

    def _port(self, name: str) -> int:
        if name not in self._ports:
            self._ports[name] = self.config.ports.get(name) or free_port()
        return self._ports[name]

    def _process(self, name: str, module: str, *, args: Sequence[str] = (), port: int | None = None,
                 **kwargs: Any) -> ServiceProcess:
        """A ServiceProcess for `python -m module args` (TCP-checked when `port` is given)."""
        self._argv[name] = [self.config.python, "-m", module, *args]
        if port is not None:
            return _PortProcess(module, port=port, log_dir=self.log_dir, name=name, python=self.config.python,
                                args=list(args), **kwargs)
        return ServiceProcess(module, log_dir=self.log_dir, name=name, python=self.config.python, args=list(args),
                              **kwargs)

    def _start_sinks_and_model(self) -> None:
        (self.workdir / "sinks").mkdir(parents=True, exist_ok=True)
        pending: dict[str, ServiceProcess] = {}
        for kind in SINKS:
            port = self._port(kind)
            delay = ["--delay-ms", str(self.config.sink_delay_ms[kind])] if self.config.sink_delay_ms.get(kind) else []
            pending[kind] = self._process(
                kind, "tether_devservices", port=port,
                args=[kind, "--port", str(port), "--record", str(self.sink_record_path(kind)), *delay],
                env=dict(self.config.extra_env.get(kind, {})),
            )
        self.sink_urls = {kind: f"http://127.0.0.1:{self._port(kind)}" for kind in ("http", "kv")}
        self.smtp_port = self._port("smtp")
        if self.config.model.scripted:
            from tether_modelserver.scenarios import bundled_scenarios_dir

            port = self._port(MODEL)
            args = ["--port", str(port), "--request-log", str(self.model_request_log)]
            for path in [bundled_scenarios_dir(), *self.config.scenarios]:
                args += ["--scenarios", str(path)]
            pending[MODEL] = self._process(MODEL, "tether_modelserver", args=args, health_port=port,
                                           health_path="/healthz", env=dict(self.config.extra_env.get(MODEL, {})))
            self.model_base_url = f"http://127.0.0.1:{port}/v1"
        else:
            self.model_base_url = self.config.model.base_url
        self._start_all(pending, timeout=60)

    def _start_all(self, pending: Mapping[str, ServiceProcess], *, timeout: float) -> None:
        """Start processes concurrently (each waits for its own health); record every PID."""
        self.processes.update(pending)
        with ThreadPoolExecutor(max_workers=len(pending) or 1) as pool:
            futures = {name: pool.submit(proc.start, timeout) for name, proc in pending.items()}
            # Record the PIDs as soon as they exist, before waiting for health, so that if this
            # process dies now another one can still stop them.
            while not all(self._spawned(proc) or futures[name].done() for name, proc in pending.items()):
                time.sleep(0.05)
            self._write_state()
            failures = []
            for future in futures.values():
                try:
                    future.result()
                except ServiceFailed as err:
                    failures.append(str(err))
        self._write_state()
        if failures:
            raise TetherSystemError("\n\n".join(failures))

    @staticmethod
    def _spawned(proc: ServiceProcess) -> bool:
        try:
            _ = proc.pid  # raises ServiceFailed when the spawn failed
        except ServiceFailed:
            return False
        return True

    def _write_state(self) -> None:
        # Under a lock: two threads writing the one temporary file raced (one renamed it away
        # under the other), and the FileNotFoundError ended `make chaos`'s kill loop early.
        with self._state_lock:
            records = [
                {"name": name, "pid": proc.pid, "argv": self._argv[name], "log": str(proc.log_path)}
                for name, proc in list(self.processes.items())
                if self._spawned(proc) and proc.running
            ]
            path = self.state_dir / _STATE_FILE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"namespace": self.namespace, "processes": records}, indent=1))
            tmp.replace(path)

    def _bootstrap_tenant(self) -> Bootstrap:
        return self.bootstrap_tenant(self.config.tenant_id, principal_id=self.config.principal_id,
                                     approver_id=self.config.approver_id)

    def bootstrap_tenant(self, tenant_id: str, *, principal_id: str, approver_id: str) -> Bootstrap:
        """Set up a tenant like the system's own (keys, the built-in tools, grants, agent `demo`).

        Callable after `start()` for more tenants (load tests); repeating it issues new keys only.
        """
        from tether_run_api import admin
        from tether_run_api.adapters.postgres import PostgresStore, migrate, open_pool
        from tether_tool_gateway.builtin_tools import builtin_tool_specs

        tools = builtin_tool_specs(kv_url=self.sink_urls["kv"], smtp_host="127.0.0.1", smtp_port=self.smtp_port,
                                   email_from=self.config.email_from, http_allow_hosts=["127.0.0.1", "localhost"])
        model = self.config.model
        agent = admin.demo_agent_spec(model.provider, model.name, [t.name for t in tools],
                                      context_window_tokens=model.context_window_tokens)
        pool = open_pool(self.config.pg_dsn, max_size=2)
        try:
            migrate(pool, self.names.run_api_schema)
            store = PostgresStore(pool, self.names.run_api_schema)
            setup = admin.bootstrap_demo(
                store, tenant_id=tenant_id, principal_id=principal_id,
                approver_id=approver_id, tools=tools, agent=agent, now_ms=time.time_ns() // 1_000_000,
            )
        finally:
            pool.close()
        if setup.key is None or setup.approver_key is None:
            raise TetherSystemError("bootstrap-demo issued no keys")
        return Bootstrap(tenant_id=tenant_id, api_key=setup.key.api_key,
                         approver_key=setup.approver_key.api_key, agent_id=setup.agent.agent_id,
                         agent_version=setup.agent.version, tools=[t.name for t in setup.tools])

    def service_env(self, name: str, health_port: int) -> dict[str, str]:
        """The environment `python -m <service>` runs with (shared infrastructure + its own settings)."""
        cfg, names = self.config, self.names
        prefix = SERVICES[name][1]
        env = {
            "TETHER_KAFKA_BOOTSTRAP": cfg.kafka_bootstrap,
            "TETHER_PG_DSN": cfg.pg_dsn,
            "TETHER_REDIS_URL": cfg.redis_url,
            "TETHER_PARTITIONS": str(cfg.partitions),
            "TETHER_TOPIC_PREFIX": names.topic_prefix,
            "TETHER_TOPIC_REPLICATION_FACTOR": str(cfg.replication_factor),
            f"{prefix}METRICS_PORT": str(health_port),
            f"{prefix}HTTP_HOST": "127.0.0.1",
            f"{prefix}DECLARE_TOPICS": "false",  # declared once, up front
            # Short batches: a step is a handful of records, so latency matters more than throughput.
            f"{prefix}BATCH_MAX_MS": "20",
            # A killed instance's partitions move to its successor sooner (the broker's minimum).
            f"{prefix}SESSION_TIMEOUT_MS": "6000",
        }
        if name in CHANGELOG_SERVICES:
            # Slot 0 set explicitly, as a StatefulSet's ordinal is: the loop's consumer is then a
            # static group member, so a restarted instance takes its partitions back at once.
            env[f"{prefix}INSTANCE_ID"] = "0"
        if name == "run-api":
            env |= {
                "TETHER_RUN_API_PORT": str(self._port("grpc")),
                "TETHER_RUN_API_PG_SCHEMA": names.run_api_schema,
                "TETHER_RUN_API_READ_MODEL_SCHEMA": names.read_model_schema,
                "TETHER_RUN_API_LIVE_KEY_PREFIX": names.live_key_prefix,
            }
        elif name == "tool-gateway":
            env |= {
                "TETHER_GATEWAY_LEDGER_SCHEMA": names.gateway_schema,
                "TETHER_GATEWAY_BLOB_SCHEMA": names.blob_schema,
            }
        elif name == "planner":
            if cfg.model.scripted:
                # The scripted server needs no credential; never send a real one to it.
                env |= {"TETHER_LLM_BASE_URL": self.model_base_url or "", "OPENAI_API_KEY": "",
                        "ANTHROPIC_API_KEY": ""}
            elif cfg.model.base_url:
                env["TETHER_LLM_BASE_URL"] = cfg.model.base_url
        elif name == "projector":
            env |= {
                "TETHER_PROJECTOR_READ_MODEL_SCHEMA": names.read_model_schema,
                "TETHER_PROJECTOR_REDIS_KEY_PREFIX": names.live_key_prefix,
            }
        env |= dict(cfg.extra_env.get(name, {}))
        return env

    def _start_services(self) -> None:
        pending = {}
        for name, (module, _prefix) in SERVICES.items():
            port = self._port(f"{name}.health")
            pending[name] = self._process(name, module, health_port=port, health_path="/readyz",
                                          env=self.service_env(name, port))
        self.address = f"127.0.0.1:{self._port('grpc')}"
        self._start_all(pending, timeout=self.config.start_timeout_s)

    def start_instance(self, name: str, instance_id: int) -> str:
        """Start one more instance of a loop service in the same consumer group, in slot `instance_id`
        (its own transactional id); returns its component name `<name>#<instance_id>`, which `kill`,
        `restart`, `stop_instance` and `processes` take. Slot 0 is the instance `start()` started."""
        if name not in CHANGELOG_SERVICES or instance_id < 1:
            raise TetherSystemError(f"only loop services get more instances, in slots >= 1 (not {name} #{instance_id})")
        component = f"{name}#{instance_id}"
        if component in self.processes and self.processes[component].running:
            raise TetherSystemError(f"{component} is already running")
        port = self._port(f"{component}.health")
        env = self.service_env(name, port) | {f"{SERVICES[name][1]}INSTANCE_ID": str(instance_id)}
        proc = self._process(component, SERVICES[name][0], health_port=port, health_path="/readyz", env=env)
        self._start_all({component: proc}, timeout=self.config.start_timeout_s)
        return component

    def stop_instance(self, component: str) -> None:
        """Stop an instance `start_instance` started (SIGTERM: it commits its batch and exits) and forget it.

        A static group member does not leave the group: its partitions move to the other
        instances after the session timeout (6 s)."""
        proc = self.processes.pop(component)
        proc.stop()
        self._write_state()

    # -- faults --------------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal a component's PID (SIGKILL: a crash) and wait for it to exit; returns its exit status."""
        status = self.processes[name].kill(sig)
        self._write_state()
        return status

    def restart(self, name: str) -> ServiceProcess:
        """Start a component again (stopping it first if it still runs) and wait until it is ready."""
        proc = self.processes[name].restart(self.config.start_timeout_s)
        self._write_state()
        return proc

    def stop(self) -> None:
        """Stop every process this system started (services first, then model and sinks). Idempotent."""
        for client in (self.client, self.approver):
            if client is not None:
                client.close()
        self.client = self.approver = None
        known = ("run-api", "planner", "tool-gateway", "approval", "budget", "projector", MODEL, *SINKS)
        # Extra instances (start_instance) are stopped with the services.
        order = [n for n in self.processes if n not in known] + [n for n in known if n in self.processes]
        with ThreadPoolExecutor(max_workers=len(order) or 1) as pool:
            list(pool.map(lambda n: self.processes[n].stop(), order))
        (self.state_dir / _STATE_FILE).unlink(missing_ok=True)

    def drop_data(self) -> None:
        """Delete the namespace's topics, PostgreSQL schemas and Redis keys (after `stop`)."""
        if not self.namespace:
            raise TetherSystemError("refusing to drop the production names (empty namespace)")
        drop_namespace(self.names, kafka_bootstrap=self.config.kafka_bootstrap, pg_dsn=self.config.pg_dsn,
                       redis_url=self.config.redis_url)

    def __enter__(self) -> TetherSystem:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def drop_namespace(names: Names, *, kafka_bootstrap: str, pg_dsn: str, redis_url: str) -> None:
    """Delete every topic, schema and Redis key of a (non-empty) namespace."""
    if not names.namespace:
        raise TetherSystemError("refusing to drop the production names (empty namespace)")
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topics = [t for t in admin.list_topics(timeout=30).topics if t.startswith(names.topic_prefix)]
    if topics:
        for future in admin.delete_topics(topics, operation_timeout=30).values():
            with contextlib.suppress(Exception):  # already gone
                future.result(timeout=30)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for schema in names.schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    client = redis.Redis.from_url(redis_url)
    try:
        batch = list(client.scan_iter(match=f"{names.live_key_prefix}*", count=500))
        for i in range(0, len(batch), 500):
            client.delete(*batch[i:i + 500])
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tether_testing.system stop STATE_DIR...`: stop what TetherSystems recorded there."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "stop":
        print("usage: python -m tether_testing.system stop STATE_DIR...", file=sys.stderr)
        return 2
    stopped = [name for state_dir in args[1:] for name in stop_recorded(Path(state_dir))]
    print(f"stopped {', '.join(stopped)}" if stopped else "no Tether services were running")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
