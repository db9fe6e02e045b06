"""Single-object encoding per the Avro spec, historical writer schemas, and the errors of decoding."""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path

import fastavro
import pytest
from fastavro.schema import fingerprint

from tether_contracts import codegen
from tether_contracts.avro import canonical_form, load_tree, parse_standalone, standalone
from tether_contracts.records import RECORD_TYPES, CancelRun, Envelope
from tether_contracts.samples import collect_named, sample_datum
from tether_contracts.schemas import load_schema_set, schema_set
from tether_messaging import serde
from tether_messaging.serde import (
    CorruptPayload,
    IncompatibleSchema,
    SingleObjectCodec,
    UnknownFingerprint,
    UnknownSchemaId,
    WrongRecordType,
    decode,
    decode_as,
    encode,
    encode_confluent,
    resolve_writer,
)

EMPTY = 0xC15D213AA4D7A795


def crc64_avro(data: bytes) -> int:
    """The spec's reference CRC-64-AVRO ("Schema Fingerprints"), written independently of fastavro."""
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (EMPTY & -(fp & 1))
        table.append(fp)
    fp = EMPTY
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


# Test vectors from apache/avro share/test/data/schema-tests.txt (signed Java longs).
VECTORS = [
    ('"null"', 7195948357588979594),
    ('"boolean"', -6970731678124411036),
    ('"int"', 8247732601305521295),
    ('{"name":"foo","type":"fixed","size":15}', 1756455273707447556),
    ('{"name":"foo","type":"record","fields":[{"name":"f1","type":"boolean"}]}', 7843277075252814651),
]


def sample(name: str, seed: int = 0):
    schemas = schema_set()
    datum = sample_datum(name, collect_named(schemas.standalone[name]), random.Random(f"{name}:{seed}"))
    return RECORD_TYPES[name].from_avro(datum)


def envelope(payload=None) -> Envelope:
    payload = payload or CancelRun(principal_id="p1", reason="enough")
    return Envelope(
        event_id="e1", tenant_id="t1", run_id="r1", event_type=payload.AVRO_NAME,
        schema_fingerprint=serde.fingerprint_hex(type(payload)), payload=encode(payload),
        recorded_at_ms=1_700_000_000_000, producer="test",
    )


# -- the header -----------------------------------------------------------------------------


@pytest.mark.parametrize(("canonical", "signed"), VECTORS)
def test_reference_crc64_matches_the_spec_vectors_and_fastavro_is_little_endian(canonical: str, signed: int):
    value = signed & 0xFFFFFFFFFFFFFFFF
    assert crc64_avro(canonical.encode()) == value
    assert bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")) == value.to_bytes(8, "little")


@pytest.mark.parametrize("name", sorted(RECORD_TYPES))
def test_header_is_c3_01_and_the_little_endian_fingerprint_of_the_canonical_form(name: str):
    data = encode(sample(name))
    form = canonical_form(schema_set().standalone[name])
    assert data[:2] == b"\xc3\x01"
    assert data[2:10] == crc64_avro(form.encode()).to_bytes(8, "little")
    assert data[2:10].hex() == fingerprint(form, "CRC-64-AVRO")


def test_body_is_the_plain_avro_binary_encoding():
    record = CancelRun(principal_id="p", reason="")
    # string "p" = zigzag length 1 (0x02) + "p"; empty string = 0x00.
    assert encode(record)[10:] == b"\x02p\x00"


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RECORD_TYPES))
def test_every_record_type_round_trips(name: str):
    for seed in range(10):
        record = sample(name, seed)
        assert decode(encode(record)) == record


def test_envelope_payload_round_trips():
    env = envelope()
    decoded = serde.decode_envelope(encode(env))
    assert decoded == env
    assert serde.open_payload(decoded) == CancelRun(principal_id="p1", reason="enough")


def test_single_object_codec():
    codec = SingleObjectCodec()
    env = envelope()
    data = codec.encode_value(env, "tether.commands.v1")
    assert data[:2] == b"\xc3\x01"
    assert codec.decode_value(data) == env


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda d: b"", id="empty"),
        pytest.param(lambda d: d[:6], id="short header"),
        pytest.param(lambda d: b"\xc3\x02" + d[2:], id="wrong version byte"),
        pytest.param(lambda d: b"\x7b" + d[1:], id="unknown first byte"),
        pytest.param(lambda d: d[:-3], id="truncated body"),
        pytest.param(lambda d: d + b"\x00", id="trailing byte"),
        pytest.param(lambda d: d[:10] + b"\x7f" + d[11:], id="length past the end"),
        pytest.param(lambda d: d[:10] + b"\x04\xff\xfe" + d[13:], id="invalid utf-8"),
    ],
)
def test_corrupt_payloads(mangle):
    data = encode(CancelRun(principal_id="pq", reason="why"))
    with pytest.raises(CorruptPayload) as err:
        decode(mangle(data))
    assert err.value.reason == "CORRUPT_PAYLOAD"


