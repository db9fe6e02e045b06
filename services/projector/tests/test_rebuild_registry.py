"""A rebuild reads a log in the schema registry's wire format, and never swaps in a read model it
could not decode: real broker, PostgreSQL and the stand-in registry."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry

from tether_messaging.partitioner import partition_for
from tether_messaging.registry import RegistryCodec, SchemaRegistryClient
from tether_messaging.serde import SingleObjectCodec
from tether_projector.adapters.postgres import PostgresReadModel
from tether_projector.domain.rows import TABLE_KEYS
from tether_projector.metrics import ProjectorMetrics
from tether_projector.rebuild import RebuildFailed, rebuild
from tether_projector.testing import happy_run, troubled_run

PARTITIONS = 2


def dump(dsn: str, schema: str) -> dict[str, list[dict]]:
    model = PostgresReadModel(dsn, schema)
    try:
        return {table: model.rows(table) for table in TABLE_KEYS}
    finally:
        model.close()


@pytest.fixture
def target_schema(pg_dsn: str) -> Iterator[str]:
    schema = f"test_rb_{uuid.uuid4().hex[:10]}"
    yield schema
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for s in (schema, f"{schema}__rebuild"):
            conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')


@pytest.mark.integration
def test_a_registry_format_log_rebuilds_whole_and_without_the_registry_the_target_is_left_alone(
    kafka_bootstrap: str, kafka_topics, pg_dsn: str, schema_registry, target_schema: str,
) -> None:
    url, _ = schema_registry
    topic = kafka_topics.create("rebuild-registry", partitions=PARTITIONS)
    u = uuid.uuid4().hex[:6]
    logs = [happy_run(f"run-a-{u}", "tenant-a"), troubled_run(f"run-b-{u}", "tenant-b")]
    # Each run's first half written before the deployment set TETHER_SCHEMA_REGISTRY_URL, the
    # rest after: the log holds both wire formats, as a real one would after the switch.
    registry_codec = RegistryCodec(SchemaRegistryClient(url))
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for log in logs:
        half = len(log.events) // 2
        for i, env in enumerate(log.events):
            codec = SingleObjectCodec() if i < half else registry_codec
            producer.produce(topic, codec.encode_value(env, topic), env.run_id.encode(),
                             partition=partition_for(env.tenant_id, env.run_id, PARTITIONS))
    assert producer.flush(30) == 0
    registry_codec.client.close()
    expected = sum(len(log.events) for log in logs)

    def replay(registry_url: str | None):
        return rebuild(bootstrap=kafka_bootstrap, topic=topic, dsn=pg_dsn, target_schema=target_schema,
                       group_id=f"test-rebuild-{u}", metrics=ProjectorMetrics(CollectorRegistry()),
                       schema_registry_url=registry_url, batch_size=7, idle_timeout_s=120)

    report = replay(url)
    assert (report.records, report.applied, report.undecodable, report.chain_problems) == (expected, expected, 0, 0)
    first = dump(pg_dsn, target_schema)
    assert len(first["events"]) == expected
    assert {r["run_id"]: r["status"] for r in first["runs"]} == {logs[0].run_id: "COMPLETED",
                                                                 logs[1].run_id: "TERMINATED"}

    # Without the registry the framed half cannot be read: the rebuild fails, saying what to set,
    # and the read model built above is still there, whole (before the fix it was replaced by
    # one holding only the single-object half).
    with pytest.raises(RebuildFailed, match="registry's wire format: set TETHER_SCHEMA_REGISTRY_URL"):
        replay(None)
    assert dump(pg_dsn, target_schema) == first

    # A registry that cannot be reached is not a reason to skip records either.
    with pytest.raises(RebuildFailed, match="schema registry unavailable"):
        replay("http://127.0.0.1:9")
    assert dump(pg_dsn, target_schema) == first
