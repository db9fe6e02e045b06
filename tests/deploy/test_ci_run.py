""".ci/run bounds `make test` in time, keeps its exit code and still runs `make down` in CI.

.ci/run is copied into a throwaway repo whose Makefile stands in for the real one (a `test` that
hangs or fails, a `down` that leaves a mark): the real `make test` is the whole suite."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tether_testing.stack import find_repo_root

REPO = find_repo_root(Path(__file__).resolve().parent)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ci_repo(tmp_path: Path, test_recipe: str) -> Path:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy2(REPO / ".ci" / "run", repo / ".ci" / "run")
    (repo / "Makefile").write_text(
        "SHELL := /bin/bash\n"
        "test:\n"
        '\t@echo "$$PYTEST_ARGS" > pytest-args\n'
        f"\t{test_recipe}\n"
        "down:\n"
        "\t@touch down-ran\n")
    return repo


def _ci_run(repo: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(repo / ".ci" / "run")], env={**os.environ, "CI": "true", **env},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def test_a_hung_make_test_is_ended_at_the_limit_and_the_stack_still_comes_down(tmp_path):
    repo = _ci_repo(tmp_path, "@sleep 600 & echo $$! > hung-pid; wait")
    done = _ci_run(repo, TETHER_CI_TIMEOUT="3")
    assert done.returncode == 124, done.stderr
    assert (repo / "down-ran").exists()
    assert not _alive(int((repo / "hung-pid").read_text()))


def test_make_tests_exit_code_is_kept_and_pytest_gets_a_session_timeout(tmp_path):
    repo = _ci_repo(tmp_path, "@exit 3")
    done = _ci_run(repo, TETHER_CI_TIMEOUT="1000", PYTEST_ARGS="-k smoke")
    assert done.returncode == 2  # make's code for a failed recipe
    assert (repo / "down-ran").exists()
    assert (repo / "pytest-args").read_text().split() == ["--session-timeout=100", "-k", "smoke"]


def test_the_locked_pytest_timeout_knows_the_session_timeout(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    done = subprocess.run([str(REPO / ".venv" / "bin" / "pytest"), "-q", "-p", "no:cacheprovider",
                           "--session-timeout=4100", str(tmp_path / "test_one.py")],
                          cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
