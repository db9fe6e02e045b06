"""Where a test session's Kafka, PostgreSQL and Redis are: the configured ones if they answer, else the local stack."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import psycopg
import redis
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from psycopg.conninfo import conninfo_to_dict

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_UP_TIMEOUT_S = 300


class StackUnavailable(Exception):
    """A backing service neither answered at its configured address nor could be started; says why."""


class Stack(Protocol):
    """The session's backing services; each accessor returns an address that answers."""

    def kafka(self) -> str:
        """Kafka bootstrap servers (host:port)."""

    def postgres(self) -> str:
        """PostgreSQL DSN for user tether, database tether."""

    def redis(self) -> str:
        """Redis URL."""

    def close(self) -> None:
        """Release what this object started, and nothing else."""


@dataclass(frozen=True)
class _Service:
    component: str  # the name deploy/local/stack.py knows it by
    address_env: str
    port_env: str
    default_port: int


KAFKA = _Service("kafka", "TETHER_KAFKA_BOOTSTRAP", "TETHER_KAFKA_PORT", 9092)
POSTGRES = _Service("postgres", "TETHER_PG_DSN", "TETHER_PG_PORT", 5432)
REDIS = _Service("redis", "TETHER_REDIS_URL", "TETHER_REDIS_PORT", 6379)


def find_repo_root(start: Path) -> Path:
    """The nearest ancestor of `start` holding deploy/local/stack.py."""
    for candidate in (start, *start.parents):
        if (candidate / "deploy" / "local" / "stack.py").is_file():
            return candidate
    raise StackUnavailable(f"no deploy/local/stack.py above {start}: cannot start the local stack")


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _host_port(service: _Service, address: str) -> tuple[str, int]:
    if service is KAFKA:
        host, _, port = address.split(",")[0].strip().rpartition(":")
        return host.strip("[]"), int(port)
    if service is POSTGRES:
        params = conninfo_to_dict(address)
        return params.get("host", "127.0.0.1"), int(params.get("port", 5432))
    parts = urlsplit(address)
    return parts.hostname or "127.0.0.1", parts.port or 6379


def answers(service: _Service, address: str) -> str | None:
    """None if the service answers at `address`, else the reason it does not."""
    host, port = _host_port(service, address)
    if not _tcp_open(host, port):
        return f"nothing accepts connections on {host}:{port}"
    try:
        if service is KAFKA:
            AdminClient({"bootstrap.servers": address}).list_topics(timeout=10)
        elif service is POSTGRES:
            with psycopg.connect(address, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
        else:
            redis.Redis.from_url(address, socket_connect_timeout=3, socket_timeout=5).ping()
    except (KafkaException, psycopg.Error, redis.RedisError) as err:
        return f"{type(err).__name__}: {err}"
    return None


class LocalStack:
    """Uses the configured addresses when they answer; otherwise starts the project's local stack
    (deploy/local/stack.py) on the configured loopback ports, and on `close` stops only what it started."""

    def __init__(self, repo_root: Path, environ: Mapping[str, str]) -> None:
        self._repo = repo_root
        self._env = dict(environ)
        self._addresses: dict[str, str] = {}
        self._started: list[str] = []

    def _default_address(self, service: _Service) -> str:
        port = self._env.get(service.port_env) or str(service.default_port)
        return {
            "kafka": f"127.0.0.1:{port}",
            "postgres": f"postgresql://tether@127.0.0.1:{port}/tether",
            "redis": f"redis://127.0.0.1:{port}/0",
        }[service.component]

    def _ensure(self, service: _Service) -> str:
        if service.component in self._addresses:
            return self._addresses[service.component]
        address = self._env.get(service.address_env) or self._default_address(service)
        reason = answers(service, address)
        if reason is not None:
            host, port = _host_port(service, address)
            if host not in LOOPBACK:
                raise StackUnavailable(
                    f"{service.address_env}={address} does not answer ({reason}) and is not on this "
                    "machine, so the local stack cannot stand in for it")
            self._start(service, port)
            reason = answers(service, address)
            if reason is not None:
                raise StackUnavailable(f"{service.component} was started but {address} does not answer: {reason}")
        self._addresses[service.component] = address
        return address

    def _start(self, service: _Service, port: int) -> None:
        script = self._repo / "deploy" / "local" / "stack.py"
        cmd = [sys.executable, str(script), "up", service.component, "--json"]
        env = {**self._env, service.port_env: str(port)}
        try:
            done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=_UP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise StackUnavailable(f"`{' '.join(cmd)}` did not finish within {_UP_TIMEOUT_S}s") from None
        if done.returncode != 0:
            raise StackUnavailable(
                f"could not start {service.component} on 127.0.0.1:{port} with `{' '.join(cmd)}` "
                f"(exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        if json.loads(done.stdout)[service.component]["started"]:
            self._started.append(service.component)
            self._env[service.port_env] = str(port)

    def kafka(self) -> str:
        return self._ensure(KAFKA)

    def postgres(self) -> str:
        return self._ensure(POSTGRES)

    def redis(self) -> str:
        return self._ensure(REDIS)

    @property
    def started(self) -> list[str]:
        """Components this object started (and will stop on close)."""
        return list(self._started)

    def close(self) -> None:
        if not self._started:
            return
        script = self._repo / "deploy" / "local" / "stack.py"
        cmd = [sys.executable, str(script), "down", *self._started]
        done = subprocess.run(cmd, env=self._env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=_UP_TIMEOUT_S)
        self._started = []
        if done.returncode != 0:
            raise StackUnavailable(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")


def local_stack(start: Path) -> LocalStack:
    """A LocalStack for the repository above `start`, configured from this process's environment."""
    return LocalStack(find_repo_root(start), os.environ)
