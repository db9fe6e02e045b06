#!/usr/bin/env python3
"""Tether's local stack: Kafka (KRaft), PostgreSQL and Redis on loopback, managed by recorded PID.

Usage: stack.py {up|down|status} [kafka|postgres|redis ...] [--json]
       stack.py fetch-kafka     resolve the broker jars into $TETHER_STATE_DIR/kafka/libs
       stack.py purge           down, then delete the state (and PostgreSQL's data dir)

Standard library only, so it runs with the system python3 before .venv exists.
Exit codes: 0 ok, 1 failure, 3 a port is held by a process this state dir did not start.
"""

from __future__ import annotations

import abc
import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import string
import struct
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HOST = "127.0.0.1"
EXIT_FAILED = 1
EXIT_PORT_TAKEN = 3


class StackError(Exception):
    """A component could not be brought to the requested state; the message says why."""

    exit_code = EXIT_FAILED


class PortTaken(StackError):
    """A port we need is held by a process this state dir did not start."""

    exit_code = EXIT_PORT_TAKEN


@dataclass(frozen=True)
class Settings:
    """Where the stack keeps its state and which loopback ports it uses (from TETHER_* env)."""

    state_dir: Path
    kafka_port: int
    kafka_controller_port: int
    pg_port: int
    redis_port: int
    kafka_heap: str
    start_timeout: float

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        state = Path(env.get("TETHER_STATE_DIR") or REPO / ".state").expanduser()
        kafka_port = _port(env, "TETHER_KAFKA_PORT", 9092)
        return cls(
            state_dir=state.resolve(),
            kafka_port=kafka_port,
            # The controller listener sits next to the broker's unless placed explicitly.
            kafka_controller_port=_port(env, "TETHER_KAFKA_CONTROLLER_PORT", kafka_port + 1),
            pg_port=_port(env, "TETHER_PG_PORT", 5432),
            redis_port=_port(env, "TETHER_REDIS_PORT", 6379),
            kafka_heap=env.get("TETHER_KAFKA_HEAP", "512m"),
            start_timeout=float(env.get("TETHER_STACK_START_TIMEOUT", "120")),
        )


def _port(env: dict[str, str] | os._Environ[str], name: str, default: int) -> int:
    raw = env.get(name) or str(default)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise StackError(f"{name}={raw!r} is not a TCP port number")
    return int(raw)


# ---------------------------------------------------------------------------------------------
# Processes and ports


