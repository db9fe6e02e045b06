"""Declaring Tether's topics on the broker: idempotent creation with configs, partition-count and config checks."""

from __future__ import annotations

import time
from collections.abc import Iterable

import structlog
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from tether_messaging.topics import Topics, TopicSpec

log = structlog.get_logger("tether_messaging.admin")


class PartitionCountMismatch(Exception):
    """An existing topic has a different partition count than the deployment expects.

    Every topic must have the same count so a run's partition index is the same everywhere;
    Tether never repartitions a topic by itself (it would move runs between partitions).
    """

    def __init__(self, topic: str, expected: int, actual: int) -> None:
        super().__init__(
            f"topic {topic!r} has {actual} partitions but TETHER_PARTITIONS={expected}; "
            "use the topic's count or migrate the topics (see docs/architecture.md)"
        )
        self.topic = topic
        self.expected = expected
        self.actual = actual


class TopicDeclarationFailed(Exception):
    """The broker refused to create a topic."""


#: Settings that decide whether a topic's records are deleted: on a topic kept forever, a differing
#: value would delete the log (the run event log is the source of truth), so it is refused.
RETENTION_KEYS = ("retention.ms", "retention.bytes", "cleanup.policy")


class TopicConfigMismatch(Exception):
    """An existing topic kept forever has a retention setting that would delete its records.

    Tether does not change an existing topic's configs by itself; an operator sets it
    (kafka-configs --alter) after checking nothing was deleted yet.
    """

    def __init__(self, topic: str, key: str, expected: str, actual: str | None) -> None:
        super().__init__(
            f"topic {topic!r} is to be kept forever but has {key}={actual} (expected {key}={expected}); "
            f"set it with: kafka-configs --alter --entity-type topics --entity-name {topic} "
            f"--add-config {key}={expected}"
        )
        self.topic = topic
        self.key = key
        self.expected = expected
        self.actual = actual


def kept_forever(spec: TopicSpec) -> bool:
    """Whether the topic's records must never be deleted (retention.ms=-1 in its spec)."""
    return spec.config.get("retention.ms") == "-1"


def min_insync_replicas(replication_factor: int) -> int:
    """The `min.insync.replicas` Tether's topics get: all replicas but one, at most 2, at least 1.

    With acks=all a write then survives the loss of every in-sync replica but one, and one broker
    may be down (a rolling restart, a failed node) without stopping writes: RF 3 → 2 (the usual
    production pairing), RF 2 → 1 (writes go on while one broker restarts), RF 1 → 1 (one broker,
    the local stack). Never `replication_factor` itself: any broker down would stop the run loop.
    """
    return max(1, min(2, replication_factor - 1))


def declare_topics(
    bootstrap: str,
    partitions: int,
    services: Iterable[str],
    *,
    prefix: str = "",
    replication_factor: int = 1,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create every Tether topic (shared topics + one changelog per service) if missing.

    Services pass their `TETHER_TOPIC_REPLICATION_FACTOR` (default 3); the default of 1 here is
    for tests and tools on the single-broker local stack. Each topic gets
    `min.insync.replicas = min_insync_replicas(replication_factor)`.

    Idempotent: existing topics are checked, not changed. Raises `PartitionCountMismatch`
    if an existing topic's partition count differs; an existing topic with another replication
    factor is logged (`topic_replication_factor_differs`) and left as it is (reassigning replicas
    is an operator's decision: kafka-reassign-partitions). Raises `TopicConfigMismatch` if an
    existing topic kept forever (the run event log) has another retention.ms, retention.bytes or
    cleanup.policy than its spec; any other spec'd config that differs is logged
    (`topic_config_differs`). Returns the names created now.
    """
    return declare_specs(
        bootstrap,
        partitions,
        Topics(prefix).specs(services),
        replication_factor=replication_factor,
        timeout_s=timeout_s,
    )


def declare_specs(
    bootstrap: str,
    partitions: int,
    specs: Iterable[TopicSpec],
    *,
    replication_factor: int = 1,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create the given topics if missing and verify all of them have `partitions` partitions."""
    specs = list(specs)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    min_isr = str(min_insync_replicas(replication_factor))
    new = [
        NewTopic(
            s.name,
            num_partitions=partitions,
            replication_factor=replication_factor,
            config={"min.insync.replicas": min_isr, **s.config},
        )
        for s in specs
    ]
    created: list[str] = []
    for name, fut in admin.create_topics(new, request_timeout=timeout_s).items():
        try:
            fut.result(timeout=timeout_s)
            created.append(name)
            log.info("topic_created", topic=name, partitions=partitions, replication_factor=replication_factor,
                     min_insync_replicas=min_isr)
        except KafkaException as exc:
            code = exc.args[0].code()
            if code == KafkaError.INVALID_REPLICATION_FACTOR:
                raise TopicDeclarationFailed(
                    f"creating {name!r} with replication factor {replication_factor}: {exc.args[0].str()} "
                    "(TETHER_TOPIC_REPLICATION_FACTOR must not exceed the number of brokers)"
                ) from exc
            if code != KafkaError.TOPIC_ALREADY_EXISTS:
                raise TopicDeclarationFailed(f"creating {name!r}: {exc.args[0].str()}") from exc
    deadline = time.monotonic() + timeout_s
    while True:
        # A just-created topic takes a moment to appear in metadata.
        md = admin.list_topics(timeout=timeout_s)
        missing = [s.name for s in specs if s.name not in md.topics or md.topics[s.name].error is not None]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TopicDeclarationFailed(f"topics not visible after declaration: {missing}")
        time.sleep(0.2)
    for s in specs:
        actual = len(md.topics[s.name].partitions)
        if actual != partitions:
            raise PartitionCountMismatch(s.name, partitions, actual)
        replicas = {len(p.replicas) for p in md.topics[s.name].partitions.values()}
        if replicas != {replication_factor}:
            # Not changed here: moving replicas is a reassignment for an operator to plan, and a
            # deployment with fewer replicas than asked is still one that works.
            log.warning("topic_replication_factor_differs", topic=s.name, expected=replication_factor,
                        actual=sorted(replicas))
    # Topics created now have their spec's configs; only those that existed are described.
    _check_configs(admin, [s for s in specs if s.name not in created and s.config], timeout_s)
    return created


def _same(key: str, expected: str, actual: str | None) -> bool:
    if key == "cleanup.policy" and actual is not None:
        return set(expected.split(",")) == {p.strip() for p in actual.split(",")}
    return expected == actual


def _check_configs(admin: AdminClient, specs: list[TopicSpec], timeout_s: float) -> None:
    """Compare existing topics' configs with their specs, in one DescribeConfigs request for all."""
    if not specs:
        return
    resources = {s.name: ConfigResource(ConfigResource.Type.TOPIC, s.name) for s in specs}
    futures = admin.describe_configs(list(resources.values()), request_timeout=timeout_s)
    for s in specs:
        try:
            entries = futures[resources[s.name]].result(timeout=timeout_s)
        except KafkaException as exc:
            raise TopicDeclarationFailed(f"describing the configs of {s.name!r}: {exc.args[0].str()}") from exc
        for key, expected in s.config.items():
            entry = entries.get(key)
            actual = entry.value if entry is not None else None
            if _same(key, expected, actual):
                continue
            if kept_forever(s) and key in RETENTION_KEYS:
                raise TopicConfigMismatch(s.name, key, expected, actual)
            # Not changed here either: an operator's change (kafka-configs) that may be deliberate.
            log.warning("topic_config_differs", topic=s.name, key=key, expected=expected, actual=actual)
