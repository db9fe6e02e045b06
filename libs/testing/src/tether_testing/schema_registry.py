"""A small stand-in for the Confluent Schema Registry's REST API, on 127.0.0.1, for tests.

No real registry runs on these machines (Confluent's artifacts are not on Maven Central). The
stand-in implements the three endpoints `tether_messaging.registry.SchemaRegistryClient` uses,
as Confluent's API reference describes them: register under a subject (idempotent, one id per
distinct schema text), fetch by id (404 / 40403 when unknown), list a subject's versions. It can
be told to fail every request with a status (`fail_with`). See docs/serde.md.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: The first id handed out; above 255 so a frame's byte order is visible.
FIRST_ID = 0x0102


@dataclass
class RegistryState:
    """What the stand-in holds: subjects → schema ids, id → schema text, and every request it saw."""

    subjects: dict[str, list[int]] = field(default_factory=dict)
    schemas: dict[int, str] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    #: When set, every request is answered with this HTTP status.
    fail_with: int | None = None


def make_handler(state: RegistryState) -> type[BaseHTTPRequestHandler]:
    """The request handler class of a stand-in serving `state`."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output quiet
            pass

        def _send(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            state.requests.append(("POST", self.path))
            length = int(self.headers["Content-Length"])
            body = json.loads(self.rfile.read(length))
            if state.fail_with:
                return self._send(state.fail_with, {"error_code": state.fail_with * 100 + 1, "message": "refused"})
            parts = self.path.strip("/").split("/")
            if len(parts) != 3 or parts[0] != "subjects" or parts[2] != "versions":
                return self._send(404, {"error_code": 404, "message": "not found"})
            schema_text = body["schema"]
            json.loads(schema_text)  # a real registry rejects invalid JSON with 422
            schema_id = next((sid for sid, text in state.schemas.items() if text == schema_text), None)
            if schema_id is None:
                schema_id = FIRST_ID + len(state.schemas)
                state.schemas[schema_id] = schema_text
            versions = state.subjects.setdefault(parts[1], [])
            if schema_id not in versions:
                versions.append(schema_id)
            return self._send(200, {"id": schema_id})

        def do_GET(self):
            state.requests.append(("GET", self.path))
            if state.fail_with:
                return self._send(state.fail_with, {"error_code": state.fail_with * 100, "message": "failing"})
            parts = self.path.strip("/").split("/")
            if parts[:2] == ["schemas", "ids"] and len(parts) == 3:
                text = state.schemas.get(int(parts[2]))
                if text is None:
                    return self._send(404, {"error_code": 40403, "message": "Schema not found"})
                return self._send(200, {"schema": text})
            if parts[0] == "subjects" and len(parts) == 3 and parts[2] == "versions":
                if parts[1] not in state.subjects:
                    return self._send(404, {"error_code": 40401, "message": "Subject not found"})
                return self._send(200, list(range(1, len(state.subjects[parts[1]]) + 1)))
            return self._send(404, {"error_code": 404, "message": "not found"})

    return Handler


@contextmanager
def stand_in_registry() -> Iterator[tuple[str, RegistryState]]:
    """Serve a fresh stand-in on an ephemeral 127.0.0.1 port: (base URL, its state); stopped on exit."""
    state = RegistryState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
