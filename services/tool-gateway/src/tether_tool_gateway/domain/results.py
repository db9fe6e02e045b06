"""Where a tool result goes: inline in the event, to the blob store (claim check), or refused as oversized."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Placement(StrEnum):
    INLINE = "INLINE"
    BLOB = "BLOB"
    OVERSIZED = "OVERSIZED"


@dataclass(frozen=True)
class ResultLimits:
    """Size limits of a result's canonical JSON, in UTF-8 bytes."""

    inline_max_bytes: int = 64 * 1024
    max_bytes: int = 8 * 1024 * 1024

    def place(self, size: int) -> Placement:
        if size > self.max_bytes:
            return Placement.OVERSIZED
        if size > self.inline_max_bytes:
            return Placement.BLOB
        return Placement.INLINE
