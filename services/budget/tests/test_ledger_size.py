"""The run's ledger stays small whatever the tool results weigh: it is checkpointed whole to the
changelog after every record, and a checkpoint over the producer's message.max.bytes (1 MB) would
stop the loop on the same record forever. A finished call keeps hashes and short excerpts, never
its result text or arguments; and an old checkpoint that kept them still loads."""

from __future__ import annotations

import json

from tether_budget.domain.ledger import CallStatus, Ledger
from tether_budget.domain.loopguard import EXCERPT_CHARS, LoopGuardConfig, call_signature
from tether_contracts.records import ApprovalOutcome, StepGranted

BIG = 60_000  # bytes of one tool result


def _page(step: int, size: int) -> str:
    """A result of about `size` bytes, different at every step (so the run is not a loop)."""
    return json.dumps({"step": step, "page": (f"lorem ipsum {step} " * (size // 10 + 1))[:size]})


def _encoded(h, run_id: str = "r1") -> int:
    """The size of the ledger as the loop checkpoints it (the processor's changelog codec)."""
    return len(h.driver.processor.state_codec.encode(h.ledger(run_id)))


def _run_with_results(h, steps: int, size: int) -> list[int]:
    h.submit(run_caps=h.caps(max_steps=steps + 1, max_tokens=10_000_000, max_cost_usd_micros=100_000_000))
    sizes = []
    for step in range(1, steps + 1):
        h.model(step, 1)
        h.request(step, 0, args={"q": f"page {step}"})
        out = h.done(f"{step}.0", result=_page(step, size))
        assert isinstance(out[-1], StepGranted) and out[-1].loop_warning is None
        sizes.append(_encoded(h))
    return sizes


def test_big_tool_results_do_not_grow_the_ledger(harness) -> None:
    big = _run_with_results(harness, 40, BIG)
    # Without the fix: 0.97 MB after 16 steps, 1.2 MB (over message.max.bytes) after 20, 2.4 MB after 40.
    assert max(big) < 64_000, big
    assert all(c.status is CallStatus.COMPLETED for c in harness.ledger().calls.values())

    small = _run_with_results(type(harness)(), 40, 100)
    # The result's size shows only in the excerpts of the loop guard's history (a bounded window).
    window = LoopGuardConfig().history_len * EXCERPT_CHARS
    assert all(0 <= b - s <= window for b, s in zip(big, small, strict=True)), (big, small)


def test_a_finished_call_keeps_no_result_text_or_arguments(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 2)
    h.request(1, 0, args={"q": "x" * 5_000})
    h.request(1, 1, args={"q": "y" * 5_000})
    h.done("1.0", result=_page(1, BIG))
    ledger = h.ledger()
    done, open_ = ledger.calls["1.0"], ledger.calls["1.1"]
    # The finished call: its args hash and, until its step is signed, its loop-guard signature.
    assert done.args_json is None and done.signature is not None
    assert done.args_hash == h.calls[("r1", "1.0")].args_hash
    assert done.signature == call_signature("search", h.calls[("r1", "1.0")].args_json, observation=_page(1, BIG))
    # The open call keeps its arguments (its outcome's signature needs them).
    assert open_.args_json == h.calls[("r1", "1.1")].args_json and open_.signature is None
    h.done("1.1")
    # The step is signed (the guard's history has it): the calls keep neither.
    assert all(c.args_json is None and c.signature is None for c in h.ledger().calls.values())
    assert len(h.driver.processor.state_codec.encode(h.ledger())) < 4_000


def _legacy(ledger: Ledger, h, results: dict[str, str]) -> bytes:
    """The ledger as a checkpoint written before the fix: every call with its args_json, a
    finished call with its observation (result text), no args_hash, no signature."""
    data = json.loads(ledger.model_dump_json())
    for call_id, call in data["calls"].items():
        call.pop("args_hash")
        call.pop("signature")
        call["args_json"] = h.calls[("r1", call_id)].args_json
        call["observation"] = results.get(call_id)
    return json.dumps(data).encode()


def test_an_old_checkpoint_with_full_texts_loads_and_signs_its_step_the_same(harness) -> None:
    # Two runs repeat the same two-call step; one is restored from an old-format checkpoint
    # in the middle of each step. The loop guard must see the same steps in both.
    plain, restored = type(harness)(), harness
    codec = restored.driver.processor.state_codec
    for h in (plain, restored):
        h.submit()
    grants = {id(plain): [], id(restored): []}
    for step in range(1, 6):
        results = {f"{step}.0": f'{{"at": "2024-05-0{step}T10:00:00Z", "rows": []}}', f"{step}.1": "x" * 300}
        for h in (plain, restored):
            h.model(step, 2)
            h.request(step, 0, args={"q": "same"})
            h.request(step, 1, tool_name="fetch", args={"url": "u"})
            h.done(f"{step}.0", result=results[f"{step}.0"])
        old = _legacy(restored.ledger(), restored, results)
        assert b'"observation"' in old and b'"args_hash"' not in old
        restored.driver.states["r1"] = codec.decode(old)
        for h in (plain, restored):
            grants[id(h)].append(h.done(f"{step}.1", result=results[f"{step}.1"])[-1])
        assert restored.ledger().loop == plain.ledger().loop
        assert restored.ledger().calls == plain.ledger().calls
    assert grants[id(restored)] == grants[id(plain)]
    assert grants[id(plain)][3].loop_warning is not None  # R1 at step 4: the restored run saw it too
    assert restored.ledger().status == plain.ledger().status


def test_an_old_checkpoint_loses_the_texts_of_finished_calls_and_keeps_their_hashes(harness) -> None:
    h = harness
    h.submit()
    h.model(1, 2)
    h.request(1, 0)
    h.request(1, 1)
    h.approval_requested("1.1")
    h.done("1.0", result=_page(1, BIG))
    old = _legacy(h.ledger(), h, {"1.0": _page(1, BIG)})
    assert len(old) > BIG
    codec = h.driver.processor.state_codec
    ledger = codec.decode(old)
    assert len(codec.encode(ledger)) < 4_000
    assert ledger.calls["1.0"].args_json is None and ledger.calls["1.1"].args_json == h.calls[("r1", "1.1")].args_json
    assert {c: e.args_hash for c, e in ledger.calls.items()} == {c: h.calls[("r1", c)].args_hash for c in ("1.0", "1.1")}
    # The restored run goes on: the approval is bound to the kept hash, the step finishes.
    h.driver.states["r1"] = ledger
    h.decided("1.1", ApprovalOutcome.APPROVED)
    assert isinstance(h.done("1.1")[-1], StepGranted)


def _same_page(step: int, tail: str = "") -> str:
    """Over EXCERPT_CHARS: the same page with volatile values (a time, a uuid) that differ per step."""
    return json.dumps({"fetched_at": f"2024-05-0{step}T10:00:0{step}Z", "id": f"{step}" * 8 + "-aaaa-bbbb-cccc-" + "d" * 12,
                       "rows": ["row"] * 100, "tail": tail})


def test_loop_detection_hashes_the_whole_normalised_result_and_quotes_its_start(harness) -> None:
    # The signature is made when the outcome is recorded, from the full text; the ledger keeps
    # only its hash and excerpt. Volatile values do not make results differ...
    h = harness
    h.submit()
    for step in range(1, 5):
        h.model(step, 1)
        h.request(step, 0, tool_name="fetch", args={"url": "u"})
        out = h.done(f"{step}.0", result=_same_page(step))
    warning = out[-1].loop_warning
    assert "R1_REPEAT" in warning and f'identical result "{_same_page(4)[: EXCERPT_CHARS - 1]}…"' in warning
    # ...a difference past the excerpt does.
    other = type(harness)()
    other.submit()
    for step in range(1, 5):
        other.model(step, 1)
        other.request(step, 0, tool_name="fetch", args={"url": "u"})
        out = other.done(f"{step}.0", result=_same_page(step, tail=f"page {step}"))
        assert out[-1].loop_warning is None
