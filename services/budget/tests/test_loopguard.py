"""LoopGuard over labelled traces: loops (L1–L7, L2b) are detected, hard-but-progressing work is not."""

from __future__ import annotations

import json
import random

import pytest

from tether_budget.domain.loopguard import (
    LoopGuard,
    LoopGuardConfig,
    LoopGuardState,
    LoopRule,
    StepSignature,
    Verdict,
    call_signature,
    canonical_action,
    normalise_observation,
    text_step,
)

Call = tuple  # (tool, args: dict | str, observation: str, error: str | None)


def _step(n: int, *calls: Call, pollable: frozenset[str] = frozenset()) -> StepSignature:
    sigs = []
    for tool, args, obs, err in calls:
        args_json = args if isinstance(args, str) else json.dumps(args)
        sigs.append(call_signature(tool, args_json, observation=obs, error=err, pollable=tool in pollable))
    return StepSignature(step=n, calls=sigs)


def _run(trace: list[StepSignature], guard: LoopGuard | None = None):
    """Feed a trace; returns [(step, verdict, rule)] for every step that was not CONTINUE."""
    guard = guard or LoopGuard()
    state = LoopGuardState()
    fired = []
    for step in trace:
        verdict, detection = guard.observe(state, step)
        if verdict is not Verdict.CONTINUE:
            fired.append((step.step, verdict, detection.rule if detection else None))
    return fired, state


def _progress_prefix(n: int, seed: int = 7) -> list[Call]:
    rng = random.Random(seed)
    return [("read_file", {"path": f"src/m{i}.py"}, f"contents {rng.random()}", None) for i in range(n)]


def _trace(calls: list[Call], start: int = 1, pollable: frozenset[str] = frozenset()) -> list[StepSignature]:
    return [_step(start + i, c, pollable=pollable) for i, c in enumerate(calls)]


# -- loops ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [0, 5, 20])
def test_l1_exact_repeat_warns_at_the_fourth_identical_step_then_terminates(prefix: int) -> None:
    repeat = ("search", {"q": "flights"}, '{"results": []}', None)
    trace = _trace(_progress_prefix(prefix) + [repeat] * 5)
    fired, state = _run(trace)
    assert fired == [
        (prefix + 4, Verdict.WARN, LoopRule.REPEAT),
        (prefix + 5, Verdict.TERMINATE, LoopRule.REPEAT),
    ]
    assert state.warned is not None and 'search({"q":"flights"})' in state.warned.action


def test_l2_repeated_error_fires_at_the_third_identical_failure() -> None:
    failing = ("http_get", {"url": "https://x.test/a"}, "connection refused", "TOOL_ERROR")
    fired, _ = _run(_trace(_progress_prefix(3) + [failing] * 4))
    assert fired == [(6, Verdict.WARN, LoopRule.REPEAT_ERROR), (7, Verdict.TERMINATE, LoopRule.REPEAT_ERROR)]


def test_l2b_the_same_denied_call_proposed_three_times_in_a_run_fires_even_when_not_consecutive() -> None:
    denied = ("send_money", {"to": "x", "amount": 5}, "not allowed", "denied:TOOL_NOT_ALLOWED")
    calls = [denied, *_progress_prefix(2, seed=1), denied, *_progress_prefix(3, seed=2), denied]
    fired, _ = _run(_trace(calls))
    assert fired == [(len(calls), Verdict.WARN, LoopRule.REPEATED_DENIAL)]


def test_l3_a_b_alternation_with_identical_results_is_a_period_2_cycle_at_six_steps() -> None:
    a = ("read_file", {"path": "a.py"}, "A", None)
    b = ("search", {"q": "foo"}, "B", None)
    fired, state = _run(_trace(_progress_prefix(4) + [a, b] * 4))
    assert fired[0] == (4 + 6, Verdict.WARN, LoopRule.CYCLE)
    assert state.warned.period == 2
    assert fired[1][1] is Verdict.TERMINATE


@pytest.mark.parametrize("period", [3, 4])
def test_l4_longer_cycles_are_detected(period: int) -> None:
    block = [("tool", {"i": i}, f"r{i}", None) for i in range(period)]
    fired, state = _run(_trace(_progress_prefix(2) + block * 4))
    assert fired[0] == (2 + 3 * period, Verdict.WARN, LoopRule.CYCLE)
    assert state.warned.period == period


def test_l5_monologue_of_text_only_turns() -> None:
    trace = [*_trace(_progress_prefix(2)), *(text_step(3 + i, "I will now think about it.") for i in range(4))]
    fired, _ = _run(trace)
    assert fired == [(5, Verdict.WARN, LoopRule.MONOLOGUE), (6, Verdict.TERMINATE, LoopRule.MONOLOGUE)]


