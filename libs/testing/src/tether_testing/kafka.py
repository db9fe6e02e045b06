"""Uniquely named Kafka topics for one test, created with AdminClient and deleted afterwards."""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from tether_testing.names import unique_name

_TIMEOUT_S = 60.0


class KafkaTopics:
    """Creates topics with unique names on a real broker and deletes every one of them on `delete_all`."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self._admin = AdminClient({"bootstrap.servers": bootstrap})
        self.created: list[str] = []

    def create(self, prefix: str = "test", *, partitions: int = 1, config: Mapping[str, str] | None = None) -> str:
        """Create `<prefix>-<random>` (replication factor 1) and return its name once the broker has it."""
        name = unique_name(prefix)
        topic = NewTopic(name, num_partitions=partitions, replication_factor=1, config=dict(config or {}))
        self._admin.create_topics([topic], operation_timeout=_TIMEOUT_S)[name].result(timeout=_TIMEOUT_S)
        self.created.append(name)
        return name

    def list(self) -> set[str]:
        """Names of every topic the broker reports."""
        return set(self._admin.list_topics(timeout=_TIMEOUT_S).topics)

    def delete_all(self) -> None:
        """Delete the topics this helper created; a topic someone else already deleted is fine."""
        if not self.created:
            return
        futures = self._admin.delete_topics(self.created, operation_timeout=_TIMEOUT_S)
        self.created = []
        for future in futures.values():
            try:
                future.result(timeout=_TIMEOUT_S)
            except KafkaException as err:
                if err.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise
