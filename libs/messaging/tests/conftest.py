"""Fixtures of the messaging tests: the real local Kafka and per-test topic isolation."""

from __future__ import annotations

import os
import uuid

import pytest
from confluent_kafka.admin import AdminClient


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """Address of the running dev/CI broker; the test fails loudly if it is not reachable."""
    bootstrap = os.environ.get("TETHER_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    except Exception as exc:  # KafkaException on timeout
        pytest.fail(f"Kafka at {bootstrap} is not reachable (start the local stack): {exc}")
    return bootstrap


@pytest.fixture
def topic_prefix(request: pytest.FixtureRequest) -> str:
    """A prefix no other test run uses, for topics, consumer groups and transactional ids."""
    return f"test-{request.node.name[:40].replace('[', '-').replace(']', '')}-{uuid.uuid4().hex[:10]}."
