"""The run state's byte bound, kept for the checkpoint written after every record the planner handles.

A step compacts the working context when it starts, but the state grows between two starts: the
step's answer and repairs, then its tool results, each checkpointed by the record that brings it.
So every put is fitted here: a running estimate (the size last measured plus the raw JSON of the
messages added since) costs only the new messages; the exact size (the state encoded and
compressed as the codec does) is measured only when the estimate passes the bound, and then the
context is compacted as at a step's start: keep the configured turns, then fewer, then none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from pydantic import TypeAdapter

from tether_planner.domain.compaction import compact
from tether_planner.domain.messages import ChatMessage
from tether_planner.domain.state import RunState
from tether_planner.statecodec import checkpoint_size

log = structlog.get_logger("tether_planner.checkpoint")

_MESSAGE = TypeAdapter(ChatMessage)
#: Room for the state's small fields that change without a new message (last_seq, pending, usage).
_FIELDS_SLACK = 512
#: JSON punctuation around one message in the list.
_PER_MESSAGE = 16
#: Room kept per call still awaiting its result: the smallest form of a result (its envelope
#: around a one-character excerpt) takes well under this in a checkpoint.
RESULT_RESERVE = 256


@dataclass(frozen=True)
class StateBound:
    """The bound and how the context is compacted to meet it (from StepConfig)."""

    max_bytes: int
    keep_turns: int
    emergency_keep_turns: int
    summary_max_chars: int

    @property
    def limit(self) -> int:
        """What a measured state may take: `max_bytes` less room for its small fields to change."""
        return self.max_bytes - _FIELDS_SLACK


@dataclass(frozen=True)
class Fitted:
    messages: list[ChatMessage]
    #: The checkpoint's size with these messages, as `size_of` measured it.
    size: int
    compacted: bool


def compact_to_fit(
    messages: Sequence[ChatMessage],
    size_of: Callable[[Sequence[ChatMessage]], int],
    *,
    max_bytes: int,
    keep_turns: int,
    emergency_keep_turns: int,
    summary_max_chars: int,
    keep_at_least: int = 0,
    **log_fields: object,
) -> Fitted:
    """Keep fewer turns verbatim (the configured number, then the emergency one, then none, never
    fewer than `keep_at_least`) until the checkpoint fits. Turns with a call still awaiting its
    result are never summarised, so it may still be over `max_bytes` (the caller decides what then)."""
    working = list(messages)
    compacted = False
    size = size_of(working)
    for keep in (keep_turns, emergency_keep_turns, 0):
        keep = max(keep, keep_at_least)
        if size <= max_bytes:
            break
        c = compact(working, keep_turns=keep, summary_max_chars=summary_max_chars)
        if c is not None:
            working = c.apply(working)
            compacted = True
            log.info("state_compacted", state_bytes=size, keep_turns=keep, replaced=c.replaced, **log_fields)
            size = size_of(working)
    return Fitted(working, size, compacted)


def measure(state: RunState, max_bytes: int) -> int:
    """The state's checkpoint size: exact when it may pass `max_bytes`, else the raw upper bound."""
    return checkpoint_size(state.model_dump_json().encode(), budget=max_bytes)


def grown_bytes(before: Sequence[ChatMessage], after: Sequence[ChatMessage]) -> int:
    """An upper bound on what `after` adds to a checkpoint of `before`: the raw JSON of each message
    not at the same place in `before` (zlib adds at most ~0.03% to incompressible input)."""
    n = 0
    for i, m in enumerate(after):
        if i < len(before) and before[i] is m:
            continue
        raw = len(_MESSAGE.dump_json(m))
        n += raw + (raw >> 12) + (raw >> 14) + _PER_MESSAGE
    return n


def limit(bound: StateBound, awaiting: int) -> int:
    """What the state may take now, with room kept for `awaiting` tool results still to come."""
    return bound.limit - awaiting * RESULT_RESERVE


def fit(
    before: RunState | None,
    after: RunState,
    bound: StateBound,
    *,
    may_compact: bool,
    run_id: str,
    awaiting: int = 0,
    keep_at_least: int = 0,
) -> RunState:
    """`after` (a state derived from `before`) with its checkpoint under the bound (less the room
    for `awaiting` results) where compaction can do it, and `checkpoint_bound` set for the next
    record's estimate; over `limit(bound, awaiting)` when compaction could not do it.

    `may_compact` is False while a step's model work runs on a snapshot of the messages: the
    step's outcome replaces that prefix (`state.finish_step`), so it must not change meanwhile.
    """
    room = limit(bound, awaiting)
    if before is not None and before.checkpoint_bound:
        estimate = before.checkpoint_bound + grown_bytes(before.messages, after.messages)
        if estimate <= room:
            return after.model_copy(update={"checkpoint_bound": estimate})
    size = measure(after, room)
    if size > room and may_compact:
        fitted = compact_to_fit(
            after.messages,
            lambda messages: measure(after.model_copy(update={"messages": list(messages)}), room),
            max_bytes=room,
            keep_turns=bound.keep_turns,
            emergency_keep_turns=bound.emergency_keep_turns,
            summary_max_chars=bound.summary_max_chars,
            keep_at_least=keep_at_least,
            run_id=run_id,
        )
        after, size = after.model_copy(update={"messages": fitted.messages}), fitted.size
    return after.model_copy(update={"checkpoint_bound": size})
