"""Run one command inside bubblewrap: no network, read-only system, uid 65534, rlimits, a wall-clock kill."""

from __future__ import annotations

import enum
import errno
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tether_security.sandbox.process import (
    CLK_TCK,
    TICK_S,
    SandboxedProcess,
    json_documents,
    sample_namespace,
    sandbox_pid_namespace,
)
from tether_security.sandbox.seccomp import SeccompUnsupported, build_filter

NOBODY = 65534
SANDBOX_DIR = "/sandbox"
_SCRIPT_PATH = "/run/tether/script"
_READ_CHUNK = 65536

# A minimal /etc: enough for `id`, libc name lookups and localhost, nothing from the host's accounts.
_PASSWD = "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/sandbox:/usr/sbin/nologin\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"
_HOSTS = "127.0.0.1 localhost\n::1 localhost\n"
_NSSWITCH = "passwd: files\ngroup: files\nhosts: files\n"
# Read-only host files a normal program needs (no accounts, no keys: /etc/ssl/private is not among them).
_ETC_RO = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ssl/certs",
           "/etc/localtime", "/etc/mime.types")

# What programs print when an allocation fails under RLIMIT_AS (the kernel reports nothing to the parent).
_MEMORY_PATTERNS = re.compile(
    rb"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory|memory exhausted|"
    rb"failed to allocate|Could not allocate|ENOMEM",
    re.IGNORECASE,
)
# What programs print when fork/clone fails under RLIMIT_NPROC.
_FORK_PATTERNS = re.compile(
    rb"fork: (?:retry: )?Resource temporarily unavailable|Cannot fork|can't fork|BlockingIOError|"
    rb"can't start new thread",
    re.IGNORECASE,
)


