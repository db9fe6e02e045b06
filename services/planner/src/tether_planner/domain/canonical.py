"""The run protocol's ids and canonical forms (docs/architecture.md): call ids, idempotency keys, args hashes."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, UTF-8 kept: the one JSON form that is hashed and approved."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def args_hash(args_json: str) -> str:
    """Lowercase hex SHA-256 of the canonical arguments; approvals are bound to it."""
    return hashlib.sha256(args_json.encode()).hexdigest()


def call_id(step: int, call_index: int) -> str:
    return f"{step}.{call_index}"


def idem_key(run_id: str, step: int, call_index: int) -> str:
    """H(run_id, step, call_index): the idempotency key of the call's side effect."""
    return hashlib.sha256(f"{run_id}\x1f{step}\x1f{call_index}".encode()).hexdigest()
