"""Client text the run-api stores: PostgreSQL text and jsonb cannot hold U+0000, though proto3 strings may."""

from __future__ import annotations

from tether_run_api.domain.errors import FieldViolation

NUL = "\x00"
NUL_PROBLEM = "must not contain the NUL character (U+0000)"


def check_no_nul(value: str, path: str) -> list[FieldViolation]:
    """A violation if `value` holds U+0000, which no text column (nor a jsonb payload downstream) can store."""
    if NUL in value:
        return [FieldViolation(path, NUL_PROBLEM)]
    return []


def json_has_nul(value: object) -> bool:
    """Whether a parsed JSON value has U+0000 in any string or object key (JSON spells it \\u0000)."""
    if isinstance(value, str):
        return NUL in value
    if isinstance(value, dict):
        return any(NUL in k or json_has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(json_has_nul(v) for v in value)
    return False