def pid_alive(pid: int) -> bool:
    """True if the PID exists and is not a zombie (a reaped-late child of someone else)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may contain spaces.
    return stat[stat.rindex(")") + 2] not in "ZX"


def port_free(port: int) -> bool:
    """True if we could bind HOST:port now (SO_REUSEADDR, so TIME_WAIT leftovers don't count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def listening_pid(port: int) -> int | None:
    """The PID of the process listening on the TCP port, from /proc (Linux); None if not found."""
    inodes = _listening_inodes(port)
    return _pid_holding(inodes) if inodes else None


def port_holder(port: int) -> str:
    """Best effort 'pid N (name)' of whoever listens on the port, from /proc (Linux)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return "an unknown process"
    pid = _pid_holding(inodes)
    if pid is None:
        return "a process this user cannot see"
    comm = Path(f"/proc/{pid}/comm")
    with contextlib.suppress(OSError):
        return f"pid {pid} ({comm.read_text().strip()})"
    return f"pid {pid}"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                    inodes.add(f"socket:[{cols[9]}]")
    return inodes


def _pid_holding(inodes: set[str]) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(proc.name)
    return None


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(f"    {line}" for line in text[-lines:]) or f"(empty log at {path})"


def stop_pid(pid: int, first: signal.Signals, grace: float) -> None:
    """Signal the PID, wait up to `grace` seconds, then SIGKILL it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    deadline = time.monotonic() + grace
    while pid_alive(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
        time.sleep(0.2)


@contextlib.contextmanager
def locked(path: Path):
    """Serialise up/down of one component between concurrent callers (make, pytest)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def spawn(argv: list[str], log: Path, cwd: Path, **kw) -> subprocess.Popen:
    """Start a daemon in its own session, detached from our stdin, output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd=cwd, start_new_session=True, close_fds=True, **kw,
        )


# ---------------------------------------------------------------------------------------------
# Components


class Component(abc.ABC):
    """One server of the stack: knows how to start it, check it answers, and stop it."""

    name = ""
    # label in ports() -> (Settings field, environment variable)
    port_settings: dict[str, tuple[str, str]] = {}
    stop_signal = signal.SIGTERM
    stop_grace = 60.0

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.dir = settings.state_dir / self.name
        self.record_path = self.dir / "process.json"

    def ports(self) -> dict[str, int]:
        return {label: getattr(self.s, field) for label, (field, _) in self.port_settings.items()}

    # -- each server implements these -----------------------------------------------------
    def check_installed(self) -> None:  # noqa: B027 (optional hook)
        """Raise StackError naming what `make setup` has not installed yet."""

    @abc.abstractmethod
    def is_ours(self, pid: int) -> bool:
        """True if the live PID is the server this state dir started (guards PID reuse)."""

    @abc.abstractmethod
    def start(self) -> tuple[int, Path]:
        """Start the server; return its PID and its log file."""

    @abc.abstractmethod
    def answers(self) -> bool:
        """True if the server answers a real request (not just an open port)."""

    def after_ready(self) -> None:  # noqa: B027 (optional hook)
        """One-off work once the server answers (create a database, ...)."""

    def describe(self) -> dict[str, str]:
        return {}

    # -- shared lifecycle -------------------------------------------------------------------
    def record(self) -> dict | None:
        try:
            return json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None

    def running_pid(self) -> int | None:
        rec = self.record()
        if rec and pid_alive(rec["pid"]) and self.is_ours(rec["pid"]):
            return int(rec["pid"])
        return None

    def address(self) -> str:
        return f"{HOST}:{self.ports()['port']}"

    def up(self, notify=lambda line: None) -> dict:
        with locked(self.dir / ".lock"):
            pid = self.running_pid()
            if pid is not None:
                recorded = self.record()["ports"]
                if recorded != self.ports():
                    raise StackError(
                        f"{self.name}: already running from {self.s.state_dir} (pid {pid}) with ports "
                        f"{recorded}, not the requested {self.ports()}; run `make down` first"
                    )
                if not self.answers():
                    raise StackError(f"{self.name}: pid {pid} is running but does not answer on "
                                     f"{self.address()}; see {self.dir}")
                return {"started": False, "pid": pid, "address": self.address()}
            self.check_installed()
            for label, port in self.ports().items():
                if not port_free(port):
                    env = self.port_settings[label][1]
                    raise PortTaken(
                        f"{self.name}: port {port} on {HOST} ({env}) is in use by {port_holder(port)}, "
                        f"which this stack did not start (state dir {self.s.state_dir}). Stop it, "
                        f"or choose another port: {env}=<free port> make up"
                    )
            self.record_path.unlink(missing_ok=True)
            notify(f"{self.name}: starting on {self.address()} ...")
            began = time.monotonic()
            pid, log = self.start()
            self.record_path.write_text(json.dumps({"pid": pid, "ports": self.ports(), "log": str(log)}))
            try:
                self._wait_ready(pid, log, began)
                self.after_ready()
            except BaseException:
                self._stop(pid)
                self.record_path.unlink(missing_ok=True)
                raise
            return {"started": True, "pid": pid, "address": self.address(),
                    "seconds": round(time.monotonic() - began, 1)}

    def _wait_ready(self, pid: int, log: Path, began: float) -> None:
        deadline = began + self.s.start_timeout
        while not self.answers():
            if not pid_alive(pid):
                raise StackError(f"{self.name}: exited while starting; last lines of {log}:\n{log_tail(log)}")
            if time.monotonic() > deadline:
                raise StackError(
                    f"{self.name}: did not answer on {self.address()} within {self.s.start_timeout:.0f}s "
                    f"(TETHER_STACK_START_TIMEOUT); last lines of {log}:\n{log_tail(log)}"
                )
            time.sleep(0.3)

    def _stop(self, pid: int) -> None:
        stop_pid(pid, self.stop_signal, self.stop_grace)

    def down(self) -> dict:
        with locked(self.dir / ".lock"):
            pid = self.running_pid()
            if pid is None:
                self.record_path.unlink(missing_ok=True)
                return {"stopped": False}
            self._stop(pid)
            self.record_path.unlink(missing_ok=True)
            return {"stopped": True, "pid": pid}

    def status(self) -> dict:
        pid = self.running_pid()
        info: dict = {"address": self.address(), **self.describe()}
        if pid is not None:
            # Report where it really listens: it may have been started with other TETHER_*_PORT values.
            ran = self.record()["ports"]
            if ran != self.ports():
                fields = {self.port_settings[label][0]: port for label, port in ran.items()}
                return type(self)(replace(self.s, **fields)).status()
            info.update(state="running", pid=pid, answers=self.answers())
        else:
            taken = [p for p in self.ports().values() if not port_free(p)]
            info["state"] = "stopped"
            if taken:
                info["note"] = f"port {taken[0]} is in use by {port_holder(taken[0])} (not ours)"
        return info


class Kafka(Component):
    """Apache Kafka, KRaft broker+controller, from the jars deploy/local/kafka/pom.xml resolves."""

    name = "kafka"
    port_settings = {"port": ("kafka_port", "TETHER_KAFKA_PORT"),
                     "controller_port": ("kafka_controller_port", "TETHER_KAFKA_CONTROLLER_PORT")}

    @property
    def libs(self) -> Path:
        return self.dir / "libs"

    @property
    def config(self) -> Path:
        return self.dir / "server.properties"

    def pom_digest(self) -> str:
        return hashlib.sha256((HERE / "kafka" / "pom.xml").read_bytes()).hexdigest()

    def libs_current(self) -> bool:
        stamp = self.dir / "libs.sha256"
        return stamp.is_file() and stamp.read_text().strip() == self.pom_digest() and any(self.libs.glob("*.jar"))

    def fetch(self) -> str:
        """Copy the broker's runtime jars from Maven (re-resolved whenever pom.xml changes)."""
        if self.libs_current():
            return f"kafka: jars up to date in {self.libs}"
        if shutil.which("mvn") is None:
            raise StackError("kafka: `mvn` not found; run `make setup`")
        staging = self.dir / "libs.partial"
        shutil.rmtree(staging, ignore_errors=True)
        cmd = ["mvn", "-B", "-q", "-f", str(HERE / "kafka" / "pom.xml"), "dependency:copy-dependencies",
               f"-DoutputDirectory={staging}", "-DincludeScope=runtime"]
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            raise StackError(f"kafka: `{' '.join(cmd)}` failed:\n{done.stdout}{done.stderr}")
        shutil.rmtree(self.libs, ignore_errors=True)
        staging.rename(self.libs)
        (self.dir / "libs.sha256").write_text(self.pom_digest() + "\n")
        return f"kafka: {len(list(self.libs.glob('*.jar')))} jars copied to {self.libs}"

    def is_ours(self, pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return str(self.config).encode() in argv

    def _java(self, main: str, *args: str) -> list[str]:
        return ["java", f"-Xms{self.s.kafka_heap}", f"-Xmx{self.s.kafka_heap}", "-XX:+UseG1GC",
                f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
                f"-Dkafka.logs.dir={self.dir / 'logs'}",
                "-cp", f"{self.libs}/*", main, *args]

    def check_installed(self) -> None:
        if not self.libs_current():
            raise StackError(f"kafka: broker jars missing or older than deploy/local/kafka/pom.xml in "
                             f"{self.libs}; run `make setup`")
        if shutil.which("java") is None:
            raise StackError("kafka: `java` not found; run `make setup`")

    def start(self) -> tuple[int, Path]:
        data = self.dir / "data"
        template = string.Template((HERE / "kafka" / "server.properties.in").read_text())
        self.config.write_text(template.substitute(
            port=self.s.kafka_port, controller_port=self.s.kafka_controller_port, log_dirs=data))
        shutil.copyfile(HERE / "kafka" / "log4j2.properties", self.dir / "log4j2.properties")
        log = self.dir / "logs" / "kafka.out"
        if not (data / "meta.properties").is_file():
            cluster_id = "-"
            # Like Kafka's own Uuid.randomUuid(): an id starting with "-" would parse as an option.
            while cluster_id.startswith("-"):
                cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            fmt = subprocess.run(self._java("kafka.tools.StorageTool", "format", "-t", cluster_id,
                                            "-c", str(self.config)),
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if fmt.returncode != 0:
                raise StackError(f"kafka: formatting {data} failed:\n{fmt.stdout}{fmt.stderr}")
        proc = spawn(self._java("kafka.Kafka", str(self.config)), log, cwd=self.dir)
        return proc.pid, log

    def answers(self) -> bool:
        """A Metadata request (v4, the oldest Kafka 4 accepts) lists at least one broker."""
        try:
            with socket.create_connection((HOST, self.s.kafka_port), timeout=2) as conn:
                client = b"tether-stack"
                body = struct.pack(">hhih", 3, 4, 1, len(client)) + client + struct.pack(">i?", -1, False)
                conn.sendall(struct.pack(">i", len(body)) + body)
                size = struct.unpack(">i", _recv(conn, 4))[0]
                reply = _recv(conn, size)
        except (OSError, struct.error, ValueError):
            return False
        # correlation_id, throttle_time_ms, then the brokers array's length.
        _, _, brokers = struct.unpack(">iii", reply[:12])
        return brokers > 0

    def describe(self) -> dict[str, str]:
        return {"data_dir": str(self.dir / "data"), "log": str(self.dir / "logs" / "server.log")}


def _recv(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ValueError("connection closed")
        buf += chunk
    return buf


class Postgres(Component):
    """PostgreSQL from Debian's packages: user `tether` (superuser), database `tether`, trust on loopback.

    The server may not run as root, so as root it runs as the `postgres` user. That user must be
    able to reach its data dir: when the state dir sits under a path it cannot traverse (a repo
    in /root, a 0700 temp dir), the cluster lives in /var/tmp/tether-postgres-<hash of the state
    dir> instead, and `status` names the place.
    """

    name = "postgres"
    port_settings = {"port": ("pg_port", "TETHER_PG_PORT")}
    stop_signal = signal.SIGINT  # "fast" shutdown: roll back open sessions instead of waiting on them

    @property
    def bindir(self) -> Path:
        if os.environ.get("TETHER_PG_BINDIR"):
            return Path(os.environ["TETHER_PG_BINDIR"])
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"),
                       key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
        if not found:
            raise StackError("postgres: no /usr/lib/postgresql/*/bin/postgres; run `make setup`")
        return found[-1].parent

    def _run_as(self) -> dict:
        """Popen arguments that drop root to the `postgres` user (PostgreSQL refuses to run as root)."""
        if os.geteuid() != 0:
            return {}
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise StackError("postgres: running as root but there is no `postgres` user; run `make setup`") from None
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}

    def _owner_can_use(self, path: Path) -> bool:
        if os.geteuid() != 0:
            return True
        probe = subprocess.run(["test", "-w", str(path), "-a", "-x", str(path)], **self._run_as())
        return probe.returncode == 0

    @property
    def root(self) -> Path:
        """The directory holding data/, the socket and the server log (chosen once, then remembered)."""
        pointer = self.dir / "root"
        if pointer.is_file():
            return Path(pointer.read_text().strip())
        return self.dir / "cluster"

    def _choose_root(self) -> Path:
        pointer = self.dir / "root"
        if pointer.is_file():
            return Path(pointer.read_text().strip())
        self.dir.mkdir(parents=True, exist_ok=True)
        candidates = [self.dir / "cluster"]
        digest = hashlib.sha256(str(self.s.state_dir).encode()).hexdigest()[:12]
        candidates.append(Path("/var/tmp") / f"tether-postgres-{digest}")
        for root in candidates:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            if os.geteuid() == 0:
                run_as = self._run_as()
                os.chown(root, run_as["user"], run_as["group"])
            if self._owner_can_use(root):
                pointer.write_text(f"{root}\n")
                return root
            root.rmdir()
        raise StackError(f"postgres: the postgres user cannot use any of {candidates}")

    def is_ours(self, pid: int) -> bool:
        # The postmaster chdirs into its data dir; a reused PID would not sit there.
        try:
            return Path(os.readlink(f"/proc/{pid}/cwd")) == self.root / "data"
        except OSError:
            return False

    def check_installed(self) -> None:
        self._run_as()
        for tool in ("initdb", "postgres", "pg_isready", "psql"):
            if not (self.bindir / tool).is_file():
                raise StackError(f"postgres: {self.bindir / tool} is missing; run `make setup`")

    def start(self) -> tuple[int, Path]:
        root = self._choose_root()
        data = root / "data"
        run_as = self._run_as()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "HOME": str(root)}
        if not data.exists():
            self._init_cluster(root, data, env, run_as)
        elif not self._complete(data):
            raise StackError(
                f"postgres: {data} is not a complete cluster (an initdb that was cut short by an older "
                f"stack.py leaves only part of one, and PostgreSQL cannot start from it). Delete it with "
                f"`python3 {Path(__file__).resolve()} purge postgres` (the local dev database and nothing "
                f"else), then `make up` again")
        socket_dir = root / "run"
        socket_dir.mkdir(exist_ok=True, mode=0o700)
        if run_as:
            os.chown(socket_dir, run_as["user"], run_as["group"])
        log = root / "postgres.log"
        proc = spawn([str(self.bindir / "postgres"), "-D", str(data), "-c", f"listen_addresses={HOST}",
                      "-p", str(self.s.pg_port), "-c", f"unix_socket_directories={socket_dir}"],
                     log, cwd=root, env=env, **run_as)
        return proc.pid, log

    @staticmethod
    def _complete(data: Path) -> bool:
        # initdb writes PG_VERSION first and pg_control only once the bootstrap has run.
        return (data / "PG_VERSION").is_file() and (data / "global" / "pg_control").is_file()

    def _init_cluster(self, root: Path, data: Path, env: dict[str, str], run_as: dict) -> None:
        """initdb into data.partial, then rename it to data: a cut-short initdb never looks like a cluster."""
        partial = root / "data.partial"
        shutil.rmtree(partial, ignore_errors=True)
        init = subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(partial), "-U", "tether", "--auth=trust",
             "--no-locale", "-E", "UTF8", "--no-instructions"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=root, env=env, **run_as)
        if init.returncode != 0:
            raise StackError(f"postgres: initdb in {partial} failed:\n{init.stdout}{init.stderr}")
        (partial / "pg_hba.conf").write_text(
            "# Written by deploy/local/stack.py: the local dev cluster trusts user tether on loopback.\n"
            "local  all  tether                 trust\n"
            "host   all  tether  127.0.0.1/32   trust\n")
        if run_as:
            os.chown(partial / "pg_hba.conf", run_as["user"], run_as["group"])
        partial.rename(data)

    def _psql(self, sql: str, db: str = "postgres") -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bindir / "psql"), "-h", HOST, "-p", str(self.s.pg_port), "-U", "tether", "-d", db,
             "-v", "ON_ERROR_STOP=1", "-tAc", sql],
            stdin=subprocess.DEVNULL, capture_output=True, text=True)

    def answers(self) -> bool:
        probe = subprocess.run([str(self.bindir / "pg_isready"), "-q", "-h", HOST, "-p", str(self.s.pg_port),
                                "-U", "tether", "-d", "postgres"], stdin=subprocess.DEVNULL)
        return probe.returncode == 0

    def after_ready(self) -> None:
        exists = self._psql("SELECT 1 FROM pg_database WHERE datname = 'tether'")
        if exists.returncode != 0:
            raise StackError(f"postgres: cannot query as tether: {exists.stderr}")
        if exists.stdout.strip() != "1":
            made = self._psql("CREATE DATABASE tether OWNER tether")
            if made.returncode != 0:
                raise StackError(f"postgres: CREATE DATABASE tether failed: {made.stderr}")

    def describe(self) -> dict[str, str]:
        return {"data_dir": str(self.root / "data"), "log": str(self.root / "postgres.log"),
                "dsn": f"postgresql://tether@{HOST}:{self.s.pg_port}/tether"}

    def purge(self) -> None:
        root = self.root
        if root.exists():
            shutil.rmtree(root)


