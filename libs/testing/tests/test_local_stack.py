"""deploy/local/stack.py on alternative ports and a throwaway state dir (never the dev stack), and the
fixtures' fallback to it: up starts, up again is a no-op, status reports, a foreign port is named, down stops."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tether_testing.processes import free_port
from tether_testing.stack import REDIS, LocalStack, StackUnavailable, answers, find_repo_root

pytestmark = pytest.mark.integration

REPO = find_repo_root(Path(__file__).resolve().parent)
SCRIPT = REPO / "deploy" / "local" / "stack.py"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


class Stack:
    """Runs deploy/local/stack.py with one state dir and one set of ports."""

    def __init__(self, state_dir: Path, **ports: int) -> None:
        self.env = {
            **os.environ,
            "TETHER_STATE_DIR": str(state_dir),
            **{f"TETHER_{key.upper()}_PORT": str(port) for key, port in ports.items()},
        }

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), *args], env=self.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)

    def json(self, *args: str) -> dict:
        done = self.run(*args, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@pytest.fixture
def listener():
    """A foreign process's listening socket on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def alt_stack(tmp_path_factory):
    ports = {"kafka": free_port(), "kafka_controller": free_port(), "pg": free_port(), "redis": free_port()}
    stack = Stack(tmp_path_factory.mktemp("state"), **ports)
    stack.ports = ports
    yield stack
    # Stops whatever is still up and removes the state (PostgreSQL may have moved to /var/tmp).
    stack.run("purge")


def test_up_status_down_on_alternative_ports(alt_stack):
    assert alt_stack.run("fetch-kafka").returncode == 0

    first = alt_stack.json("up")
    assert {name: res["started"] for name, res in first.items()} == {"kafka": True, "postgres": True, "redis": True}
    assert first["kafka"]["address"] == f"127.0.0.1:{alt_stack.ports['kafka']}"
    topics = AdminClient({"bootstrap.servers": first["kafka"]["address"]}).list_topics(timeout=30).topics
    assert isinstance(topics, dict)

    second = alt_stack.json("up")
    assert {name: (res["started"], res["pid"]) for name, res in second.items()} == {
        name: (False, res["pid"]) for name, res in first.items()}

    status = alt_stack.json("status")
    assert {name: (info["state"], info["answers"]) for name, info in status.items()} == {
        "kafka": ("running", True), "postgres": ("running", True), "redis": ("running", True)}
    text = alt_stack.run("status").stdout
    assert f"127.0.0.1:{alt_stack.ports['pg']}" in text and str(first["postgres"]["pid"]) in text

    down = alt_stack.json("down")
    assert {name: res["stopped"] for name, res in down.items()} == {"kafka": True, "postgres": True, "redis": True}
    assert not any(_pid_alive(res["pid"]) for res in first.values())
    assert {info["state"] for info in alt_stack.json("status").values()} == {"stopped"}
    assert answers(REDIS, f"redis://127.0.0.1:{alt_stack.ports['redis']}/0") is not None  # a reason: no answer


def test_a_port_held_by_someone_else_is_named_and_fails(tmp_path, listener):
    stack = Stack(tmp_path / "state", redis=listener)
    done = stack.run("up", "redis")
    assert done.returncode == 3
    assert f"port {listener}" in done.stderr and "TETHER_REDIS_PORT" in done.stderr
    assert f"pid {os.getpid()}" in done.stderr  # the holder is found, here: this test process
    assert "not ours" in stack.run("status", "redis").stdout


def test_fixture_stack_starts_only_what_is_missing_and_stops_only_that(alt_stack):
    env = alt_stack.env
    assert alt_stack.json("up", "redis")["redis"]["started"]
    redis_pid = alt_stack.json("status", "redis")["redis"]["pid"]

    stack = LocalStack(REPO, {k: v for k, v in env.items() if not k.endswith(("_BOOTSTRAP", "_DSN", "_URL"))})
    assert stack.redis() == f"redis://127.0.0.1:{alt_stack.ports['redis']}/0"
    dsn = stack.postgres()
    assert dsn == f"postgresql://tether@127.0.0.1:{alt_stack.ports['pg']}/tether"
    assert stack.started == ["postgres"]

    stack.close()
    status = alt_stack.json("status", "postgres", "redis")
    assert (status["postgres"]["state"], status["redis"]["state"], status["redis"]["pid"]) == (
        "stopped", "running", redis_pid)


def test_fixture_stack_explains_an_unreachable_remote_address(tmp_path):
    stack = LocalStack(REPO, {"TETHER_STATE_DIR": str(tmp_path), "TETHER_REDIS_URL": "redis://192.0.2.1:6379/0"})
    with pytest.raises(StackUnavailable, match="is not on this machine"):
        stack.redis()
    assert stack.started == []


def test_fixture_stack_reports_why_the_local_stack_could_not_start(tmp_path, listener):
    stack = LocalStack(REPO, {**os.environ, "TETHER_STATE_DIR": str(tmp_path),
                              "TETHER_REDIS_URL": f"redis://127.0.0.1:{listener}/0"})
    with pytest.raises(StackUnavailable, match=f"port {listener} .* is in use"):
        stack.redis()


def test_a_fixture_that_cannot_get_its_service_errors_the_test_instead_of_skipping(tmp_path):
    (tmp_path / "test_needs_redis.py").write_text(textwrap.dedent("""
        def test_needs_redis(redis_url):
            pass
    """))
    env = {**os.environ, "TETHER_STATE_DIR": str(tmp_path / "state"), "TETHER_REDIS_URL": "redis://192.0.2.1:6379/0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tether_testing.plugin", "-q", "-rA", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_needs_redis.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout
    assert "1 error" in done.stdout and "skipped" not in done.stdout
    assert "Redis is unavailable" in done.stdout and "192.0.2.1" in done.stdout