def test_l6_near_duplicates_are_normalised_before_comparing() -> None:
    variants = [
        ("search", '{"q": "x", "limit": 5}', '{"hits": 0, "took_ms": 12, "at": "2026-01-01T10:00:00Z"}', None),
        ("search", '{"limit":5,"q":"x"}', '{"hits": 0, "took_ms": 40, "at": "2026-01-01T10:00:07Z"}', None),
        ("search", '{ "q":"x" ,"limit":5 }', '{"at": "2026-01-01T10:01:00.123Z", "hits": 0, "took_ms": 3}', None),
        ("search", '{"q":"x","limit":5}', '{"hits": 0, "took_ms": 9, "at": "2026-01-02T00:00:00+02:00"}', None),
    ]
    fired, _ = _run(_trace(variants))
    assert fired == [(4, Verdict.WARN, LoopRule.REPEAT)]


def test_l7_wandering_over_a_few_known_pairs_is_no_progress() -> None:
    rng = random.Random(3)
    pairs = [("tool", {"i": i}, f"r{i}", None) for i in range(4)]
    calls = list(pairs)  # each pair once (novel), then wander without anything new
    while len(calls) < 40:
        calls.append(rng.choice(pairs))
    fired, _ = _run(_trace(calls))
    assert fired, "wandering must be detected"
    assert fired[0][0] <= 4 + 12
    assert fired[0][1] is Verdict.WARN


# -- hard but progressing: never terminated --------------------------------------------------


def _never_fires(trace: list[StepSignature], guard: LoopGuard | None = None) -> None:
    fired, _ = _run(trace, guard)
    assert fired == []


def test_n2_pagination_with_differing_arguments() -> None:
    calls = [("list_users", {"page": p, "per_page": 50}, '{"users": ["..."], "more": true}', None) for p in range(30)]
    _never_fires(_trace(calls))
    invites = [("send_invite", {"email": f"u{i}@x.test"}, '{"ok": true}', None) for i in range(10)]
    _never_fires(_trace(invites))


def test_n3_polling_a_pollable_job_until_done() -> None:
    poll = ("job_status", {"job": "j1"})
    calls = [(*poll, '{"state": "pending"}', None)] * 12 + [(*poll, '{"state": "running"}', None)] * 3
    calls += [(*poll, '{"state": "done"}', None)]
    _never_fires(_trace(calls, pollable=frozenset({"job_status"})))
    # The same trace from a tool that is not declared pollable is a loop.
    fired, _ = _run(_trace(calls))
    assert fired and fired[0][2] is LoopRule.REPEAT


def test_polling_past_the_poll_budget_counts_again() -> None:
    calls = [("job_status", {"job": "j1"}, '{"state": "pending"}', None)] * 30
    guard = LoopGuard(LoopGuardConfig(poll_budget=5))
    fired, _ = _run(_trace(calls, pollable=frozenset({"job_status"})), guard)
    assert fired[0] == (1 + 5 + 3, Verdict.WARN, LoopRule.REPEAT)


def test_n4_test_fix_cycles_with_changing_results() -> None:
    calls: list[Call] = []
    for failures in range(6, 0, -1):
        calls.append(("run_tests", {}, f'{{"failed": {failures}, "duration": "3.2s"}}', None))
        calls.append(("edit_file", {"path": "m.py", "patch": f"fix #{failures}"}, '{"ok": true}', None))
    calls.append(("run_tests", {}, '{"failed": 0}', None))
    _never_fires(_trace(calls))


def test_n4_test_runs_reported_as_failures_with_changing_details() -> None:
    calls: list[Call] = []
    for failures in range(5, 0, -1):
        calls.append(("run_tests", {}, f"{failures} tests failed", "TOOL_ERROR"))
        calls.append(("edit_file", {"path": "m.py", "patch": f"p{failures}"}, "ok", None))
    _never_fires(_trace(calls))


def test_n5_transient_error_retried_with_backoff_succeeds() -> None:
    flaky = ("http_get", {"url": "https://api.test/x"})
    calls = [(*flaky, "503 Service Unavailable", "TOOL_ERROR")] * 2 + [(*flaky, '{"ok": 1}', None)]
    _never_fires(_trace(_progress_prefix(3) + calls + _progress_prefix(3, seed=9)))


def test_n6_long_slow_progress() -> None:
    calls: list[Call] = []
    for block in range(20):
        for j in range(7):
            calls.append(("grep", {"pattern": f"sym{block}_{j}"}, "no matches", None))
        calls.append(("read_file", {"path": f"f{block}.py"}, f"found {block}", None))
    _never_fires(_trace(calls))


def test_n7_re_reading_a_file_after_writing_it() -> None:
    calls: list[Call] = []
    for v in range(6):
        calls.append(("read_file", {"path": "cfg.yaml"}, f"version: {v}", None))
        calls.append(("write_file", {"path": "cfg.yaml", "content": f"version: {v + 1}"}, '{"ok": true}', None))
    _never_fires(_trace(calls))


def test_n8_alternation_with_a_progress_counter() -> None:
    calls: list[Call] = []
    for i in range(10):
        calls.append(("next_batch", {"cursor": "c"}, f'{{"processed": {i * 100}}}', None))
        calls.append(("status", {}, f"progress {i * 10}%", None))
    _never_fires(_trace(calls))


