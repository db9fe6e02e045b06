"""Topic declaration: names under a prefix, configs per docs/architecture.md, idempotent, partition and replica checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from tether_messaging import admin as admin_module, topics as names
from tether_messaging.admin import (
    PartitionCountMismatch,
    TopicConfigMismatch,
    TopicDeclarationFailed,
    declare_specs,
    declare_topics,
)
from tether_messaging.topics import Topics, TopicSpec
from tether_testing.kafka import set_topic_configs


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


class _Done:
    def __init__(self, error: KafkaError | None = None) -> None:
        self._error = error

    def result(self, timeout: float | None = None) -> None:
        if self._error is not None:
            raise KafkaException(self._error)


class _Configs:
    def __init__(self, configs: dict[str, str]) -> None:
        self._configs = configs

    def result(self, timeout: float | None = None) -> dict[str, SimpleNamespace]:
        return {k: SimpleNamespace(value=v) for k, v in self._configs.items()}


class _FakeAdmin:
    """Records the NewTopic specs; topics in `existing` answer TOPIC_ALREADY_EXISTS with `existing_replicas`.

    Existing topics have the configs they are declared with, overridden by `existing_configs`.
    """

    def __init__(self, partitions: int, existing: set[str] = frozenset(), existing_replicas: int = 1,
                 existing_configs: dict[str, str] | None = None) -> None:
        self.requested: list[NewTopic] = []
        self.partitions = partitions
        self.existing = existing
        self.existing_replicas = existing_replicas
        self.existing_configs = existing_configs or {}
        self.replicas: dict[str, int] = {}
        self.described: list[list[str]] = []

    def describe_configs(self, resources: list[ConfigResource], request_timeout: float) -> dict:
        self.described.append([r.name for r in resources])
        declared = {t.topic: t.config for t in self.requested}
        return {r: _Configs({**declared[r.name], **self.existing_configs}) for r in resources}

    def create_topics(self, new: list[NewTopic], request_timeout: float) -> dict[str, _Done]:
        self.requested.extend(new)
        futures = {}
        for topic in new:
            if topic.topic in self.existing:
                futures[topic.topic] = _Done(KafkaError(KafkaError.TOPIC_ALREADY_EXISTS))
                self.replicas[topic.topic] = self.existing_replicas
            else:
                futures[topic.topic] = _Done()
                self.replicas[topic.topic] = topic.replication_factor
        return futures

    def list_topics(self, timeout: float) -> SimpleNamespace:
        def partition() -> SimpleNamespace:
            return SimpleNamespace(replicas=list(range(self.replicas[name])))

        topics = {}
        for name in self.replicas:
            topics[name] = SimpleNamespace(error=None, partitions={p: partition() for p in range(self.partitions)})
        return SimpleNamespace(topics=topics)


def _fake_admin(monkeypatch: pytest.MonkeyPatch, fake: _FakeAdmin) -> None:
    monkeypatch.setattr(admin_module, "AdminClient", lambda conf: fake)


@pytest.mark.parametrize(("replication_factor", "min_isr"), [(1, "1"), (2, "1"), (3, "2"), (5, "2")])
def test_the_replication_factor_and_min_insync_reach_every_new_topic(
    monkeypatch: pytest.MonkeyPatch, replication_factor: int, min_isr: str
) -> None:
    fake = _FakeAdmin(partitions=4)
    _fake_admin(monkeypatch, fake)
    created = declare_topics("kafka:9092", 4, ["budget"], replication_factor=replication_factor)
    assert len(created) == len(fake.requested) == 5
    for topic in fake.requested:
        assert topic.replication_factor == replication_factor
        assert topic.config["min.insync.replicas"] == min_isr
    run_events = next(t for t in fake.requested if t.topic == names.RUN_EVENTS)
    assert run_events.config["retention.ms"] == "-1"  # the topic's own configs stay


def test_an_existing_topic_with_another_replication_factor_is_logged_not_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeAdmin(partitions=6, existing={names.RUN_EVENTS}, existing_replicas=1)
    _fake_admin(monkeypatch, fake)
    with structlog.testing.capture_logs() as logs:
        created = declare_topics("kafka:9092", 6, [], replication_factor=3)
    assert names.RUN_EVENTS not in created
    warnings = [e for e in logs if e["event"] == "topic_replication_factor_differs"]
    assert warnings == [{"event": "topic_replication_factor_differs", "log_level": "warning",
                         "topic": names.RUN_EVENTS, "expected": 3, "actual": [1]}]


@pytest.mark.parametrize(("key", "actual"), [("retention.ms", "604800000"), ("retention.bytes", "1073741824"),
                                             ("cleanup.policy", "compact")])
def test_an_existing_run_event_log_that_would_delete_records_is_refused(
    monkeypatch: pytest.MonkeyPatch, key: str, actual: str
) -> None:
    fake = _FakeAdmin(partitions=2, existing={names.RUN_EVENTS, names.COMMANDS}, existing_configs={key: actual})
    _fake_admin(monkeypatch, fake)
    with pytest.raises(TopicConfigMismatch) as info:
        declare_topics("kafka:9092", 2, ["budget"])
    assert (info.value.topic, info.value.key, info.value.actual) == (names.RUN_EVENTS, key, actual)
    assert fake.described == [[names.COMMANDS, names.RUN_EVENTS]]  # one request, the existing topics only


def test_another_config_of_an_existing_topic_is_logged_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seven-day topics are not kept forever: another retention there is an operator's choice.
    fake = _FakeAdmin(partitions=2, existing={names.COMMANDS, names.changelog("budget")},
                      existing_configs={"retention.ms": "86400000", "delete.retention.ms": "1000"})
    _fake_admin(monkeypatch, fake)
    with structlog.testing.capture_logs() as logs:
        declare_topics("kafka:9092", 2, ["budget"])
    differs = [(e["topic"], e["key"], e["expected"], e["actual"]) for e in logs if e["event"] == "topic_config_differs"]
    assert differs == [(names.COMMANDS, "retention.ms", str(7 * names.DAY_MS), "86400000"),
                       (names.changelog("budget"), "delete.retention.ms", str(names.DAY_MS), "1000")]


@pytest.mark.integration
def test_more_replicas_than_brokers_is_refused_with_the_setting_named(kafka_bootstrap: str, topic_prefix: str) -> None:
    brokers = len(AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30).brokers)
    with pytest.raises(TopicDeclarationFailed, match="TETHER_TOPIC_REPLICATION_FACTOR"):
        declare_topics(kafka_bootstrap, 2, [], prefix=topic_prefix, replication_factor=brokers + 1)


@pytest.mark.integration
def test_redeclaring_with_another_replication_factor_keeps_the_topic(kafka_bootstrap: str, topic_prefix: str) -> None:
    t = Topics(topic_prefix)
    declare_topics(kafka_bootstrap, 2, [], prefix=topic_prefix, replication_factor=1)
    with structlog.testing.capture_logs() as logs:
        assert declare_topics(kafka_bootstrap, 2, [], prefix=topic_prefix, replication_factor=3) == []
    differs = {e["topic"] for e in logs if e["event"] == "topic_replication_factor_differs"}
    assert differs == {t.commands, t.run_intake, t.run_events, t.dead_letters}
    md = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=30)
    assert {len(p.replicas) for p in md.topics[t.run_events].partitions.values()} == {1}


@pytest.mark.integration
def test_a_run_event_log_created_with_the_broker_defaults_is_refused(kafka_bootstrap: str, topic_prefix: str) -> None:
    t = Topics(topic_prefix)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # Created by hand or by auto-create: the broker's 7-day retention would delete the log.
    admin.create_topics([NewTopic(t.run_events, 2, 1)])[t.run_events].result(30)
    with pytest.raises(TopicConfigMismatch) as info:
        declare_topics(kafka_bootstrap, 2, ["budget"], prefix=topic_prefix)
    assert (info.value.topic, info.value.key, info.value.expected) == (t.run_events, "retention.ms", "-1")
    assert info.value.actual == _configs(kafka_bootstrap, t.run_events)["retention.ms"] != "-1"
    assert f"{t.run_events!r}" in str(info.value) and "retention.ms=-1" in str(info.value)

    # Set as its spec says (what an operator does), the same declaration goes through.
    set_topic_configs(kafka_bootstrap, [t.run_events], {"retention.ms": "-1"})
    with structlog.testing.capture_logs() as logs:
        assert declare_topics(kafka_bootstrap, 2, ["budget"], prefix=topic_prefix) == []
    assert [e for e in logs if e["event"] == "topic_config_differs"] == []
