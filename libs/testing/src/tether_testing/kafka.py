"""Uniquely named Kafka topics for one test, created with AdminClient and deleted afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from tether_testing.names import unique_name

_TIMEOUT_S = 60.0


class TopicNotReady(Exception):
    """A created or deleted topic did not show up as such in the broker's metadata in time."""


class KafkaTopics:
    """Creates topics with unique names on a real broker and deletes every one of them on `delete_all`."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._admin = AdminClient({"bootstrap.servers": bootstrap})
        self.created: list[str] = []

    def create(self, prefix: str = "test", *, partitions: int = 1, config: Mapping[str, str] | None = None) -> str:
        """Create `<prefix>-<random>` (replication factor 1); return once every partition has a leader."""
        name = unique_name(prefix)
        topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=dict(config or {}))
        self._admin.create_topics([topic], operation_timeout=_TIMEOUT_S)[name].result(timeout=_TIMEOUT_S)
        self.created.append(name)
        # The controller has the topic now; the broker's metadata follows a moment later.
        self._wait(lambda: self._ready(name, partitions), f"topic {name} to have leaders for {partitions} partitions")
        return name

    def list(self) -> set[str]:
        """Names of every topic the broker reports."""
        return set(self._admin.list_topics(timeout=_TIMEOUT_S).topics)

    def delete_all(self) -> None:
        """Delete the topics this helper created (one already deleted is fine); return once they are gone."""
        if not self.created:
            return
        names, self.created = self.created, []
        futures = self._admin.delete_topics(names, operation_timeout=_TIMEOUT_S)
        for future in futures.values():
            try:
                future.result(timeout=_TIMEOUT_S)
            except KafkaException as err:
                if err.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise
        self._wait(lambda: not (set(names) & self.list()), f"topics {names} to disappear")

    def _ready(self, name: str, partitions: int) -> bool:
        meta = self._admin.list_topics(topic=name, timeout=_TIMEOUT_S).topics.get(name)
        return (meta is not None and meta.error is None and len(meta.partitions) == partitions
                and all(p.leader >= 0 for p in meta.partitions.values()))

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        while not done():
            if time.monotonic() > deadline:
                raise TopicNotReady(f"waited {_TIMEOUT_S:.0f}s for {what} on {self.bootstrap}")
            time.sleep(0.1)


def committed_records(bootstrap: str, topic: str, partitions: int, *, timeout_s: float = 30.0,
                      require_end: bool = True) -> list:
    """Every committed record (read_committed) of `topic`, from offset 0 to the end of each of its
    `partitions`, in partition and offset order. With `require_end`, AssertionError if a partition
    was not read to its end within `timeout_s`."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}.check", "enable.partition.eof": True,
                       "isolation.level": "read_committed", "enable.auto.commit": False})
    reader.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out: list = []
    at_end: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(at_end) < partitions and time.monotonic() < deadline:
            msg = reader.poll(0.2)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
                continue
            out.append(msg)
    finally:
        reader.close()
    assert not require_end or len(at_end) == partitions, f"{topic} not read to its end in {timeout_s:.0f}s"
    return sorted(out, key=lambda m: (m.partition(), m.offset()))


def latest_values(bootstrap: str, topic: str, partitions: int, *, timeout_s: float = 30.0) -> dict[bytes, bytes | None]:
    """The last committed value of each key of `topic` (a changelog's current states; None for a
    tombstone), read from offset 0 to the end of every partition (read_committed)."""
    records = committed_records(bootstrap, topic, partitions, timeout_s=timeout_s, require_end=False)
    return {msg.key(): msg.value() for msg in records}


def set_topic_configs(bootstrap: str, topics: list[str], configs: Mapping[str, str], *,
                      timeout_s: float = 30.0) -> None:
    """Set `configs` on `topics` (what an operator does with kafka-configs) and wait until the
    broker shows them: a change is committed to the metadata log before the broker applies it,
    so a describe (or a produce checked against the limit) right after may still see the old value."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t, incremental_configs=[
        ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in configs.items()])
        for t in topics]
    for future in admin.incremental_alter_configs(resources).values():
        future.result(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    pending = list(topics)
    while pending:
        described = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t) for t in pending])
        pending = [res.name for res, fut in described.items()
                   if any(fut.result(timeout=timeout_s)[k].value != v for k, v in configs.items())]
        if pending:
            assert time.monotonic() < deadline, f"{dict(configs)} not applied to {pending} in {timeout_s} s"
            time.sleep(0.2)
