"""The shared network deadline on real loopback servers: it bounds every read (a quiet or dripping server),
a call whose deadline has passed connects to nothing, and a resolver chooses the addresses connected to."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpcore
import httpx
import pytest

from tether_runtime.deadline import DeadlineBackend, deadline_transport, network_deadline

LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=2, keepalive_expiry=5.0)
#: Far longer than any deadline here: only the deadline can end these calls early.
READ_TIMEOUT_S = 60.0


class Server:
    """A loopback HTTP server that answers each connection as `mode` says: "ok", "quiet" (reads the
    request, never answers) or "drip" (sends the headers, then a byte of body every 50 ms, for ever)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                if self.mode == "ok":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                elif self.mode == "drip":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                    while not self._stop.wait(0.05):
                        conn.sendall(b"x")
                else:
                    self._stop.wait()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.fixture
def server(request) -> Iterator[Server]:
    running = Server(request.param)
    yield running
    running.close()


def client(backend: httpcore.NetworkBackend | None = None) -> httpx.Client:
    return httpx.Client(transport=deadline_transport(limits=LIMITS, trust_env=False, backend=backend),
                        timeout=READ_TIMEOUT_S, trust_env=False)


@pytest.mark.parametrize("server", ["quiet", "drip"], indirect=True)
def test_the_deadline_bounds_every_read_whatever_the_read_timeout(server):
    # A quiet server never trips the 60 s read timeout before the deadline; a dripping one never trips it at all.
    with client() as http, pytest.raises(httpx.ReadTimeout), \
            network_deadline(time.monotonic() + 0.5, "the test call") as deadline:
        http.get(f"http://127.0.0.1:{server.port}/").read()
    assert deadline.cut  # the deadline, not the server's read timeout, ended it


@pytest.mark.parametrize("server", ["ok"], indirect=True)
def test_a_call_whose_deadline_passed_connects_to_nothing(server):
    with client() as http, pytest.raises(httpx.ConnectTimeout, match="the test call's deadline passed"), \
            network_deadline(time.monotonic() - 1, "the test call") as deadline:
        http.get(f"http://127.0.0.1:{server.port}/")
    assert deadline.cut and server.connections == 0


@pytest.mark.parametrize("server", ["ok"], indirect=True)
def test_a_call_inside_its_deadline_and_one_outside_any_both_get_their_answer(server):
    with client() as http:
        with network_deadline(time.monotonic() + 10 * READ_TIMEOUT_S) as deadline:
            assert http.get(f"http://127.0.0.1:{server.port}/").text == "ok"
        assert not deadline.cut  # the configured timeouts were the shorter bound throughout
        assert http.get(f"http://127.0.0.1:{server.port}/").text == "ok"


@pytest.mark.parametrize("server", ["ok"], indirect=True)
def test_a_resolver_chooses_the_addresses_connected_to(server):
    asked: list[tuple[str, int]] = []

    def resolve(host: str, port: int, timeout: float | None) -> list[str]:
        asked.append((host, port))
        return ["127.0.0.1"]

    with client(DeadlineBackend(resolve=resolve)) as http, network_deadline(time.monotonic() + READ_TIMEOUT_S):
        assert http.get(f"http://tools.invalid:{server.port}/").text == "ok"
    assert asked == [("tools.invalid", server.port)]
