"""The planner's changelog codec: the run state as zlib-compressed JSON.

A working context is mostly text (tool results, summaries) and can approach the context
window in size; compressed, a checkpoint stays well under Kafka's default 1 MB record limit.
"""

from __future__ import annotations

import zlib

from tether_planner.domain.state import RunState

_MAGIC = b"TPZ1"


class RunStateCodec:
    """Encodes RunState for the `planner` changelog (private to the planner)."""

    def encode(self, state: RunState) -> bytes:
        return _MAGIC + zlib.compress(state.model_dump_json().encode(), 6)

    def decode(self, data: bytes) -> RunState:
        if data.startswith(_MAGIC):
            data = zlib.decompress(data[len(_MAGIC) :])
        # Plain JSON is accepted too (checkpoints written before compression was introduced).
        return RunState.model_validate_json(data)
