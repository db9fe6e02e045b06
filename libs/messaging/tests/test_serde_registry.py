"""The Confluent Schema Registry client and codec, against a small local stand-in for the registry's REST API.

No real registry runs on this machine (Confluent's artifacts are not on Maven Central); the
stand-in implements the three endpoints the client uses, on 127.0.0.1, per Confluent's API
reference. See docs/serde.md.
"""

from __future__ import annotations

import io
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fastavro
import pytest

from tether_contracts.records import CancelRun, Envelope
from tether_contracts.schemas import schema_set
from tether_messaging.registry import (
    RegistryCodec,
    SchemaRegistryClient,
    SchemaRegistryError,
    SchemaRegistryUnavailable,
    envelope_codec,
    value_subject,
)
from tether_messaging.serde import SingleObjectCodec, UnknownSchemaId, decode, encode

FIRST_ID = 0x0102  # ids above 255 make the byte order visible in the frame


@dataclass
class RegistryState:
    subjects: dict[str, list[int]] = field(default_factory=dict)
    schemas: dict[int, str] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    fail_with: int | None = None


def make_handler(state: RegistryState):
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
            for schema_id, text in state.schemas.items():
                if text == schema_text:
                    break
            else:
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


@pytest.fixture
def registry() -> Iterator[tuple[str, RegistryState]]:
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


def envelope(reason: str = "enough") -> Envelope:
    payload = CancelRun(principal_id="p1", reason=reason)
    return Envelope(
        event_id="e1", tenant_id="t1", run_id="r1", event_type=payload.AVRO_NAME,
        schema_fingerprint=schema_set().fingerprint_of(payload.AVRO_NAME).hex(), payload=encode(payload),
        recorded_at_ms=1_700_000_000_000, producer="test",
    )


def test_codec_registers_under_topic_value_subject_and_frames_with_the_id(registry):
    url, state = registry
    codec = RegistryCodec(SchemaRegistryClient(url))
    data = codec.encode_value(envelope(), "tether.commands.v1")
    assert data[:5] == b"\x00\x00\x00\x01\x02"
    assert state.subjects == {"tether.commands.v1-value": [FIRST_ID]}
    assert json.loads(state.schemas[FIRST_ID]) == schema_set().standalone["tether.v1.Envelope"]
    assert codec.decode_value(data) == envelope()


def test_client_caches_registration_and_lookups(registry):
    url, state = registry
    codec = RegistryCodec(SchemaRegistryClient(url))
    for i in range(3):
        codec.encode_value(envelope(str(i)), "t1")
    assert state.requests == [("POST", "/subjects/t1-value/versions")]
    data = codec.encode_value(envelope(), "t2")  # another subject, same schema: same id
    assert data[1:5] == FIRST_ID.to_bytes(4, "big")

    reader = RegistryCodec(SchemaRegistryClient(url))  # a consumer process: knows no ids yet
    for _ in range(3):
        assert reader.decode_value(data) == envelope()
    assert state.requests.count(("GET", f"/schemas/ids/{FIRST_ID}")) == 1
    assert reader.client.versions("t2-value") == [1]
    assert reader.client.versions("nope-value") == []


def test_registry_codec_reads_single_object_values_too(registry):
    url, _ = registry
    codec = RegistryCodec(SchemaRegistryClient(url))
    assert codec.decode_value(encode(envelope())) == envelope()


def test_older_writer_schema_from_the_registry_is_resolved(registry):
    """A producer registered an Envelope without `traceparent`; its data reads with traceparent=None."""
    url, state = registry
    old = json.loads(json.dumps(schema_set().standalone["tether.v1.Envelope"]))
    old["fields"] = [f for f in old["fields"] if f["name"] != "traceparent"]
    client = SchemaRegistryClient(url)
    old_id = client.register(value_subject("t"), old)

    datum = envelope().to_avro()
    del datum["traceparent"]
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(old, {}), datum)
    decoded = decode(b"\x00" + old_id.to_bytes(4, "big") + body.getvalue(), registry=SchemaRegistryClient(url))
    assert decoded == envelope()


def test_unknown_schema_id(registry):
    url, _ = registry
    with pytest.raises(UnknownSchemaId) as err:
        decode(b"\x00\x00\x00\x30\x39\x00", registry=SchemaRegistryClient(url))
    assert err.value.schema_id == 12345


def test_registry_refusal_and_outage_are_told_apart(registry):
    url, state = registry
    client = SchemaRegistryClient(url)
    state.fail_with = 409
    with pytest.raises(SchemaRegistryError) as refused:
        client.register("s-value", {"type": "string"})
    assert (refused.value.status, refused.value.error_code) == (409, 40901)
    state.fail_with = 503
    with pytest.raises(SchemaRegistryUnavailable):
        client.register("s-value", {"type": "string"})
    with pytest.raises(SchemaRegistryUnavailable):
        client.schema(FIRST_ID)


def test_unreachable_registry_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    client = SchemaRegistryClient(f"http://127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(SchemaRegistryUnavailable):
        client.schema(1)


def test_codec_is_chosen_by_the_registry_url(registry):
    url, _ = registry
    assert isinstance(envelope_codec(None), SingleObjectCodec)
    assert isinstance(envelope_codec(""), SingleObjectCodec)
    codec = envelope_codec(url)
    assert isinstance(codec, RegistryCodec)
    assert codec.client.base_url == url
