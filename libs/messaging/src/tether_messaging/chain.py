"""The run event log's hash chain: sealing envelopes with seq/prev_hash/hash and verifying a log.

Each sequenced envelope carries

    hash = sha256(F(prev_hash) F(event_id) F(tenant_id) F(run_id) F(seq) F(event_type)
                  F(schema_fingerprint) F(recorded_at_ms) F(producer) F(payload))

where F(b) = 8-byte big-endian len(b) followed by b (length-prefixing makes the field
boundaries unambiguous). Text fields are UTF-8; `seq` and `recorded_at_ms` are their decimal
ASCII digits; `prev_hash` is its 64 lowercase hex characters; `payload` is the payload's raw
single-object bytes. The `prev_hash` of seq 1 is 64 zeros (`GENESIS_HASH`). `causation_id`
and `traceparent` are routing metadata and are not covered.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from tether_contracts.records import Envelope

GENESIS_HASH = "0" * 64

_HEX64 = re.compile(r"[0-9a-f]{64}")


class ChainError(Exception):
    """An envelope cannot be sealed or hashed (missing or malformed chain fields)."""


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def _digest(envelope: Envelope, seq: int, prev_hash: str) -> str:
    parts = (
        # UTF-8, not ASCII: the same bytes for a well-formed (hex) prev_hash, and a malformed
        # one read from the log hashes (to a mismatch) instead of raising.
        prev_hash.encode(),
        envelope.event_id.encode(),
        envelope.tenant_id.encode(),
        envelope.run_id.encode(),
        str(seq).encode("ascii"),
        envelope.event_type.encode(),
        envelope.schema_fingerprint.encode(),
        str(envelope.recorded_at_ms).encode("ascii"),
        envelope.producer.encode(),
        bytes(envelope.payload),
    )
    h = hashlib.sha256()
    for part in parts:
        h.update(_field(part))
    return h.hexdigest()


def event_hash(envelope: Envelope) -> str:
    """The hash a sealed envelope must carry, recomputed from its content, seq and prev_hash."""
    if envelope.seq is None or envelope.prev_hash is None:
        raise ChainError(f"event {envelope.event_id} is not sequenced (seq/prev_hash missing)")
    return _digest(envelope, envelope.seq, envelope.prev_hash)


def seal(envelope: Envelope, seq: int, prev_hash: str) -> Envelope:
    """A copy of `envelope` appended to its run's chain at `seq` after the event hashed `prev_hash`."""
    if seq < 1:
        raise ChainError(f"seq must be >= 1, got {seq}")
    if not _HEX64.fullmatch(prev_hash):
        raise ChainError(f"prev_hash must be 64 lowercase hex characters, got {prev_hash!r}")
    if seq == 1 and prev_hash != GENESIS_HASH:
        raise ChainError("the first event of a run must follow the genesis hash (64 zeros)")
    return envelope.model_copy(
        update={"seq": seq, "prev_hash": prev_hash, "hash": _digest(envelope, seq, prev_hash)}
    )


class ProblemKind(str, Enum):
    """What is wrong with a place in a run's chain."""

    UNSEALED = "UNSEALED"  # seq, prev_hash or hash missing
    HASH_MISMATCH = "HASH_MISMATCH"  # content does not match its hash, or seq/prev_hash/hash malformed: altered
    PREV_HASH_MISMATCH = "PREV_HASH_MISMATCH"  # does not follow the previous event's hash
    GAP = "GAP"  # one or more seqs are missing before this event
    DUPLICATE_SEQ = "DUPLICATE_SEQ"  # this seq was already seen for the run
    DUPLICATE_EVENT = "DUPLICATE_EVENT"  # this event_id was already sequenced in the run
    OUT_OF_ORDER = "OUT_OF_ORDER"  # a lower seq after a higher one


@dataclass(frozen=True)
class ChainProblem:
    """One defect found by `verify_chain`, located by run, seq and event id."""

    kind: ProblemKind
    run_id: str
    seq: int | None
    event_id: str
    detail: str


@dataclass
class _RunCursor:
    last_seq: int
    last_hash: str
    seqs: set[int] = field(default_factory=set)
    event_ids: set[str] = field(default_factory=set)


def verify_chain(envelopes: Iterable[Envelope], *, from_genesis: bool = True) -> list[ChainProblem]:
    """Check the run event log's chains, in log order; returns every problem found (empty = intact).

    Envelopes of several runs may be interleaved; each run's chain is checked on its own.
    With `from_genesis=False` the first envelope seen of each run is trusted as the anchor
    (for verifying a slice of the log). A chain cut off at its end cannot be detected from the
    log alone; compare the last seq/hash with an independently kept anchor for that.
    """
    problems: list[ChainProblem] = []
    cursors: dict[str, _RunCursor] = {}
    for env in envelopes:
        run, seq = env.run_id, env.seq

        def report(kind: ProblemKind, detail: str) -> None:
            problems.append(ChainProblem(kind, run, seq, env.event_id, detail))  # noqa: B023 (called in this iteration only)

        if env.seq is None or env.prev_hash is None or env.hash is None:
            report(ProblemKind.UNSEALED, "seq, prev_hash or hash is missing")
            continue
        if env.seq < 1:
            report(ProblemKind.HASH_MISMATCH, f"malformed: seq {env.seq} is not >= 1")
            continue
        malformed = [f"{name} {value!r} is not 64 lowercase hex characters"
                     for name, value in (("prev_hash", env.prev_hash), ("hash", env.hash))
                     if not _HEX64.fullmatch(value)]
        if malformed:
            # Not a hash the chain could have produced (seal refuses it): reported, not hashed.
            report(ProblemKind.HASH_MISMATCH, "malformed: " + "; ".join(malformed))
        else:
            recomputed = event_hash(env)
            if recomputed != env.hash:
                report(ProblemKind.HASH_MISMATCH, f"content hashes to {recomputed}, event says {env.hash}")

        cursor = cursors.get(run)
        if cursor is None:
            cursor = cursors[run] = _RunCursor(last_seq=0, last_hash=GENESIS_HASH)
            if not from_genesis:
                # Trust the first event of the slice as the anchor.
                cursor.last_seq, cursor.last_hash = env.seq - 1, env.prev_hash

        if env.event_id in cursor.event_ids:
            report(ProblemKind.DUPLICATE_EVENT, f"event {env.event_id} was already sequenced")
        if env.seq in cursor.seqs:
            report(ProblemKind.DUPLICATE_SEQ, f"seq {env.seq} appears again")
            cursor.event_ids.add(env.event_id)
            continue
        if env.seq <= cursor.last_seq:
            report(ProblemKind.OUT_OF_ORDER, f"seq {env.seq} after seq {cursor.last_seq}")
            cursor.seqs.add(env.seq)
            cursor.event_ids.add(env.event_id)
            continue
        if env.seq > cursor.last_seq + 1:
            first_missing, last_missing = cursor.last_seq + 1, env.seq - 1
            missing = f"{first_missing}" if first_missing == last_missing else f"{first_missing}..{last_missing}"
            report(ProblemKind.GAP, f"seq {missing} missing before seq {env.seq}")
        elif env.prev_hash != cursor.last_hash:
            report(
                ProblemKind.PREV_HASH_MISMATCH,
                f"prev_hash {env.prev_hash} does not match the previous event's hash {cursor.last_hash}",
            )
        # Link on the hash the event carries, so one altered event is reported once, not
        # as a cascade over every later event.
        cursor.last_seq, cursor.last_hash = env.seq, env.hash
        cursor.seqs.add(env.seq)
        cursor.event_ids.add(env.event_id)
    return problems
