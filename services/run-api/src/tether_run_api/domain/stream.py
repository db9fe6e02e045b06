"""The order of a resumable event stream: each seq exactly once, ascending, from where the client asked."""

from __future__ import annotations

from enum import Enum

from tether_run_api.domain.views import EventView


class Offer(str, Enum):
    """What to do with an event offered by catch-up or the live feed."""

    SEEN = "SEEN"  # at or below what was already sent (catch-up/live overlap, or a replayed entry): drop
    NEXT = "NEXT"  # exactly the next seq: send
    AHEAD = "AHEAD"  # later than the next seq: the events in between must be fetched first


class SeqGate:
    """Tracks the next seq a stream owes its client; seqs of a run are 1, 2, 3, ... without gaps."""

    def __init__(self, from_seq: int) -> None:
        self.next_seq = max(1, from_seq)
        self.done = False  # the terminal event was sent (late facts stored after it may still follow)

    def offer(self, seq: int) -> Offer:
        """Classify an offered seq against what was already sent."""
        if seq < self.next_seq:
            return Offer.SEEN
        if seq == self.next_seq:
            return Offer.NEXT
        return Offer.AHEAD

    def sent(self, event: EventView) -> None:
        """Record that `event` (which must be NEXT) went to the client."""
        if event.seq != self.next_seq:
            raise ValueError(f"sent seq {event.seq} but the stream owed seq {self.next_seq}")
        self.next_seq = event.seq + 1
        if event.terminal:
            self.done = True
