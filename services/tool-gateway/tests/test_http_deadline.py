"""An HTTP tool call ends with TIMEOUT at its deadline in every phase, however the server drips its answer
(httpx's timeouts are per socket operation, not per request)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Sequence

import httpx
import pytest

from tether_contracts.records import RiskClass, ToolSpec
from tether_tool_gateway.builtin_tools import http_get_spec, kv_get_spec, kv_put_spec
from tether_tool_gateway.domain.errors import ToolError
from tether_tool_gateway.executors.builtin import BuiltinExecutor, _tls
from tether_tool_gateway.executors.http_deadline import deadline_transport
from tether_tool_gateway.executors.http_tool import HttpToolExecutor
from tether_tool_gateway.ports import ExecutionRequest, MappingSecretProvider

DRIP_S = 0.05
BYTES = 600  # a dripped body takes BYTES * DRIP_S = 30 s to arrive
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"

#: The body one byte per DRIP_S.
DRIPPED_BODY = [(0.0, HEAD % BYTES)] + [(DRIP_S, b" ")] * BYTES
#: The status line, then a header one byte per DRIP_S for 30 s: each read gets a byte well within any read timeout.
DRIPPED_HEADERS = ([(0.0, b"HTTP/1.1 200 OK\r\nX-Slow: ")] + [(DRIP_S, b"a")] * 600
                   + [(0.0, b"\r\nContent-Length: 2\r\n\r\n{}")])
#: The KV store's answer to a get or a put, after 30 s of dripped whitespace.
KV_ANSWER = b'{"value":1,"version":1}'
DRIPPED_KV_BODY = [(0.0, HEAD % (600 + len(KV_ANSWER)))] + [(DRIP_S, b" ")] * 600 + [(0.0, KV_ANSWER)]


class ScriptedServer:
    """A loopback HTTP server answering every request with `script`: (pause in seconds, bytes) steps sent in order."""

    def __init__(self, script: Sequence[tuple[float, bytes]]) -> None:
        self._script = script
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="scripted-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(1)
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(4096)
        head, _, body = request.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(4096)
        try:
            for pause, data in self._script:
                if pause and self.stop.wait(pause):
                    return
                conn.sendall(data)
        except OSError:  # the client gave up and closed the connection
            return

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        assert not self._thread.is_alive()


@pytest.fixture
def serve():
    servers: list[ScriptedServer] = []

    def start(script: Sequence[tuple[float, bytes]]) -> ScriptedServer:
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def request(tool: ToolSpec, args) -> ExecutionRequest:
    return ExecutionRequest(tool=tool, args=args, idem_key="k" * 64, run_id="run-1", tenant_id="t1", call_id="1.0",
                            attempt=1, timeout_s=tool.timeout_ms / 1000)


def timed(executor, req: ExecutionRequest) -> tuple[ToolError, float]:
    started = time.monotonic()
    with pytest.raises(ToolError) as caught:
        executor.execute(req, MappingSecretProvider())
    return caught.value, time.monotonic() - started


def http_get_call(port: int, timeout_ms: int, host: str = "127.0.0.1") -> tuple[BuiltinExecutor, ExecutionRequest]:
    tool = http_get_spec([host], timeout_ms=timeout_ms)
    return BuiltinExecutor(), request(tool, {"url": f"http://{host}:{port}/"})


def http_tool_call(port: int, timeout_ms: int, host: str = "127.0.0.1",
                   idempotent: bool = False) -> tuple[HttpToolExecutor, ExecutionRequest]:
    tool = ToolSpec(name="team_lookup", version=1, description="d", args_schema_json='{"type":"object"}',
                    risk_class=RiskClass.READ_ONLY, idempotent=idempotent, untrusted_source=False, executor_kind="http",
                    executor_config_json=json.dumps({"url": f"http://{host}:{port}/lookup"}),
                    timeout_ms=timeout_ms + 250)  # the executor gives up 0.25 s before the tool's timeout
    return HttpToolExecutor(), request(tool, {"q": "x"})


def idempotent_http_tool_call(port: int, timeout_ms: int) -> tuple[HttpToolExecutor, ExecutionRequest]:
    return http_tool_call(port, timeout_ms, idempotent=True)


CALLS = pytest.mark.parametrize("call", [http_get_call, http_tool_call], ids=["http_get", "http_tool"])
#: A body that comes too late after a 2xx fails only these: a non-idempotent HTTP tool completes (below).
BODY_CALLS = pytest.mark.parametrize("call", [http_get_call, idempotent_http_tool_call], ids=["http_get", "http_tool"])


@BODY_CALLS
def test_a_dripping_body_times_out_at_the_deadline(serve, call):
    executor, req = call(serve(DRIPPED_BODY).port, 500)
    error, elapsed = timed(executor, req)
    assert error.code == "TIMEOUT" and error.retryable
    assert error.effect_unknown  # the request was sent: a non-idempotent call's outcome is unknown
    assert elapsed < 10  # near the 0.5 s deadline (loose: a loaded machine), not when the body was complete (30 s)


@CALLS
def test_dripping_headers_time_out_at_the_deadline(serve, call):
    executor, req = call(serve(DRIPPED_HEADERS).port, 1000)
    error, elapsed = timed(executor, req)
    assert error.code == "TIMEOUT" and error.retryable and error.effect_unknown
    assert elapsed < 10  # near the 1 s deadline; the headers would have taken 30 s


@BODY_CALLS
def test_a_read_started_just_before_the_deadline_ends_at_the_deadline(serve, call):
    # The body's first byte comes at 5.8 s, within the read timeout (the 6 s of the call); then nothing for 30 s.
    # A read timeout of its own would let the next read wait until 5.8 + 6 = 11.8 s; the deadline ends it at 6 s.
    # (Wide margins both sides: on a loaded machine setting the call up can take a second or two.)
    executor, req = call(serve([(0.0, HEAD % 2), (5.8, b" "), (30.0, b" ")]).port, 6000)
    error, elapsed = timed(executor, req)
    assert error.code == "TIMEOUT" and error.retryable and error.effect_unknown
    assert elapsed < 10.0


def test_a_non_idempotent_tools_dripping_2xx_body_ends_at_the_deadline_as_a_completed_call(serve):
    # The 200 says the effect took place: the call completes, its result saying the body did not arrive.
    executor, req = http_tool_call(serve(DRIPPED_BODY).port, 500)
    result = executor.execute(req, MappingSecretProvider())
    assert result["status"] == 200 and result["body"] is None
    assert result["body_unreadable"]["code"] == "TIMEOUT"


@pytest.mark.parametrize(("spec", "args"), [(kv_get_spec, {"key": "k"}), (kv_put_spec, {"key": "k", "value": 1})],
                         ids=["kv_get", "kv_put"])
def test_a_kv_store_dripping_its_answer_times_out_at_the_deadline(serve, spec, args):
    server = serve(DRIPPED_KV_BODY)
    tool = spec(f"http://127.0.0.1:{server.port}", timeout_ms=1000)
    error, elapsed = timed(BuiltinExecutor(), request(tool, args))
    assert error.code == "TIMEOUT" and error.retryable
    assert elapsed < 10  # near the 1 s deadline; the answer would have taken 30 s
    # The KV client is shared by every call: the next call, to a prompt store, is not hurt by the one that overran.
    prompt = serve([(0.0, HEAD % len(KV_ANSWER) + KV_ANSWER)])
    result = BuiltinExecutor().execute(request(spec(f"http://127.0.0.1:{prompt.port}"), args), MappingSecretProvider())
    assert result["version"] == 1


#: A name whose lookup never answers (`dns_hangs`), as when the DNS server drops the queries.
HANGING_HOST = "tool.hangs.test"


@pytest.fixture
def dns_hangs(monkeypatch):
    """socket.getaddrinfo does not answer for HANGING_HOST (for 30 s, then fails as a resolver that gave up);
    other names resolve as usual. Patched in `socket`, where socket.create_connection looks it up too."""
    release = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == HANGING_HOST:
            release.wait(30)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    release.set()  # frees the lookup thread the call stopped waiting for


@CALLS
def test_a_host_name_lookup_that_never_answers_times_out_at_the_deadline(dns_hangs, call):
    # getaddrinfo takes no timeout: looked up on the calling thread, the call would last as long as the resolver.
    executor, req = call(9, 1000, host=HANGING_HOST)
    error, elapsed = timed(executor, req)
    assert error.code == "TIMEOUT" and error.retryable
    assert not error.effect_unknown  # nothing was sent: a plain failure, whatever the tool
    assert elapsed < 10  # near the 1 s deadline (loose: a loaded machine), not the lookup's 30 s


@CALLS
@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_localhost_and_ip_literals_still_connect(serve, call, host):
    server = serve([(0.0, HEAD % 2 + b"{}")])
    executor, req = call(server.port, 5000, host=host)
    assert executor.execute(req, MappingSecretProvider())["status"] == 200


def test_an_httpx_without_the_private_pool_fails_loudly_instead_of_dropping_the_deadline(monkeypatch):
    # The deadline is installed through httpx.HTTPTransport's private `_pool`; an httpx that renames it
    # must not get a transport without the deadline.
    class RenamedPool(httpx.HTTPTransport):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._connection_pool = self.__dict__.pop("_pool")

    monkeypatch.setattr(httpx, "HTTPTransport", RenamedPool)
    with pytest.raises(RuntimeError, match="_pool"):
        deadline_transport(_tls())
    # ... and the gateway refuses to start with it, rather than failing every HTTP tool call later.
    from tether_tool_gateway.bootstrap import build_gateway
    from tether_tool_gateway.settings import GatewaySettings

    with pytest.raises(RuntimeError, match="_pool"):
        build_gateway(GatewaySettings(sandbox_enabled=False), environ={})
