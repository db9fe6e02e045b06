"""The tree passes the linter with the rules in pyproject.toml ([tool.ruff]), so `make test` fails on
a finding: unused imports and names, likely bugs (bugbear), import order, old idioms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"ruff check (fix with `.venv/bin/ruff check --fix`):\n{done.stdout}{done.stderr}"
