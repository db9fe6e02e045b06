"""Topic declaration: names under a prefix, configs per docs/architecture.md, idempotent, partition check."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from tether_messaging import topics as names
from tether_messaging.admin import PartitionCountMismatch, declare_specs, declare_topics
from tether_messaging.topics import Topics, TopicSpec


def test_names_go_through_the_prefix() -> None:
    t = Topics("x.")
    assert [t.commands, t.run_intake, t.run_events, t.dead_letters, t.changelog("budget")] == [
        "x.tether.commands.v1",
        "x.tether.run-intake.v1",
        "x.tether.run-events.v1",
        "x.tether.dead-letters.v1",
        "x.tether.budget.changelog.v1",
    ]
    assert Topics().run_events == names.RUN_EVENTS
    assert t.group_id("budget") == "x.budget"


def test_specs_follow_the_retention_table() -> None:
    specs = {s.name: s.config for s in Topics().specs(["budget", "planner"])}
    assert specs[names.RUN_EVENTS]["retention.ms"] == "-1"
    assert specs[names.DEAD_LETTERS]["retention.ms"] == str(30 * names.DAY_MS)
    assert specs[names.COMMANDS]["retention.ms"] == specs[names.RUN_INTAKE]["retention.ms"] == str(7 * names.DAY_MS)
    assert specs[names.changelog("budget")]["cleanup.policy"] == "compact"
    assert specs[names.changelog("planner")]["cleanup.policy"] == "compact"
    assert len(specs) == 6


def _configs(bootstrap: str, topic: str) -> dict[str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    (fut,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
    return {k: v.value for k, v in fut.result(timeout=30).items()}


@pytest.mark.integration
def test_declare_topics_creates_once_with_configs(kafka_bootstrap: str, topic_prefix: str) -> None:
    t = Topics(topic_prefix)
    created = declare_topics(kafka_bootstrap, 4, ["budget"], prefix=topic_prefix)
    assert sorted(created) == sorted([t.commands, t.run_intake, t.run_events, t.dead_letters, t.changelog("budget")])
    assert declare_topics(kafka_bootstrap, 4, ["budget"], prefix=topic_prefix) == []

    assert _configs(kafka_bootstrap, t.run_events)["retention.ms"] == "-1"
    assert _configs(kafka_bootstrap, t.changelog("budget"))["cleanup.policy"] == "compact"
    assert _configs(kafka_bootstrap, t.dead_letters)["retention.ms"] == str(30 * names.DAY_MS)
    md = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30)
    assert {len(md.topics[n].partitions) for n in created} == {4}


@pytest.mark.integration
def test_a_topic_with_another_partition_count_is_reported(kafka_bootstrap: str, topic_prefix: str) -> None:
    t = Topics(topic_prefix)
    declare_specs(kafka_bootstrap, 3, [TopicSpec(t.run_events)])
    with pytest.raises(PartitionCountMismatch) as info:
        declare_topics(kafka_bootstrap, 6, [], prefix=topic_prefix)
    assert (info.value.topic, info.value.expected, info.value.actual) == (t.run_events, 6, 3)
    assert "TETHER_PARTITIONS=6" in str(info.value)
