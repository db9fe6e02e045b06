"""The session fixtures hand out a Kafka, PostgreSQL and Redis that really answer."""

from __future__ import annotations

import psycopg
import pytest
import redis
from confluent_kafka import Consumer, Producer

from tether_testing import unique_name
from tether_testing.postgres import create_schema, drop_schema

pytestmark = pytest.mark.integration


def test_kafka_lists_topics_and_round_trips_a_record(kafka_bootstrap, kafka_topics):
    topic = kafka_topics.create("tether-testing")
    assert topic in kafka_topics.list()

    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    producer.produce(topic, key=b"run-1", value=b"hello")
    assert producer.flush(30) == 0

    consumer = Consumer({
        "bootstrap.servers": kafka_bootstrap, "group.id": unique_name("tether-testing"),
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
    })
    try:
        consumer.subscribe([topic])
        msg = None
        for _ in range(60):
            msg = consumer.poll(1.0)
            if msg is not None:
                break
        assert msg is not None and msg.error() is None
        assert (msg.key(), msg.value()) == (b"run-1", b"hello")
    finally:
        consumer.close()


def test_kafka_topics_are_deleted_after_the_test(kafka_bootstrap):
    from tether_testing.kafka import KafkaTopics

    topics = KafkaTopics(kafka_bootstrap)
    name = topics.create("tether-testing-del")
    topics.delete_all()
    assert name not in KafkaTopics(kafka_bootstrap).list()


def test_postgres_answers(pg_dsn):
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_pg_schema_is_the_search_path_and_is_dropped(pg_dsn):
    schema = create_schema(pg_dsn)
    with psycopg.connect(schema.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE runs (run_id text PRIMARY KEY)")
        conn.execute("INSERT INTO runs VALUES ('r1')")
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(f'SELECT run_id FROM "{schema.name}".runs').fetchone()
        assert row == ("r1",)
    drop_schema(schema)
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema.name,)).fetchone()
    assert found is None


def test_pg_schema_fixture_gives_an_empty_schema(pg_schema):
    with psycopg.connect(pg_schema.dsn) as conn:
        current = conn.execute("SELECT current_schema()").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = %s", (pg_schema.name,)).fetchone()
    assert (current, tables) == (pg_schema.name, (0,))


def test_redis_answers(redis_url):
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.ping() is True
    finally:
        client.close()


def test_resolved_addresses_are_exported_for_service_processes(kafka_bootstrap, pg_dsn, redis_url):
    import os

    assert (os.environ["TETHER_KAFKA_BOOTSTRAP"], os.environ["TETHER_PG_DSN"], os.environ["TETHER_REDIS_URL"]) == (
        kafka_bootstrap, pg_dsn, redis_url)