def test_unknown_fingerprint():
    data = bytearray(encode(CancelRun(principal_id="p")))
    data[9] ^= 0xFF
    with pytest.raises(UnknownFingerprint) as err:
        decode(bytes(data))
    assert err.value.reason == "UNKNOWN_FINGERPRINT"
    assert err.value.fingerprint == bytes(data[2:10])


def test_wrong_type():
    with pytest.raises(WrongRecordType) as err:
        decode_as(encode(CancelRun(principal_id="p")), Envelope)
    assert err.value.reason == "WRONG_RECORD_TYPE"
    assert (err.value.expected, err.value.actual) == ("tether.v1.Envelope", "tether.v1.CancelRun")
    assert isinstance(err.value, CorruptPayload)  # callers that catch CorruptPayload still catch it


# -- older writers ---------------------------------------------------------------------------


def test_data_of_a_released_writer_schema_is_read_into_the_current_type(tmp_path: Path):
    """A release whose Caps lacked max_tool_calls (default 200 now): its SubmitRun data still decodes."""
    root = tmp_path / "schemas"
    shutil.copytree(codegen.SCHEMA_ROOT, root, ignore=shutil.ignore_patterns("released"))
    old_release = root / "released" / "v1"
    shutil.copytree(root / "tether", old_release / "tether")
    caps = old_release / "tether/v1/types/Caps.avsc"
    schema = json.loads(caps.read_text())
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "max_tool_calls"]
    caps.write_text(json.dumps(schema))
    package = tmp_path / "pkg"
    package.mkdir()
    codegen.write(root, package)
    schemas = load_schema_set(package / "avsc")
    assert schemas.fingerprints == schema_set().fingerprints  # the current schemas are the real ones

    old_tree = load_tree(old_release, codegen.schema_files(old_release))
    old_schema = standalone("tether.v1.SubmitRun", old_tree)
    datum = sample_datum("tether.v1.SubmitRun", old_tree.named, random.Random(3))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, parse_standalone(old_schema), datum)
    old_fp = bytes.fromhex(fingerprint(canonical_form(old_schema), "CRC-64-AVRO"))
    assert old_fp not in schema_set().writers

    record = decode(b"\xc3\x01" + old_fp + body.getvalue(), schemas)
    assert record.caps.max_tool_calls == 200
    assert record.goal == datum["goal"]
    with pytest.raises(UnknownFingerprint):
        decode(b"\xc3\x01" + old_fp + body.getvalue())  # the real set has no such release


# -- Confluent framing without a registry client -----------------------------------------------


class DictRegistry:
    """A WriterSchemaSource over a dict (the HTTP client is tested in test_serde_registry.py)."""

    def __init__(self, schemas_by_id: dict[int, dict]) -> None:
        self.schemas_by_id = schemas_by_id

    def resolved_writer(self, schema_id, schemas):
        if schema_id not in self.schemas_by_id:
            raise UnknownSchemaId(schema_id)
        return resolve_writer(self.schemas_by_id[schema_id], schemas)


def test_confluent_frame_is_zero_then_big_endian_id():
    data = encode_confluent(CancelRun(principal_id="p", reason=""), 0x01020304)
    assert data == b"\x00\x01\x02\x03\x04" + b"\x02p\x00"


def test_confluent_frame_decodes_through_a_writer_schema_source():
    env = envelope()
    registry = DictRegistry({7: schema_set().standalone["tether.v1.Envelope"]})
    assert decode(encode_confluent(env, 7), registry=registry) == env
    assert decode(encode(env), registry=registry) == env  # single-object still decodes: first byte decides


def test_confluent_frame_without_registry_or_with_unknown_id():
    data = encode_confluent(envelope(), 7)
    with pytest.raises(UnknownSchemaId) as err:
        decode(data)
    assert "no schema registry" in str(err.value)
    with pytest.raises(UnknownSchemaId) as err:
        decode(data, registry=DictRegistry({}))
    assert err.value.schema_id == 7
    with pytest.raises(CorruptPayload):
        decode(b"\x00\x00\x07")


def test_confluent_writer_schema_of_no_current_record_is_incompatible():
    alien = {"type": "record", "name": "other.Thing", "fields": [{"name": "x", "type": "int"}]}
    with pytest.raises(IncompatibleSchema):
        decode(b"\x00\x00\x00\x00\x09\x02", registry=DictRegistry({9: alien}))
