"""Canonical JSON and hashes: the same bytes for the same value on every instance and replay."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    """JSON with sorted keys, no whitespace, UTF-8 kept, and no NaN/Infinity (they are not JSON).

    Raises TypeError or ValueError for a value JSON cannot represent.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_hex(text: str | bytes) -> str:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def idem_key_for(run_id: str, step: int, call_index: int) -> str:
    """The run protocol's idempotency key of a call: sha256(run_id ␟ step ␟ call_index) hex."""
    return sha256_hex(f"{run_id}\x1f{step}\x1f{call_index}")
