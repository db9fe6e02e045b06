"""The run protocol's ids and canonical forms (docs/architecture.md): call ids, idempotency keys, args hashes."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


def canonical_json(value: Any) -> str:
    """Sorted keys, no whitespace, UTF-8 kept: the one JSON form that is hashed and approved.

    Standard JSON only: NaN and infinities (which `json` would write as NaN/Infinity, text no other
    JSON parser, the gateway's schema checks or an approver's tooling reads the same) raise ValueError.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class NonStandardJson(ValueError):
    """JSON text with NaN, Infinity or a number too large for a double (1e999)."""


def _no_constant(name: str) -> Any:
    raise NonStandardJson(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonStandardJson(f"the number {text[:40]} is out of range")
    return value


def loads_standard(text: str) -> Any:
    """Parse JSON text, refusing what `json` accepts beyond the standard: NaN, Infinity, -Infinity
    and numbers that overflow to an infinity (NonStandardJson, a ValueError)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def args_hash(args_json: str) -> str:
    """Lowercase hex SHA-256 of the canonical arguments; approvals are bound to it."""
    return hashlib.sha256(args_json.encode()).hexdigest()


def call_id(step: int, call_index: int) -> str:
    return f"{step}.{call_index}"


def idem_key(run_id: str, step: int, call_index: int) -> str:
    """H(run_id, step, call_index): the idempotency key of the call's side effect."""
    return hashlib.sha256(f"{run_id}\x1f{step}\x1f{call_index}".encode()).hexdigest()
