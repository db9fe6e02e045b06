from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tether_bench.hops import hop_means, mean_ms_between, parse_hop_metrics


def exposition(observations: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    for name, values in observations.items():
        h = Histogram(name, "doc", ["service"], registry=registry)
        for v in values:
            h.labels("planner").observe(v)
    return generate_latest(registry).decode()


def test_parse_reads_sum_and_count_of_the_loop_histograms_only() -> None:
    text = exposition({"tether_loop_input_age_seconds": [0.01, 0.03], "tether_loop_commit_seconds": [0.005],
                       "some_other_seconds": [9.0]})
    snap = parse_hop_metrics(text)
    assert snap["input_age"] == (0.04, 2.0)
    assert snap["commit"] == (0.005, 1.0)
    assert set(snap) == {"input_age", "commit"}


def test_means_cover_only_what_happened_between_the_snapshots() -> None:
    before = parse_hop_metrics(exposition({"tether_loop_handle_seconds": [1.0]}))
    after = parse_hop_metrics(exposition({"tether_loop_handle_seconds": [1.0, 0.002, 0.004]}))
    assert mean_ms_between(before, after) == {"handle_ms_mean": 3.0, "handle_n": 2}
    assert mean_ms_between(after, after) == {"handle_ms_mean": None, "handle_n": 0}


def test_a_service_that_did_not_answer_is_left_out() -> None:
    snap = parse_hop_metrics(exposition({"tether_loop_commit_seconds": [0.01]}))
    assert hop_means({"budget": snap, "planner": snap}, {"budget": snap, "planner": {}}) == {
        "budget": {"commit_ms_mean": None, "commit_n": 0}}
