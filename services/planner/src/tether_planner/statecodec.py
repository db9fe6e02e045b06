"""The planner's changelog codec: the run state as zlib-compressed JSON.

A working context is mostly text (tool results, summaries) and can approach the context
window in size, which for a 1M-token model is megabytes even compressed: more than Kafka's
default 1,000,000-byte record limit, and a checkpoint that cannot be produced makes its input a
poison record (dead-lettered: the run's step is lost). So the planner also compacts on the
checkpoint's size (`checkpoint_size`, against TETHER_PLANNER_STATE_MAX_BYTES), whatever the window,
at the start of a step and after every record (tether_planner.checkpoint).
"""

from __future__ import annotations

import zlib

from tether_planner.domain.state import RunState

_MAGIC = b"TPZ1"
_LEVEL = 6


def checkpoint_size(data: bytes, *, budget: int) -> int:
    """Bytes that `data` (the state's JSON) takes as a checkpoint, exact when it may exceed
    `budget`; below, compressing is skipped and the raw length (an upper bound) returned."""
    # zlib never grows its input by more than ~0.03% plus a few bytes (compressBound).
    bound = len(_MAGIC) + len(data) + (len(data) >> 12) + (len(data) >> 14) + 64
    if bound <= budget:
        return bound
    return len(_MAGIC) + len(zlib.compress(data, _LEVEL))


class RunStateCodec:
    """Encodes RunState for the `planner` changelog (private to the planner)."""

    def encode(self, state: RunState) -> bytes:
        return _MAGIC + zlib.compress(state.model_dump_json().encode(), _LEVEL)

    def decode(self, data: bytes) -> RunState:
        if data.startswith(_MAGIC):
            data = zlib.decompress(data[len(_MAGIC) :])
        # Plain JSON is accepted too (checkpoints written before compression was introduced).
        return RunState.model_validate_json(data)