class SandboxErrorCode(enum.StrEnum):
    """Machine-readable reason a sandboxed command did not succeed."""

    TIMEOUT = "TIMEOUT"
    MEMORY_LIMIT = "MEMORY_LIMIT"
    CPU_LIMIT = "CPU_LIMIT"
    PROCESS_LIMIT = "PROCESS_LIMIT"
    OUTPUT_LIMIT = "OUTPUT_LIMIT"
    SIGNALED = "SIGNALED"
    NONZERO_EXIT = "NONZERO_EXIT"


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or a helper it needs) is missing or unusable here; nothing runs unsandboxed."""


class SandboxSetupError(RuntimeError):
    """bubblewrap refused to build the sandbox (bad bind source, namespace failure); the command never ran."""

    def __init__(self, message: str, stderr: bytes) -> None:
        super().__init__(message)
        self.stderr = stderr


class InvalidSandboxRequest(ValueError):
    """The call asked for something the sandbox cannot do safely (empty argv, a workdir that is not a directory)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource bounds for one sandboxed command. Sizes are bytes, times seconds."""

    wall_seconds: float = 30.0
    # CPU of all the sandbox's processes together, sampled by the parent every TICK_S (which kills
    # the sandbox, CPU_LIMIT); RLIMIT_CPU bounds each process too (SIGXCPU, then SIGKILL a second later).
    cpu_seconds: int = 10
    # RLIMIT_AS: each process's address space, the only memory bound without cgroups. Each process
    # has its own, so a sandbox may hold up to max_processes × memory_bytes, plus what its tmpfs
    # mounts hold (/tmp and /dev/shm: tmp_bytes each; /sandbox: work_bytes). Memory outside any
    # address space (memfd_create, SysV shmget) is refused by the seccomp filter (docs/tools.md).
    memory_bytes: int = 1 << 30
    max_processes: int = 64  # RLIMIT_NPROC: tasks (processes and threads) of the sandbox user
    max_open_files: int = 256
    max_file_bytes: int = 64 << 20  # RLIMIT_FSIZE: largest file the command may write
    max_output_bytes: int = 1 << 20  # per stream; more is killed with OUTPUT_LIMIT
    tmp_bytes: int = 64 << 20  # size of the private /tmp tmpfs (and, separately, of /dev/shm)
    work_bytes: int = 256 << 20  # size of the fresh /sandbox tmpfs when no workdir is given

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "max_processes", "max_open_files",
                     "max_file_bytes", "max_output_bytes", "tmp_bytes", "work_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidSandboxRequest(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one sandboxed command. `error_code` is None exactly when it exited 0 in time."""

    exit_code: int | None  # the command's exit status; None when it died by a signal
    killed_by_signal: int | None  # signal number that ended the command (SIGKILL after a timeout)
    timed_out: bool  # the parent killed it at the wall-clock limit
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    error_code: SandboxErrorCode | None
    # "wall", "cpu", "memory", "processes", "output", "file_size" or None: the limit hit when
    # error_code names one; with NONZERO_EXIT or success, only a hint read from stderr (a
    # MemoryError, a failed fork) that the command may have met a limit and handled it itself.
    limit_hit: str | None
    duration_seconds: float
    cpu_seconds: float  # user+system CPU of the sandbox's processes, sampled every few tens of ms
    peak_tasks: int  # highest task count sampled inside the sandbox
    argv: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within every limit."""
        return self.error_code is None


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _checked_argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) and "\x00" not in a for a in argv):
        raise InvalidSandboxRequest("argv must be a non-empty list of strings without NUL bytes")
    return list(argv)


def _checked_paths(paths: Sequence[str]) -> tuple[str, ...]:
    if isinstance(paths, str):
        raise InvalidSandboxRequest("read-only paths must be a list of paths, not one string")
    for p in paths:
        if not isinstance(p, str) or not os.path.isabs(p) or "\x00" in p:
            raise InvalidSandboxRequest(f"read-only path {p!r} must be absolute")
    return tuple(paths)


def _checked_env(env: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(env or {})
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise InvalidSandboxRequest(f"environment variable name {name!r} is not [A-Za-z_][A-Za-z0-9_]*")
        if not isinstance(value, str) or "\x00" in value:
            raise InvalidSandboxRequest(f"environment variable {name} must be a string without NUL bytes")
    return env


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass(frozen=True)
class _Launch:
    """A bwrap command line with the descriptors to pass it and the read end of its JSON status pipe."""

    cmd: list[str]
    pass_fds: tuple[int, ...]
    status_r: int
    status_w: int


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class SandboxRunner:
    """Runs commands inside a bubblewrap sandbox; fails closed (SandboxUnavailable) rather than run unsandboxed.

    Every call gets: new user/PID/network/IPC/UTS/cgroup namespaces and no network at all; the
    host's /usr (read-only, with /bin, /lib, /sbin as symlinks), a synthetic minimal /etc, a
    private /proc, /dev and size-capped tmpfs /tmp; a writable work dir at /sandbox; uid/gid
    65534 both inside and outside the namespace (so RLIMIT_NPROC applies); an empty environment
    plus PATH, HOME and LANG; no capabilities, NoNewPrivs, a seccomp filter, a new session; and
    rlimits (CPU, address space, processes, open files, file size, no core dumps). The parent
    enforces the wall clock, the output caps and the CPU of all the sandbox's processes together,
    and kills the whole tree. `run` blocks; call it from
    a worker thread in async code. `start` runs a command in the same sandbox as a live process
    (`SandboxedProcess`: pipes to its stdin and stdout, the wall clock kept by a watcher thread).
    """

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        bwrap: str = "/usr/bin/bwrap",
        setpriv: str = "/usr/bin/setpriv",
        prlimit: str = "/usr/bin/prlimit",
        unshare: str = "/usr/bin/unshare",
        read_only_paths: Sequence[str] = (),
        seccomp: bool = True,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self._bwrap = bwrap
        self._setpriv = setpriv
        self._prlimit = prlimit
        self._unshare = unshare
        self._as_root = os.geteuid() == 0
        for tool in (bwrap, prlimit) + ((setpriv, unshare) if self._as_root else ()):
            if not (os.path.isfile(tool) and os.access(tool, os.X_OK)):
                raise SandboxUnavailable(
                    f"{tool} is missing or not executable; install bubblewrap and util-linux "
                    "(apt-get install bubblewrap util-linux). Refusing to run tools unsandboxed."
                )
        self._read_only_paths = _checked_paths(read_only_paths)
        self._seccomp_program: bytes | None = None
        if seccomp:
            try:
                self._seccomp_program = build_filter()
            except SeccompUnsupported as exc:
                raise SandboxUnavailable(f"{exc}; pass seccomp=False to run without the syscall filter") from exc

    def probe(self) -> None:
        """Run `true` in the sandbox; raise SandboxUnavailable if namespaces or bubblewrap do not work here."""
        try:
            result = self.run(["/bin/true"], limits=SandboxLimits(wall_seconds=10))
        except SandboxSetupError as exc:
            raise SandboxUnavailable(f"bubblewrap cannot build a sandbox here: {exc}") from exc
        if not result.ok:
            raise SandboxUnavailable(f"a trivial command failed in the sandbox: {result.error_code} {result.stderr!r}")

    def run_script(
        self,
        script: str,
        *,
        interpreter: Sequence[str] = ("/bin/sh", "-eu"),
        workdir: Path | None = None,
        stdin: bytes | None = None,
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run `script` with `interpreter` (e.g. ("/usr/bin/python3",)); the script is a read-only file, not argv."""
        return self._run(list(interpreter) + [_SCRIPT_PATH], workdir=workdir, stdin=stdin, limits=limits,
                         script=script.encode())

    def run(
        self,
        argv: Sequence[str],
        *,
        workdir: Path | None = None,
        stdin: bytes | None = None,
        limits: SandboxLimits | None = None,
        read_only_paths: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        """Run `argv` in a fresh sandbox.

        /sandbox is a new size-capped tmpfs (`work_bytes`) that vanishes with the sandbox, unless
        `workdir` is given: that host directory is bound read-write at /sandbox and handed to uid
        65534 (chown of the directory itself, not its contents); its disk use is bounded only per
        file (`max_file_bytes`), so give one only to trusted-size work. Every ancestor of
        `workdir` must be searchable by uid 65534 (InvalidSandboxRequest otherwise).
        `read_only_paths` (absolute) are bound read-only at the same place for this command only,
        besides the runner's own; `env` adds variables to the command's environment (never on a
        command line).
        """
        return self._run(list(argv), workdir=workdir, stdin=stdin, limits=limits, script=None,
                         read_only_paths=read_only_paths, env=env)

    def start(
        self,
        argv: Sequence[str],
        *,
        limits: SandboxLimits | None = None,
        read_only_paths: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> SandboxedProcess:
        """Start `argv` in a fresh sandbox as a live process with pipes to its stdin and stdout.

        The same sandbox as `run` (namespaces, no network, uid 65534, rlimits, seccomp, a fresh
        /sandbox tmpfs), for a command that talks with the caller while it runs (e.g. an MCP
        server over stdio). The wall clock (`limits.wall_seconds`) is enforced by the returned
        process's watcher thread; close it (or use it as a context manager) to kill what is left
        and release its descriptors. Output caps are the caller's: it reads stdout itself.
        """
        argv = _checked_argv(argv)
        read_only_paths = _checked_paths(read_only_paths)
        env = _checked_env(env)
        limits = limits or self.limits
        fds: list[int] = []
        try:
            launch = self._launch(argv, None, limits, None, fds, read_only_paths=read_only_paths, env=env)
            started = time.monotonic()
            popen = subprocess.Popen(  # noqa: S603 - argv is built by _command, never through a shell
                launch.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=launch.pass_fds, env={}, cwd="/", start_new_session=True, close_fds=True,
            )
        except BaseException:
            _close_all(fds)
            raise
        # The child holds its own copies now; only the status pipe's read end stays with the parent.
        fds.remove(launch.status_r)
        _close_all(fds)
        return SandboxedProcess(popen, status_fd=launch.status_r, argv=tuple(argv),
                                wall_seconds=limits.wall_seconds, started=started, cpu_seconds=limits.cpu_seconds,
                                namespace_hops=2 if self._as_root else 1)

    # -- internals -------------------------------------------------------------------------------

    def _run(
        self,
        argv: list[str],
        *,
        workdir: Path | None,
        stdin: bytes | None,
        limits: SandboxLimits | None,
        script: bytes | None,
        read_only_paths: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> SandboxResult:
        argv = _checked_argv(argv)
        read_only_paths = _checked_paths(read_only_paths)
        env = _checked_env(env)
        limits = limits or self.limits
        work: Path | None = None
        fds: list[int] = []
        if workdir is not None:
            work = self._prepare_workdir(Path(workdir))
        try:
            return self._spawn_and_watch(argv, work, stdin, limits, script, fds,
                                         read_only_paths=read_only_paths, env=env)
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _prepare_workdir(self, workdir: Path) -> Path:
        """Check that uid 65534 can reach `workdir` (bwrap resolves it as that user) and hand it over."""
        if workdir.is_symlink() or not workdir.is_dir():
            raise InvalidSandboxRequest(f"workdir {workdir} must be an existing directory, not a symlink")
        work = workdir.resolve()
        for ancestor in work.parents:
            st = ancestor.stat()
            if not (st.st_mode & 0o001 or (st.st_uid == NOBODY and st.st_mode & 0o100)):
                raise InvalidSandboxRequest(
                    f"workdir {work} is not reachable by uid {NOBODY}: {ancestor} is mode {st.st_mode & 0o777:o}"
                )
        if self._as_root:
            os.chown(work, NOBODY, NOBODY)
        return work

    def _command(self, argv: list[str], work: Path | None, limits: SandboxLimits, data_fds: Mapping[str, int],
                 seccomp_fd: int | None, status_fd: int, *, read_only_paths: Sequence[str] = (),
                 env_args_fd: int | None = None) -> list[str]:
        cmd: list[str] = []
        if self._as_root:
            # A chain of parent-death signals, so a crash of this process cannot leave a sandbox
            # behind: setpriv arms SIGKILL on unshare; unshare arms it on its child; the second
            # setpriv re-arms it after the uid change (which clears it). That child, bwrap, is PID 1
            # of a fresh PID namespace, and when a namespace's PID 1 dies the kernel kills every
            # process in it, nested namespaces included. bwrap's own --die-with-parent is not
            # enough: its setup clears the signal, so a parent dying mid-setup leaves it running.
            cmd += [self._setpriv, "--pdeathsig=KILL", self._unshare, "--pid", "--fork", "--kill-child=SIGKILL"]
            # Drop to 65534 *before* bwrap: then the namespace's uid maps to host uid 65534, not to
            # root, and RLIMIT_NPROC (which root ignores) bounds the sandbox.
            cmd += [self._setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--pdeathsig=KILL"]
        cmd += [
            self._bwrap,
            "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--clearenv",
            "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr",
        ]
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = f"/{top}"
            if os.path.islink(host):
                cmd += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                cmd += ["--ro-bind", host, host]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp"]
        for dest, fd in data_fds.items():
            cmd += ["--perms", "0444", "--ro-bind-data", str(fd), dest]
        for path in _ETC_RO:
            cmd += ["--ro-bind-try", path, path]
        for path in (*self._read_only_paths, *read_only_paths):
            cmd += ["--ro-bind", path, path]
        if work is None:
            cmd += ["--size", str(limits.work_bytes), "--tmpfs", SANDBOX_DIR]
        else:
            cmd += ["--bind", str(work), SANDBOX_DIR]
        cmd += [
            # The root and /dev are bwrap's own tmpfs: read-only, so the only writable places are
            # the size-capped /tmp, /dev/shm and /sandbox.
            "--remount-ro", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",
            "--remount-ro", "/",
            "--chdir", SANDBOX_DIR,
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
            "--setenv", "HOME", SANDBOX_DIR,
            "--setenv", "LANG", "C.UTF-8",
        ]
        if env_args_fd is not None:
            # The command's own variables, as `--setenv NAME VALUE` arguments bwrap reads from a
            # memfd: they may hold secrets, and a command line is readable by every host user.
            cmd += ["--args", str(env_args_fd)]
        cmd += ["--json-status-fd", str(status_fd)]
        if seccomp_fd is not None:
            cmd += ["--seccomp", str(seccomp_fd)]
        cmd += [
            "--", self._prlimit,
            f"--as={limits.memory_bytes}",
            # soft < hard: SIGXCPU at the soft limit names the cause; SIGKILL a second later if ignored.
            f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
            f"--nproc={limits.max_processes}",
            f"--nofile={limits.max_open_files}",
            f"--fsize={limits.max_file_bytes}",
            "--core=0",
            "--", *argv,
        ]
        return cmd

    def _launch(self, argv: list[str], work: Path | None, limits: SandboxLimits, script: bytes | None,
                fds: list[int], *, read_only_paths: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> _Launch:
        """The bwrap command line for `argv` and the descriptors it reads (appended to `fds`, which the
        caller closes once the sandbox is gone), for `run` and `start` alike."""
        data = {"/etc/passwd": _PASSWD.encode(), "/etc/group": _GROUP.encode(), "/etc/hosts": _HOSTS.encode(),
                "/etc/nsswitch.conf": _NSSWITCH.encode()}
        if script is not None:
            data[_SCRIPT_PATH] = script
        data_fds: dict[str, int] = {}
        for dest, content in data.items():
            fd = _memfd("tether-sandbox-data", content)
            fds.append(fd)
            data_fds[dest] = fd
        seccomp_fd = None
        if self._seccomp_program is not None:
            seccomp_fd = _memfd("tether-sandbox-seccomp", self._seccomp_program)
            fds.append(seccomp_fd)
        env_args_fd = None
        if env:
            env_args_fd = _memfd("tether-sandbox-env", b"".join(
                b"--setenv\0" + name.encode() + b"\0" + value.encode() + b"\0" for name, value in env.items()))
            fds.append(env_args_fd)
        status_r, status_w = os.pipe()
        fds.append(status_r)
        fds.append(status_w)
        cmd = self._command(argv, work, limits, data_fds, seccomp_fd, status_w, read_only_paths=read_only_paths,
                            env_args_fd=env_args_fd)
        passed = (*data_fds.values(), *(fd for fd in (seccomp_fd, env_args_fd) if fd is not None), status_w)
        return _Launch(cmd=cmd, pass_fds=passed, status_r=status_r, status_w=status_w)

    def _spawn_and_watch(self, argv: list[str], work: Path | None, stdin: bytes | None, limits: SandboxLimits,
                         script: bytes | None, fds: list[int], *, read_only_paths: Sequence[str] = (),
                         env: Mapping[str, str] | None = None) -> SandboxResult:
        launch = self._launch(argv, work, limits, script, fds, read_only_paths=read_only_paths, env=env)
        status_r, status_w = launch.status_r, launch.status_w
        stdin_fd = _memfd("tether-sandbox-stdin", stdin or b"")
        fds.append(stdin_fd)

        started = time.monotonic()
        proc = subprocess.Popen(  # noqa: S603 - argv is built above, never through a shell
            launch.cmd, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=launch.pass_fds, env={}, cwd="/", start_new_session=True, close_fds=True,
        )
        fds.remove(status_w)
        os.close(status_w)

        out = bytearray()
        err = bytearray()
        status_buf = bytearray()
        truncated = {"out": False, "err": False}
        sel = selectors.DefaultSelector()
        if proc.stdout is None or proc.stderr is None:
            raise SandboxSetupError("subprocess did not provide output pipes", b"")
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        sel.register(status_r, selectors.EVENT_READ, "status")
        deadline = started + limits.wall_seconds
        pid_ns: int | None = None
        peak_tasks = 0
        cpu_ticks: dict[int, int] = {}
        timed_out = False
        output_exceeded = False
        cpu_exceeded = False
        wait_status: int | None = None
        killed = False

        def kill_tree() -> None:
            # The wrapper chain and the outer bwrap share one process group (start_new_session);
            # the outer bwrap is PID 1 of its namespace, so its death takes every sandboxed process.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        try:
            while True:
                now = time.monotonic()
                if wait_status is None:
                    pid, st = os.waitpid(proc.pid, os.WNOHANG)
                    if pid:
                        wait_status = st
                if wait_status is not None and not sel.get_map():
                    break
                if wait_status is not None and now > deadline + 1.0:
                    break  # exited but a pipe stays open (cannot happen once the namespace is gone): stop
                if not killed and now >= deadline:
                    timed_out = True
                    killed = True
                    kill_tree()
                if pid_ns is None and json_documents(bytes(status_buf)):
                    # bwrap has forked the sandbox's init: the wrapper chain is stable now.
                    pid_ns = sandbox_pid_namespace(proc.pid, hops=2 if self._as_root else 1)
                if pid_ns is not None and wait_status is None:
                    peak_tasks = max(peak_tasks, sample_namespace(pid_ns, cpu_ticks))
                    # RLIMIT_CPU bounds each process alone (every fork gets its own allowance):
                    # the sandbox's limit is on the CPU of all its processes together.
                    if not killed and sum(cpu_ticks.values()) / CLK_TCK >= limits.cpu_seconds:
                        cpu_exceeded = True
                        killed = True
                        kill_tree()
                for key, _ in sel.select(timeout=TICK_S):
                    stream = key.data
                    fileobj = key.fileobj
                    fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
                    try:
                        chunk = os.read(fd, _READ_CHUNK)
                    except OSError as exc:
                        if exc.errno != errno.EINTR:
                            raise
                        continue
                    if not chunk:
                        sel.unregister(fileobj)
                        continue
                    if stream == "status":
                        status_buf += chunk
                        continue
                    buf = out if stream == "out" else err
                    room = limits.max_output_bytes - len(buf)
                    if len(chunk) > room:
                        buf += chunk[:max(room, 0)]
                        truncated[stream] = True
                        if not killed:
                            output_exceeded = True
                            killed = True
                            kill_tree()
                    else:
                        buf += chunk
        finally:
            if wait_status is None:
                kill_tree()
                _, wait_status = os.waitpid(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)  # Popen must not wait again
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
        duration = time.monotonic() - started

        statuses = json_documents(bytes(status_buf))
        exit_doc = next((d["exit-code"] for d in statuses if "exit-code" in d), None)
        rc = proc.returncode
        exit_code: int | None = None
        sig: int | None = None
        if rc < 0:
            sig = -rc
        elif exit_doc is None:
            raise SandboxSetupError(
                f"bubblewrap exited {rc} before running the command: {bytes(err).decode(errors='replace').strip()}",
                bytes(err),
            )
        elif 128 < exit_doc < 128 + 65:
            # bwrap reports a command killed by signal N as 128+N, as shells do.
            sig = exit_doc - 128
        else:
            exit_code = exit_doc

        # Sampled, not from wait4: bwrap exits without reaping the namespace's init, so rusage misses it.
        cpu = sum(cpu_ticks.values()) / CLK_TCK
        limit_hit, error_code = _classify(
            limits=limits, exit_code=exit_code, sig=sig, timed_out=timed_out, output_exceeded=output_exceeded,
            cpu_exceeded=cpu_exceeded, cpu=cpu, peak_tasks=peak_tasks, stderr=bytes(err),
        )
        return SandboxResult(
            exit_code=exit_code, killed_by_signal=sig, timed_out=timed_out,
            stdout=bytes(out), stderr=bytes(err),
            stdout_truncated=truncated["out"], stderr_truncated=truncated["err"],
            error_code=error_code, limit_hit=limit_hit, duration_seconds=duration, cpu_seconds=cpu,
            peak_tasks=peak_tasks, argv=tuple(argv),
        )


def _classify(*, limits: SandboxLimits, exit_code: int | None, sig: int | None, timed_out: bool,
              output_exceeded: bool, cpu_exceeded: bool, cpu: float, peak_tasks: int,
              stderr: bytes) -> tuple[str | None, SandboxErrorCode | None]:
    """Name the limit that ended the command, most specific cause first.

    Stderr text is only a hint: a command that exited by itself, even non-zero, keeps
    NONZERO_EXIT (its output is a result) with the pattern in `limit_hit`. Only a command a
    signal ended, or one the parent saw reach a limit, is reported as having hit it.
    """
    if output_exceeded:
        return "output", SandboxErrorCode.OUTPUT_LIMIT
    if cpu_exceeded or sig == signal.SIGXCPU or (sig == signal.SIGKILL and not timed_out and cpu >= limits.cpu_seconds):
        return "cpu", SandboxErrorCode.CPU_LIMIT
    if sig == signal.SIGXFSZ:
        return "file_size", SandboxErrorCode.OUTPUT_LIMIT
    tasks_at_limit = peak_tasks >= limits.max_processes
    memory_said = bool(_MEMORY_PATTERNS.search(stderr))
    fork_said = bool(_FORK_PATTERNS.search(stderr))
    hint = "memory" if memory_said else "processes" if tasks_at_limit or fork_said else None
    if not (timed_out or sig is not None or exit_code != 0):
        return hint, None
    if tasks_at_limit:
        return "processes", SandboxErrorCode.PROCESS_LIMIT
    if timed_out:
        return "wall", SandboxErrorCode.TIMEOUT
    if sig is not None:
        if memory_said:
            return "memory", SandboxErrorCode.MEMORY_LIMIT
        if fork_said:
            return "processes", SandboxErrorCode.PROCESS_LIMIT
        return None, SandboxErrorCode.SIGNALED
    return hint, SandboxErrorCode.NONZERO_EXIT
