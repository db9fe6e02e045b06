"""The Confluent Schema Registry client and codec, against a small local stand-in for the registry's REST API.

No real registry runs on this machine (Confluent's artifacts are not on Maven Central); the
stand-in (tether_testing.schema_registry, fixture `schema_registry`) implements the three
endpoints the client uses, on 127.0.0.1, per Confluent's API reference. See docs/serde.md.
"""

from __future__ import annotations

import io
import json
import socket

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
from tether_testing.schema_registry import FIRST_ID


def envelope(reason: str = "enough") -> Envelope:
    payload = CancelRun(principal_id="p1", reason=reason)
    return Envelope(
        event_id="e1", tenant_id="t1", run_id="r1", event_type=payload.AVRO_NAME,
        schema_fingerprint=schema_set().fingerprint_of(payload.AVRO_NAME).hex(), payload=encode(payload),
        recorded_at_ms=1_700_000_000_000, producer="test",
    )


def test_codec_registers_under_topic_value_subject_and_frames_with_the_id(schema_registry):
    url, state = schema_registry
    codec = RegistryCodec(SchemaRegistryClient(url))
    data = codec.encode_value(envelope(), "tether.commands.v1")
    assert data[:5] == b"\x00\x00\x00\x01\x02"
    assert state.subjects == {"tether.commands.v1-value": [FIRST_ID]}
    assert json.loads(state.schemas[FIRST_ID]) == schema_set().standalone["tether.v1.Envelope"]
    assert codec.decode_value(data) == envelope()


def test_client_caches_registration_and_lookups(schema_registry):
    url, state = schema_registry
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


def test_registry_codec_reads_single_object_values_too(schema_registry):
    url, _ = schema_registry
    codec = RegistryCodec(SchemaRegistryClient(url))
    assert codec.decode_value(encode(envelope())) == envelope()


def test_older_writer_schema_from_the_registry_is_resolved(schema_registry):
    """A producer registered an Envelope without `traceparent`; its data reads with traceparent=None."""
    url, state = schema_registry
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


def test_unknown_schema_id(schema_registry):
    url, _ = schema_registry
    with pytest.raises(UnknownSchemaId) as err:
        decode(b"\x00\x00\x00\x30\x39\x00", registry=SchemaRegistryClient(url))
    assert err.value.schema_id == 12345


def test_registry_refusal_and_outage_are_told_apart(schema_registry):
    url, state = schema_registry
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


def test_codec_is_chosen_by_the_registry_url(schema_registry):
    url, _ = schema_registry
    assert isinstance(envelope_codec(None), SingleObjectCodec)
    assert isinstance(envelope_codec(""), SingleObjectCodec)
    codec = envelope_codec(url)
    assert isinstance(codec, RegistryCodec)
    assert codec.client.base_url == url
