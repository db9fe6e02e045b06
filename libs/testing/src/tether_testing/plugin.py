"""pytest plugin: the real Kafka, PostgreSQL and Redis for a test session, unique topics and schemas, service processes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tether_testing.kafka import KafkaTopics
from tether_testing.postgres import PgSchema, create_schema, drop_schema
from tether_testing.processes import ServiceProcesses
from tether_testing.schema_registry import RegistryState, stand_in_registry
from tether_testing.stack import LocalStack, Stack, StackUnavailable, find_repo_root


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tether")
    group.addoption(
        "--testcontainers", action="store_true", default=False,
        help="run Kafka, PostgreSQL and Redis in Docker through testcontainers instead of the local stack",
    )


@pytest.fixture(scope="session")
def tether_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The session's backing services.

    Default: the addresses in TETHER_KAFKA_BOOTSTRAP / TETHER_PG_DSN / TETHER_REDIS_URL (or the
    loopback defaults built from TETHER_*_PORT) when they answer; otherwise the project's local
    stack (deploy/local/stack.py) is started on those ports, and only what this session started is
    stopped at its end. With --testcontainers: containers, stopped at the end.
    """
    if request.config.getoption("--testcontainers"):
        # Imported only here: testcontainers needs a Docker engine, which most machines here lack.
        from tether_testing.containers import ContainerStack

        stack: Stack = ContainerStack()
    else:
        try:
            root = find_repo_root(request.config.rootpath)
        except StackUnavailable:
            try:
                root = find_repo_root(Path(__file__).resolve().parent)
            except StackUnavailable as err:
                pytest.fail(str(err), pytrace=False)
        stack = LocalStack(root, os.environ)
    yield stack
    stack.close()


@pytest.fixture(scope="session")
def _tether_env() -> Iterator[pytest.MonkeyPatch]:
    # Service processes started by tests inherit the resolved addresses through the environment.
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()


def _resolve(what: str, get: Callable[[], str]) -> str:
    try:
        return get()
    except StackUnavailable as err:
        pytest.fail(f"{what} is unavailable: {err}", pytrace=False)
    except Exception as err:  # e.g. no Docker engine with --testcontainers
        pytest.fail(f"{what} could not be started: {type(err).__name__}: {err}", pytrace=False)


@pytest.fixture(scope="session")
def kafka_bootstrap(tether_stack: Stack, _tether_env: pytest.MonkeyPatch) -> str:
    """Bootstrap servers of a Kafka broker that answers (also exported as TETHER_KAFKA_BOOTSTRAP, with
    TETHER_TOPIC_REPLICATION_FACTOR=1 unless set)."""
    address = _resolve("Kafka", tether_stack.kafka)
    _tether_env.setenv("TETHER_KAFKA_BOOTSTRAP", address)
    # The local stack and the testcontainers one run a single broker: service processes a test
    # starts declare their topics with one replica (services default to 3) unless told otherwise.
    _tether_env.setenv("TETHER_TOPIC_REPLICATION_FACTOR", os.environ.get("TETHER_TOPIC_REPLICATION_FACTOR", "1"))
    return address


@pytest.fixture(scope="session")
def pg_dsn(tether_stack: Stack, _tether_env: pytest.MonkeyPatch) -> str:
    """DSN of a PostgreSQL database that answers (also exported as TETHER_PG_DSN)."""
    dsn = _resolve("PostgreSQL", tether_stack.postgres)
    _tether_env.setenv("TETHER_PG_DSN", dsn)
    return dsn


@pytest.fixture(scope="session")
def redis_url(tether_stack: Stack, _tether_env: pytest.MonkeyPatch) -> str:
    """URL of a Redis server that answers (also exported as TETHER_REDIS_URL)."""
    url = _resolve("Redis", tether_stack.redis)
    _tether_env.setenv("TETHER_REDIS_URL", url)
    return url


@pytest.fixture
def pg_schema(pg_dsn: str) -> Iterator[PgSchema]:
    """A fresh schema for this test (dropped afterwards); `pg_schema.dsn` makes it the search_path."""
    schema = create_schema(pg_dsn)
    yield schema
    drop_schema(schema)


@pytest.fixture
def kafka_topics(kafka_bootstrap: str) -> Iterator[KafkaTopics]:
    """Creates uniquely named topics on demand (`kafka_topics.create("prefix")`); deletes them afterwards."""
    topics = KafkaTopics(kafka_bootstrap)
    yield topics
    topics.delete_all()


@pytest.fixture
def service_processes(tmp_path: Path) -> Iterator[ServiceProcesses]:
    """Starts real service processes (logs under tmp_path/services); stops every one at teardown."""
    processes = ServiceProcesses(tmp_path / "services")
    yield processes
    processes.stop_all()


@pytest.fixture
def schema_registry() -> Iterator[tuple[str, RegistryState]]:
    """A stand-in Confluent Schema Registry on 127.0.0.1 (tether_testing.schema_registry): (base URL, its state)."""
    with stand_in_registry() as served:
        yield served