class Redis(Component):
    """redis-server from Debian's packages; no persistence (the projector rebuilds its hot state)."""

    name = "redis"
    port_settings = {"port": ("redis_port", "TETHER_REDIS_PORT")}

    def is_ours(self, pid: int) -> bool:
        # redis-server rewrites its title, so its cmdline no longer names our config; its cwd (`dir`) does.
        try:
            return Path(os.readlink(f"/proc/{pid}/cwd")) == self.dir / "data"
        except OSError:
            return False

    def check_installed(self) -> None:
        if shutil.which("redis-server") is None:
            raise StackError("redis: `redis-server` not found; run `make setup`")

    def start(self) -> tuple[int, Path]:
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        conf = self.dir / "redis.conf"
        conf.write_text(
            "# Written by deploy/local/stack.py on every `up`.\n"
            f"bind {HOST}\nport {self.s.redis_port}\nprotected-mode yes\ndaemonize no\n"
            f"dir {self.dir / 'data'}\nsave \"\"\nappendonly no\nlogfile \"\"\n")
        log = self.dir / "redis.log"
        proc = spawn(["redis-server", str(conf)], log, cwd=self.dir)
        return proc.pid, log

    def answers(self) -> bool:
        try:
            with socket.create_connection((HOST, self.s.redis_port), timeout=2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def describe(self) -> dict[str, str]:
        return {"log": str(self.dir / "redis.log"), "url": f"redis://{HOST}:{self.s.redis_port}/0"}


COMPONENTS = {"kafka": Kafka, "postgres": Postgres, "redis": Redis}


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "fetch-kafka", "purge"])
    parser.add_argument("components", nargs="*", metavar="component",
                        help=f"any of {', '.join(COMPONENTS)} (default: all of them)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    # `stack.py status | head` should end quietly, not with a BrokenPipeError traceback.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    unknown = sorted(set(args.components) - set(COMPONENTS))
    if unknown:
        parser.error(f"unknown component(s) {', '.join(unknown)}; choose from {', '.join(COMPONENTS)}")
    names = args.components or list(COMPONENTS)
    report: dict[str, dict] = {}

    def say(line: str) -> None:
        if not args.json:
            print(line, flush=True)

    try:
        settings = Settings.from_env()
        comps = [COMPONENTS[n](settings) for n in names]
        if args.command == "fetch-kafka":
            say(Kafka(settings).fetch())
        elif args.command == "up":
            for comp in comps:
                res = report[comp.name] = comp.up(notify=say)
                if res["started"]:
                    say(f"{comp.name}: started (pid {res['pid']}) on {res['address']} in {res['seconds']}s")
                else:
                    say(f"{comp.name}: already running (pid {res['pid']}) on {res['address']}")
        elif args.command in ("down", "purge"):
            # Stop in reverse order: nothing else depends on it, but keep the habit.
            for comp in reversed(comps):
                res = report[comp.name] = comp.down()
                say(f"{comp.name}: stopped (pid {res['pid']})" if res["stopped"] else f"{comp.name}: not running")
            if args.command == "purge":
                if "postgres" in names:
                    Postgres(settings).purge()
                for n in names:
                    shutil.rmtree(settings.state_dir / n, ignore_errors=True)
                say(f"purged {', '.join(names)} from {settings.state_dir}")
        else:
            say(f"state dir: {settings.state_dir}")
            for comp in comps:
                info = report[comp.name] = comp.status()
                head = f"{comp.name:9} {info['state']:8} {info['address']}"
                if info["state"] == "running":
                    head += f"  pid {info['pid']}" + ("" if info["answers"] else "  (NOT ANSWERING)")
                say(head)
                for key in ("note", "data_dir", "log"):
                    if key in info:
                        say(f"{'':9} {key}: {info[key]}")
    except StackError as err:
        if args.json:
            print(json.dumps({**report, "error": str(err)}), flush=True)
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    if args.json:
        print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