def test_a_repeated_action_with_a_different_result_never_counts() -> None:
    calls = [("run_tests", {}, f"{n} passed", None) for n in range(20)]
    _never_fires(_trace(calls))


# -- signatures ------------------------------------------------------------------------------


def test_canonical_action_ignores_key_order_and_whitespace() -> None:
    assert canonical_action("t", '{"b": 1, "a": [1, 2]}') == canonical_action("t", '{"a":[1,2],"b":1}')
    assert canonical_action("t", "not json  at all") == "t(not json at all)"


def test_normalise_observation_strips_volatile_values() -> None:
    one = normalise_observation(
        '{"id": "3f2a9c1e-8b7d-4e6f-9a1b-2c3d4e5f6a7b", "timestamp": 1, "msg": "took 35ms at 2026-03-01T10:00:00Z"}'
    )
    two = normalise_observation(
        '{"msg": "took 120ms at 2026-03-02T11:22:33.5+01:00", "timestamp": 99, "id": "00000000-1111-2222-3333-444444444444"}'
    )
    assert one == two
    assert normalise_observation("3 failed") != normalise_observation("2 failed")


def test_the_warning_is_deterministic_and_names_the_action() -> None:
    repeat = ("search", {"q": "flights"}, '{"results": []}', None)
    _, s1 = _run(_trace([repeat] * 4))
    _, s2 = _run(_trace([repeat] * 4))
    assert s1.warned.warning() == s2.warned.warning()
    assert 'search({"q":"flights"})' in s1.warned.warning()
    assert "4 times" in s1.warned.warning()


def test_a_step_with_several_calls_is_compared_as_a_whole() -> None:
    a = ("read_file", {"path": "a"}, "A", None)
    b = ("read_file", {"path": "b"}, "B", None)
    steps = [_step(i + 1, a, b) for i in range(4)]
    fired, _ = _run(steps)
    assert fired == [(4, Verdict.WARN, LoopRule.REPEAT)]
    varied = [_step(i + 1, a, ("read_file", {"path": "b"}, f"B{i}", None)) for i in range(8)]
    _never_fires(varied)


def test_guard_state_survives_a_json_checkpoint() -> None:
    repeat = ("search", {"q": "x"}, "r", None)
    guard, state = LoopGuard(), LoopGuardState()
    for n in range(1, 4):
        guard.observe(state, _step(n, repeat))
    restored = LoopGuardState.model_validate_json(state.model_dump_json())
    verdict, detection = guard.observe(restored, _step(4, repeat))
    assert verdict is Verdict.WARN and detection.rule is LoopRule.REPEAT


@pytest.mark.parametrize("key", ["took_ms", "durationMs", "elapsedMs", "elapsed_seconds", "latency-ms", "ts_ns"])
def test_a_volatile_key_in_any_spelling_does_not_hide_a_repeat(key: str) -> None:
    # `search{"q":"flights"}` answering `{"status":"pending","durationMs":40+n}` 20 times never
    # tripped R1/R4/R5: only exact snake_case keys were dropped.
    calls = [("search", {"q": "flights"}, json.dumps({"status": "pending", key: 40 + n}), None) for n in range(20)]
    fired, _ = _run(_trace(calls))
    assert fired[:2] == [(4, Verdict.WARN, LoopRule.REPEAT), (5, Verdict.TERMINATE, LoopRule.REPEAT)]


def test_micro_and_nanosecond_epochs_are_volatile() -> None:
    assert normalise_observation('{"v": 1, "t": "1717171717123456"}') == normalise_observation(
        '{"v": 1, "t": "1717171718654321"}')
    assert normalise_observation("at 1717171717123456789 ok") == normalise_observation("at 1717171799000000001 ok")


def test_a_pollable_call_exempts_only_itself_not_the_rest_of_its_step() -> None:
    # A non-pollable fetch{start-export} with the same result every step, next to a pollable
    # job_status: the whole step was exempt for the poll budget and the loop ran 25 steps.
    step = (("fetch", {"url": "https://x/start-export"}, '{"started": true}', None),
            ("job_status", {"job": "j1"}, '{"state": "running"}', None))
    trace = [_step(n, *step, pollable=frozenset({"job_status"})) for n in range(1, 30)]
    fired, _ = _run(trace)
    # The first step counts whole; from the second the repeated poll drops out and the
    # repeated fetch counts as it would alone.
    assert fired[:2] == [(5, Verdict.WARN, LoopRule.REPEAT), (6, Verdict.TERMINATE, LoopRule.REPEAT)]



def test_a_process_state_change_is_not_normalised_away_but_its_pid_is() -> None:
    assert normalise_observation("Process started") != normalise_observation("Process exited")
    assert normalise_observation("process 4242 exited") == normalise_observation("process 4317 exited")
    assert normalise_observation("pid=4242 ok") == normalise_observation("pid=17 ok")
