"""deploy/local/stack.py's PostgreSQL cluster survives an initdb cut short: the next `up` starts over,
and a half-made data dir from an older stack.py is refused with the command that recovers it.

Each test runs its own cluster (throwaway state dir, a free port), never the dev stack's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tether_testing.processes import free_port
from tether_testing.stack import find_repo_root

pytestmark = pytest.mark.integration

REPO = find_repo_root(Path(__file__).resolve().parent)
SCRIPT = REPO / "deploy" / "local" / "stack.py"
PG_BINDIR = max(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name))


class PgStack:
    """stack.py for the postgres component alone, with its own state dir and port."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.env = {**os.environ, "TETHER_STATE_DIR": str(state_dir), "TETHER_PG_PORT": str(self.port)}

    def run(self, command: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), command, "postgres", *flags], env={**self.env, **env},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)

    def data_dir(self) -> Path:
        done = self.run("status", "--json")
        assert done.returncode == 0, done.stderr
        return Path(json.loads(done.stdout)["postgres"]["data_dir"])

    def query(self, sql: str) -> str:
        done = subprocess.run([str(PG_BINDIR / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "tether",
                               "-d", "tether", "-tAc", sql], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()


def _world_traversable_dir(prefix: str) -> Path:
    # The server runs as the `postgres` user when the tests run as root: it must reach these paths.
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    return path


@pytest.fixture
def pg_stack():
    stack = PgStack(_world_traversable_dir("tether-pg-state-"))
    yield stack
    stack.run("purge")  # stops the server if it runs and deletes the cluster wherever it lives
    shutil.rmtree(stack.state_dir, ignore_errors=True)


@pytest.fixture
def initdb_killed_midway():
    """A TETHER_PG_BINDIR whose initdb is the real one, SIGKILLed once it has written PG_VERSION
    (what a power cut, an OOM kill or a CI job's `kill -9` leaves behind)."""
    bindir = _world_traversable_dir("tether-pg-bin-")
    for tool in ("postgres", "pg_isready", "psql"):
        (bindir / tool).symlink_to(PG_BINDIR / tool)
    initdb = bindir / "initdb"
    initdb.write_text(
        "#!/bin/sh\n"
        f'"{PG_BINDIR / "initdb"}" "$@" &\n'
        "real=$!\n"
        # stack.py calls initdb -D <dir> ...
        'while [ ! -e "$2/PG_VERSION" ]; do kill -0 "$real" 2>/dev/null || exit 1; sleep 0.01; done\n'
        'kill -9 "$real"\n'
        "kill -9 $$\n")
    initdb.chmod(0o755)
    yield bindir
    shutil.rmtree(bindir, ignore_errors=True)


def test_an_initdb_killed_midway_is_redone_on_the_next_up(pg_stack, initdb_killed_midway):
    cut = pg_stack.run("up", TETHER_PG_BINDIR=str(initdb_killed_midway))
    assert cut.returncode == 1 and "initdb" in cut.stderr, cut.stderr

    again = pg_stack.run("up")
    assert again.returncode == 0, again.stderr
    assert pg_stack.query("SELECT current_user") == "tether"
    data = pg_stack.data_dir()
    assert "Written by deploy/local/stack.py" in (data / "pg_hba.conf").read_text()
    assert not (data.parent / "data.partial").exists()


def test_a_half_made_data_dir_from_an_older_stack_is_refused_with_the_way_out(pg_stack):
    # An older stack.py ran initdb straight into data/; killed midway, it left PG_VERSION and no cluster.
    data = pg_stack.data_dir()
    data.mkdir(parents=True)
    (data / "PG_VERSION").write_text("15\n")

    refused = pg_stack.run("up")
    assert refused.returncode == 1
    assert f"{data} is not a complete cluster" in refused.stderr and "purge postgres" in refused.stderr, \
        refused.stderr

    assert pg_stack.run("purge").returncode == 0
    started = pg_stack.run("up")
    assert started.returncode == 0, started.stderr
    assert pg_stack.query("SELECT current_user") == "tether"
