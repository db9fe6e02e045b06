"""Unique names for topics, consumer groups, transactional ids and schemas shared by parallel test runs."""

from __future__ import annotations

import uuid


def unique_name(prefix: str, sep: str = "-") -> str:
    """`prefix` plus a random 12-hex suffix, so parallel runs against one stack never collide.

    Use `sep="_"` where hyphens are not allowed (PostgreSQL identifiers).
    """
    return f"{prefix}{sep}{uuid.uuid4().hex[:12]}"
