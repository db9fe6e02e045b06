"""The park phase's figures: the marginal RSS slope between two levels, and the heap diff by allocation site."""

from __future__ import annotations

import tracemalloc

import pytest

from tether_bench.heap import heap_growth, marginal_kb_per_run, mb_per_10k


def test_the_slope_leaves_out_what_was_paid_before_the_first_level() -> None:
    # 500 MB of warm-up before the first level, then 2 KiB per run from 1,000 to 3,000 runs.
    low = {"budget": 600_000, "planner": 100_000}
    high = {"budget": 604_000, "planner": 101_000}
    per_run = marginal_kb_per_run(low, high, 1_000, 3_000)
    assert per_run == {"budget": 2.0, "planner": 0.5}
    assert mb_per_10k(per_run) == round(2.5 * 10_000 / 1024, 1)


def test_a_service_whose_memory_fell_counts_zero_not_a_credit() -> None:
    # run-api's RSS shrank by 12 MB between the levels; budget grew 2 KiB per run.
    per_run = marginal_kb_per_run({"budget": 100_000, "run-api": 120_000}, {"budget": 104_000, "run-api": 108_000},
                                  1_000, 3_000)
    assert per_run == {"budget": 2.0, "run-api": -6.0}
    assert mb_per_10k(per_run) == round(2.0 * 10_000 / 1024, 1)


def test_no_slope_without_runs_parked_between_the_levels_or_for_a_restarted_service() -> None:
    assert marginal_kb_per_run({"budget": 10}, {"budget": 20}, 500, 500) == {"budget": None}
    per_run = marginal_kb_per_run({"budget": 10, "planner": 10}, {"budget": 20}, 0, 10)
    assert per_run == {"budget": 1.0, "planner": None}
    assert mb_per_10k(per_run) is None


def _grow(kept: list, runs: int) -> None:
    for _ in range(runs):
        kept.append(bytearray(4_000))  # the site the diff must name


def test_heap_growth_names_the_allocation_site_per_run(tmp_path) -> None:
    kept: list = []
    tracemalloc.start(4)
    try:
        tracemalloc.take_snapshot().dump(str(tmp_path / "low"))
        _grow(kept, 200)
        tracemalloc.take_snapshot().dump(str(tmp_path / "high"))
    finally:
        tracemalloc.stop()
    growth = heap_growth(tmp_path / "low", tmp_path / "high", 200)
    top = growth["top_lines"][0]
    assert "test_heap.py" in top["site"] and 4_000 <= top["bytes_per_run"] < 4_200
    assert top["blocks_per_run"] in (1.0, 2.0)  # the object, and its buffer where not inline
    # With the path to it: the allocating line in _grow, then the line that called _grow.
    inner, caller = growth["top_sites"][0]["site"].split(" <- ")[:2]
    assert inner == top["site"] and "test_heap.py" in caller
    assert growth["traced_bytes_per_run"] >= 4_000


def test_c_heap_growth_takes_tracemalloc_out_and_needs_both_sides(tmp_path) -> None:
    import json

    from tether_bench.heap import c_heap_growth

    low, high = tmp_path / "a.tracemalloc", tmp_path / "b.tracemalloc"
    low.with_suffix(".malloc.json").write_text(json.dumps(
        {"malloc": {"in_use": 10_000, "free": 5_000, "mmapped": 0}, "tracemalloc_overhead": 1_000}))
    high.with_suffix(".malloc.json").write_text(json.dumps(
        {"malloc": {"in_use": 70_000, "free": 45_000, "mmapped": 0}, "tracemalloc_overhead": 21_000}))
    assert c_heap_growth(low, high, 20) == {"c_in_use_bytes_per_run": 2_000, "c_free_bytes_per_run": 2_000}
    high.with_suffix(".malloc.json").write_text(json.dumps({"malloc": None, "tracemalloc_overhead": 0}))
    assert c_heap_growth(low, high, 20) is None
    assert c_heap_growth(low, tmp_path / "missing.tracemalloc", 20) is None


@pytest.mark.integration
def test_consumer_lag_counts_what_a_group_has_not_committed(kafka_bootstrap, kafka_topics) -> None:
    import uuid

    from confluent_kafka import Consumer, Producer, TopicPartition

    from tether_bench.heap import consumer_lag

    topic = kafka_topics.create("bench-lag", partitions=2)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for _ in range(5):
        producer.produce(topic, b"x", partition=0)
    producer.produce(topic, b"x", partition=1)
    assert producer.flush(30) == 0
    behind, done, never = (f"bench-lag-{what}-{uuid.uuid4().hex[:8]}" for what in ("behind", "done", "never"))
    for group, offsets in ((behind, (2, 1)), (done, (5, 1))):
        committer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
        try:
            committer.commit(offsets=[TopicPartition(topic, p, o) for p, o in enumerate(offsets)], asynchronous=False)
        finally:
            committer.close()
    lag = consumer_lag(kafka_bootstrap, [behind, done, never], [topic], 2)
    # 5 records on partition 0, committed to 2: 3 offsets, one of which could be a commit marker.
    assert lag == {behind: 2, done: 0, never: 0}
