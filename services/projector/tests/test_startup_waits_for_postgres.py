"""`python -m tether_projector` started while PostgreSQL cannot be reached waits for it (alive, not ready), then serves."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tether_projector.adapters.postgres import PostgresReadModel
from tether_testing.processes import ServiceProcess, free_port


class TcpForwarder:
    """Forwards connections on a local port to PostgreSQL: the database 'comes up' at that address
    when it starts listening (before, connections are refused, as when the database is down)."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", port))
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed.set()
        for s in self.sockets:
            s.close()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.integration
def test_the_projector_waits_for_postgresql_not_ready_and_serves_once_it_answers(
    kafka_bootstrap: str, pg_dsn: str, redis_url: str, tmp_path: Path
) -> None:
    real = conninfo_to_dict(pg_dsn)
    db_port = free_port()  # nothing listens there yet
    tag = uuid.uuid4().hex[:10]
    schema = f"test_rm_{tag}"
    health_port = free_port()
    projector = ServiceProcess(
        "tether_projector", health_port=health_port, log_dir=tmp_path,
        env={
            "TETHER_KAFKA_BOOTSTRAP": kafka_bootstrap,
            "TETHER_PG_DSN": make_conninfo(pg_dsn, host="127.0.0.1", port=str(db_port), connect_timeout="5"),
            "TETHER_REDIS_URL": redis_url,
            "TETHER_TOPIC_PREFIX": f"test-{tag}.",
            "TETHER_PARTITIONS": "2",
            "TETHER_PROJECTOR_READ_MODEL_SCHEMA": schema,
            "TETHER_PROJECTOR_REDIS_KEY_PREFIX": f"test-{tag}:",
            "TETHER_PROJECTOR_METRICS_PORT": str(health_port),
            "TETHER_PROJECTOR_SESSION_TIMEOUT_MS": "6000",
        },
    )
    readyz = f"http://127.0.0.1:{health_port}/readyz"
    forwarder = None
    try:
        projector.start(timeout=120)  # /healthz answers although the database does not
        deadline = time.monotonic() + 60
        while projector.log_text().count('"dependency_unavailable"') < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert projector.log_text().count('"dependency_unavailable"') >= 2, projector.log_text()[-2000:]
        assert projector.running, "the projector exited instead of waiting for PostgreSQL"
        assert _status(readyz) == 503

        forwarder = TcpForwarder(db_port, (real.get("host") or "127.0.0.1", int(real.get("port") or 5432)))
        deadline = time.monotonic() + 120
        while _status(readyz) != 200 and projector.running and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _status(readyz) == 200, projector.log_text()[-2000:]
        assert '"dependency_available"' in projector.log_text()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            assert conn.execute("SELECT to_regclass(%s)", (f"{schema}.runs",)).fetchone()[0] is not None
    finally:
        projector.stop()
        if forwarder is not None:
            forwarder.close()
        model = PostgresReadModel(pg_dsn, schema)
        model.drop_schema()
        model.close()
