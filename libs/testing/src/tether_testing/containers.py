"""The --testcontainers path: Kafka, PostgreSQL and Redis in Docker, for machines that have a Docker engine."""

from __future__ import annotations

from testcontainers.community.kafka import KafkaContainer
from testcontainers.community.postgres import PostgresContainer
from testcontainers.community.redis import RedisContainer

# Kafka 3.9 in KRaft mode (testcontainers' KafkaContainer drives Confluent's image scripts).
KAFKA_IMAGE = "confluentinc/cp-kafka:7.9.0"
POSTGRES_IMAGE = "postgres:15"
REDIS_IMAGE = "redis:7"


class ContainerStack:
    """Starts each container on first use and stops every container it started on `close`."""

    def __init__(self) -> None:
        self._kafka: KafkaContainer | None = None
        self._postgres: PostgresContainer | None = None
        self._redis: RedisContainer | None = None

    def kafka(self) -> str:
        if self._kafka is None:
            container = (
                KafkaContainer(KAFKA_IMAGE)
                .with_kraft()
                # Same broker behaviour as deploy/local: declared topics only, single-replica internals.
                .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
                .with_env("KAFKA_NUM_PARTITIONS", "6")
                .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
                .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
            )
            container.start(timeout=180)
            self._kafka = container
        return self._kafka.get_bootstrap_server()

    def postgres(self) -> str:
        if self._postgres is None:
            container = PostgresContainer(POSTGRES_IMAGE, username="tether", password="tether", dbname="tether",
                                          driver=None)
            container.start()
            self._postgres = container
        return self._postgres.get_connection_url()

    def redis(self) -> str:
        if self._redis is None:
            container = RedisContainer(REDIS_IMAGE)
            container.start()
            self._redis = container
        host = self._redis.get_container_host_ip()
        return f"redis://{host}:{self._redis.get_exposed_port(self._redis.port)}/0"

    def close(self) -> None:
        containers = [c for c in (self._kafka, self._postgres, self._redis) if c is not None]
        self._kafka = self._postgres = self._redis = None
        failures = []
        for container in containers:
            try:
                container.stop()
            except Exception as err:  # stop the others anyway, then report
                failures.append(err)
        if failures:
            raise failures[0]
