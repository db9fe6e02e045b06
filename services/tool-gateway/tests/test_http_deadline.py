"""An HTTP body that keeps dripping ends with TIMEOUT at the call's deadline (httpx's read timeout is per chunk)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tether_contracts.records import RiskClass, ToolSpec
from tether_tool_gateway.builtin_tools import http_get_spec
from tether_tool_gateway.domain.errors import ToolError
from tether_tool_gateway.executors.builtin import BuiltinExecutor
from tether_tool_gateway.executors.http_tool import HttpToolExecutor
from tether_tool_gateway.ports import ExecutionRequest, MappingSecretProvider

DRIP_S = 0.05
BYTES = 80  # the whole body takes BYTES * DRIP_S = 4 s to arrive


class DrippingServer:
    """A loopback HTTP server answering every request with a 200 whose body comes one byte per DRIP_S."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dripping-server", daemon=True)
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
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % BYTES)
            for _ in range(BYTES):
                if self.stop.wait(DRIP_S):
                    return
                conn.sendall(b" ")
        except OSError:  # the client gave up and closed the connection
            return

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        assert not self._thread.is_alive()


@pytest.fixture
def dripping():
    server = DrippingServer()
    yield server
    server.close()


def request(tool: ToolSpec, args) -> ExecutionRequest:
    return ExecutionRequest(tool=tool, args=args, idem_key="k" * 64, run_id="run-1", tenant_id="t1", call_id="1.0",
                            attempt=1, timeout_s=tool.timeout_ms / 1000)


def timed(executor, req: ExecutionRequest) -> tuple[ToolError, float]:
    started = time.monotonic()
    with pytest.raises(ToolError) as caught:
        executor.execute(req, MappingSecretProvider())
    return caught.value, time.monotonic() - started


def test_http_get_of_a_dripping_page_times_out_at_the_deadline(dripping):
    tool = http_get_spec(["127.0.0.1"], timeout_ms=500)
    error, elapsed = timed(BuiltinExecutor(), request(tool, {"url": f"http://127.0.0.1:{dripping.port}/"}))
    assert error.code == "TIMEOUT"
    assert elapsed < BYTES * DRIP_S / 2  # ended near the 0.5 s deadline, not when the body was complete


def test_a_tool_service_dripping_its_answer_times_out_at_the_deadline(dripping):
    tool = ToolSpec(name="team_lookup", version=1, description="d", args_schema_json='{"type":"object"}',
                    risk_class=RiskClass.READ_ONLY, idempotent=False, untrusted_source=False, executor_kind="http",
                    executor_config_json=json.dumps({"url": f"http://127.0.0.1:{dripping.port}/lookup"}),
                    timeout_ms=750)
    error, elapsed = timed(HttpToolExecutor(), request(tool, {"q": "x"}))
    assert error.code == "TIMEOUT"
    assert elapsed < BYTES * DRIP_S / 2
