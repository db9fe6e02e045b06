"""Tests for the run event log's hash chain: sealing, the hash definition, and tamper detection."""

from __future__ import annotations

import hashlib

import pytest

from tether_contracts.records import Envelope, RunCompleted, Usage
from tether_messaging.chain import (
    GENESIS_HASH,
    ChainError,
    ProblemKind,
    event_hash,
    seal,
    verify_chain,
)
from tether_messaging.envelopes import make_envelope


def _env(run_id: str, n: int, *, answer: str = "ok", tenant: str = "t1") -> Envelope:
    return make_envelope(
        RunCompleted(step=n, answer=f"{answer}-{n}", usage=Usage()),
        run_id=run_id,
        tenant_id=tenant,
        event_id=f"{run_id}-e{n}",
        producer="planner",
        recorded_at_ms=1_700_000_000_000 + n,
    )


def _chain(run_id: str, count: int) -> list[Envelope]:
    sealed, prev = [], GENESIS_HASH
    for n in range(1, count + 1):
        env = seal(_env(run_id, n), n, prev)
        prev = env.hash
        sealed.append(env)
    return sealed


def _kinds(problems) -> list[ProblemKind]:
    return [p.kind for p in problems]


def _reference_hash(env: Envelope, seq: int, prev: str) -> str:
    # Written from docs/architecture.md independently of the implementation.
    def f(b: bytes) -> bytes:
        return len(b).to_bytes(8, "big") + b

    body = b"".join(
        f(x)
        for x in (
            prev.encode(),
            env.event_id.encode(),
            env.tenant_id.encode(),
            env.run_id.encode(),
            str(seq).encode(),
            env.event_type.encode(),
            env.schema_fingerprint.encode(),
            str(env.recorded_at_ms).encode(),
            env.producer.encode(),
            env.payload,
        )
    )
    return hashlib.sha256(body).hexdigest()


def test_seal_sets_seq_prev_and_the_specified_hash() -> None:
    env = _env("r1", 1)
    sealed = seal(env, 1, GENESIS_HASH)
    assert (sealed.seq, sealed.prev_hash) == (1, GENESIS_HASH)
    assert sealed.hash == _reference_hash(env, 1, GENESIS_HASH)
    assert event_hash(sealed) == sealed.hash
    assert env.seq is None and env.hash is None  # the input is not modified


def test_an_intact_chain_has_no_problems_and_links_each_event_to_the_previous() -> None:
    chain = _chain("r1", 5)
    assert verify_chain(chain) == []
    assert [e.prev_hash for e in chain[1:]] == [e.hash for e in chain[:-1]]


def test_causation_and_trace_context_are_not_covered_by_the_hash() -> None:
    sealed = _chain("r1", 1)[0]
    routed = sealed.model_copy(update={"causation_id": "x", "traceparent": "00-ab-cd-01"})
    assert verify_chain([routed]) == []


@pytest.mark.parametrize(
    "field,value",
    [
        ("payload", None),  # replaced below with a different payload
        ("event_id", "forged"),
        ("tenant_id", "t2"),
        ("run_id", "r1"),  # same run id: must still be intact (control)
        ("producer", "budget"),
        ("recorded_at_ms", 1),
        ("event_type", "tether.v1.StepGranted"),
        ("schema_fingerprint", "00" * 8),
    ],
)
def test_altering_any_covered_field_is_a_hash_mismatch(field: str, value: object) -> None:
    chain = _chain("r1", 3)
    if field == "payload":
        value = _env("r1", 2, answer="tampered").payload
    chain[1] = chain[1].model_copy(update={field: value})
    problems = verify_chain(chain)
    if field == "run_id":
        assert problems == []
        return
    assert _kinds(problems) == [ProblemKind.HASH_MISMATCH]
    assert problems[0].seq == 2


def test_length_prefixing_keeps_field_boundaries_unambiguous() -> None:
    a = _env("r1", 1).model_copy(update={"producer": "ab", "event_type": "c"})
    b = a.model_copy(update={"producer": "a", "event_type": "bc"})
    assert seal(a, 1, GENESIS_HASH).hash != seal(b, 1, GENESIS_HASH).hash


def test_rewriting_an_event_and_its_hash_breaks_the_next_link() -> None:
    chain = _chain("r1", 4)
    forged = _env("r1", 2, answer="forged")
    chain[1] = seal(forged, 2, chain[0].hash)
    problems = verify_chain(chain)
    assert _kinds(problems) == [ProblemKind.PREV_HASH_MISMATCH]
    assert problems[0].seq == 3


def test_a_removed_event_is_a_gap() -> None:
    chain = _chain("r1", 5)
    del chain[2]
    problems = verify_chain(chain)
    assert _kinds(problems) == [ProblemKind.GAP]
    assert problems[0].seq == 4 and "3" in problems[0].detail


def test_a_replayed_event_is_a_duplicate() -> None:
    chain = _chain("r1", 3)
    chain.insert(2, chain[1])
    assert _kinds(verify_chain(chain)) == [ProblemKind.DUPLICATE_EVENT, ProblemKind.DUPLICATE_SEQ]


def test_the_same_event_id_sequenced_twice_is_a_duplicate_event() -> None:
    chain = _chain("r1", 2)
    again = seal(_env("r1", 1), 3, chain[1].hash)
    assert _kinds(verify_chain([*chain, again])) == [ProblemKind.DUPLICATE_EVENT]


def test_swapped_events_are_out_of_order() -> None:
    chain = _chain("r1", 4)
    chain[1], chain[2] = chain[2], chain[1]
    kinds = _kinds(verify_chain(chain))
    assert ProblemKind.GAP in kinds and ProblemKind.OUT_OF_ORDER in kinds


def test_a_chain_must_start_at_genesis_unless_verifying_a_slice() -> None:
    chain = _chain("r1", 5)
    assert _kinds(verify_chain(chain[2:])) == [ProblemKind.GAP]
    assert verify_chain(chain[2:], from_genesis=False) == []


def test_unsealed_events_are_reported() -> None:
    chain = _chain("r1", 2)
    assert _kinds(verify_chain([chain[0], _env("r1", 2)])) == [ProblemKind.UNSEALED]


def test_interleaved_runs_are_verified_independently() -> None:
    a, b = _chain("ra", 3), _chain("rb", 3)
    log = [a[0], b[0], b[1], a[1], a[2], b[2]]
    assert verify_chain(log) == []
    log.remove(b[1])
    problems = verify_chain(log)
    assert [(p.kind, p.run_id) for p in problems] == [(ProblemKind.GAP, "rb")]


def test_seal_refuses_malformed_chain_positions() -> None:
    env = _env("r1", 1)
    with pytest.raises(ChainError):
        seal(env, 0, GENESIS_HASH)
    with pytest.raises(ChainError):
        seal(env, 1, "f" * 64)  # seq 1 must follow genesis
    with pytest.raises(ChainError):
        seal(env, 2, "not-a-hash")
    with pytest.raises(ChainError):
        event_hash(env)



@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prev_hash", "é" * 64),
        ("prev_hash", "A" * 64),
        ("prev_hash", "ab" * 32 + "\n"),
        ("hash", "é" * 64),
        ("hash", "0" * 63),
        ("seq", 0),
    ],
)
def test_a_malformed_chain_field_read_from_the_log_is_a_hash_mismatch_not_a_crash(field: str, value: object) -> None:
    chain = _chain("r1", 3)
    bad = chain[1].model_copy(update={field: value})
    problems = verify_chain([chain[0], bad, chain[2]])
    assert problems[0].kind == ProblemKind.HASH_MISMATCH and problems[0].seq == bad.seq
    assert problems[0].detail.startswith(f"malformed: {field}")
    # Hashing it does not raise either (the projector recomputes every event's hash).
    assert event_hash(chain[1].model_copy(update={"prev_hash": "é" * 64})) != chain[1].hash


def test_the_hash_of_a_well_formed_event_is_unchanged() -> None:
    # Pinned: chains sealed before any change to the hash code must still verify.
    env = _env("r1", 1)
    assert seal(env, 1, GENESIS_HASH).hash == _reference_hash(env, 1, GENESIS_HASH) == (
        "745c16e18ed622c14a75554a0cf7da706745e254c827888f15992afe3e5186f4"
    )
