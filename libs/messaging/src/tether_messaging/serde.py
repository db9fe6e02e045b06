"""Avro encoding of Tether records: single-object encoding by default, Confluent wire format as an option.

Single-object encoding (Avro spec, "Single object encoding specification"): 0xC3 0x01, the
writer schema's 8-byte little-endian CRC-64-AVRO fingerprint, then the Avro binary body. The
fingerprint may name the current schema or the writer schema of a released snapshot; the
latter is read into the current type by Avro schema resolution.

Confluent Schema Registry wire format: 0x00, the 4-byte big-endian schema id, then the body;
the writer schema comes from the registry (tether_messaging.registry). `decode` picks the
format by the first byte, so one consumer reads both.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import fastavro
from fastavro.read import SchemaResolutionError
from fastavro.schema import to_parsing_canonical_form

from tether_contracts.base import AvroRecord
from tether_contracts.records import RECORD_TYPES, Envelope
from tether_contracts.schemas import SchemaSet, schema_set

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
CONFLUENT_MAGIC = b"\x00"
CONFLUENT_HEADER_LEN = 5

R = TypeVar("R", bound=AvroRecord)


class SerdeError(Exception):
    """A record could not be decoded; `reason` is a stable machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class UnknownFingerprint(SerdeError):
    """Single-object data whose writer schema is neither current nor in a released snapshot."""

    def __init__(self, fp: bytes) -> None:
        super().__init__("UNKNOWN_FINGERPRINT", f"no bundled schema has fingerprint {fp.hex()}")
        self.fingerprint = fp


class UnknownSchemaId(SerdeError):
    """Confluent-framed data whose schema id the registry does not know (or no registry is configured)."""

    def __init__(self, schema_id: int, detail: str = "") -> None:
        super().__init__("UNKNOWN_SCHEMA_ID", detail or f"the schema registry has no schema with id {schema_id}")
        self.schema_id = schema_id


class CorruptPayload(SerdeError):
    """Bytes that are not a well-formed record of the schema they claim."""

    def __init__(self, detail: str, reason: str = "CORRUPT_PAYLOAD") -> None:
        super().__init__(reason, detail)


class WrongRecordType(CorruptPayload):
    """A well-formed record of another type than the one expected."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"expected {expected}, got {actual}", reason="WRONG_RECORD_TYPE")
        self.expected = expected
        self.actual = actual


class IncompatibleSchema(SerdeError):
    """The writer's schema cannot be resolved against any current record type."""

    def __init__(self, detail: str) -> None:
        super().__init__("INCOMPATIBLE_SCHEMA", detail)


@dataclass(frozen=True)
class ResolvedWriter:
    """A writer schema from a registry, bound to the current record type that reads it."""

    reader_name: str
    parsed: Any
    same: bool  # identical (canonically) to the reader's schema: no resolution needed


def resolve_writer(writer_json: Any, schemas: SchemaSet, where: str = "") -> ResolvedWriter:
    """Bind a self-contained writer schema to the current record that reads it (same name or alias)."""
    name = writer_json.get("name", "") if isinstance(writer_json, dict) else ""
    reader_name = schemas.reader_name_for(name)
    if reader_name is None:
        raise IncompatibleSchema(f"{where}{name or 'not a named record'}: no current record reads it")
    try:
        parsed = fastavro.parse_schema(writer_json, {})
    except Exception as exc:
        raise IncompatibleSchema(f"{where}invalid writer schema: {exc}") from exc
    same = to_parsing_canonical_form(parsed) == to_parsing_canonical_form(schemas.parsed[reader_name])
    return ResolvedWriter(reader_name, parsed, same)


class WriterSchemaSource(Protocol):
    """Where the writer schemas of Confluent-framed data come from (a schema registry client)."""

    def resolved_writer(self, schema_id: int, schemas: SchemaSet) -> ResolvedWriter:
        """The writer schema registered under `schema_id`, resolved with `resolve_writer` (and
        cached). Raises UnknownSchemaId when the registry does not know the id."""
        ...


def _body(record: AvroRecord, schemas: SchemaSet) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schemas.parsed[record.AVRO_NAME], record.avro_datum())
    return buf.getvalue()


def encode(record: AvroRecord, schemas: SchemaSet | None = None) -> bytes:
    """Single-object encode a generated record."""
    schemas = schemas or schema_set()
    return MAGIC + schemas.fingerprint_of(record.AVRO_NAME) + _body(record, schemas)


def encode_confluent(record: AvroRecord, schema_id: int, schemas: SchemaSet | None = None) -> bytes:
    """Confluent wire format: 0x00, 4-byte big-endian schema id (as registered for this record's schema), body."""
    if not 0 <= schema_id < 2**31:
        raise ValueError(f"schema id out of range: {schema_id}")
    schemas = schemas or schema_set()
    return CONFLUENT_MAGIC + schema_id.to_bytes(4, "big") + _body(record, schemas)


def _read(data: bytes, offset: int, writer: Any, reader_name: str, schemas: SchemaSet, same: bool) -> AvroRecord:
    buf = io.BytesIO(data)
    buf.seek(offset)
    try:
        datum = fastavro.schemaless_reader(buf, writer, None if same else schemas.parsed[reader_name])
    except SchemaResolutionError as exc:
        raise IncompatibleSchema(f"{reader_name}: {exc}") from exc
    except Exception as exc:  # fastavro raises EOFError, ValueError, UnicodeDecodeError, IndexError, ...
        raise CorruptPayload(f"{reader_name}: {type(exc).__name__}: {exc}") from exc
    if buf.tell() != len(data):
        raise CorruptPayload(f"{reader_name}: {len(data) - buf.tell()} trailing bytes")
    try:
        return RECORD_TYPES[reader_name].from_avro(datum)
    except Exception as exc:  # pydantic rejects a datum the Avro schema allowed (cannot happen for generated types)
        raise CorruptPayload(f"{reader_name}: {exc}") from exc


def _decode_single_object(data: bytes, schemas: SchemaSet) -> AvroRecord:
    if len(data) < HEADER_LEN or data[:2] != MAGIC:
        raise CorruptPayload("missing single-object header (C3 01 + 8-byte fingerprint)")
    fp = bytes(data[2:HEADER_LEN])
    writer = schemas.writers.get(fp)
    if writer is None:
        raise UnknownFingerprint(fp)
    return _read(data, HEADER_LEN, writer.parsed, writer.name, schemas, same=writer.release is None)


def _decode_confluent(data: bytes, schemas: SchemaSet, registry: WriterSchemaSource | None) -> AvroRecord:
    if len(data) < CONFLUENT_HEADER_LEN:
        raise CorruptPayload("truncated Confluent header (00 + 4-byte schema id)")
    schema_id = int.from_bytes(data[1:CONFLUENT_HEADER_LEN], "big")
    if registry is None:
        raise UnknownSchemaId(schema_id, f"schema id {schema_id}: Confluent-framed data but no schema registry is configured")
    writer = registry.resolved_writer(schema_id, schemas)
    return _read(data, CONFLUENT_HEADER_LEN, writer.parsed, writer.reader_name, schemas, same=writer.same)


def decode(data: bytes, schemas: SchemaSet | None = None, registry: WriterSchemaSource | None = None) -> AvroRecord:
    """Decode bytes into the generated record type their writer schema names.

    The first byte picks the format: C3 = single-object, 00 = Confluent wire format (needs
    `registry`). Raises a SerdeError subclass; every one is permanent for those bytes except
    errors of the registry itself (tether_messaging.registry.SchemaRegistryUnavailable).
    """
    schemas = schemas or schema_set()
    if not data:
        raise CorruptPayload("empty payload")
    first = data[:1]
    if first == MAGIC[:1]:
        return _decode_single_object(bytes(data), schemas)
    if first == CONFLUENT_MAGIC:
        return _decode_confluent(bytes(data), schemas, registry)
    raise CorruptPayload(f"unknown wire format (first byte 0x{data[0]:02x})")


def decode_as(
    data: bytes, record_type: type[R], schemas: SchemaSet | None = None, registry: WriterSchemaSource | None = None
) -> R:
    """Decode and check the record is of the expected type (WrongRecordType otherwise)."""
    record = decode(data, schemas, registry)
    if not isinstance(record, record_type):
        raise WrongRecordType(record_type.AVRO_NAME, record.AVRO_NAME)
    return record


def fingerprint_hex(record_type: type[AvroRecord], schemas: SchemaSet | None = None) -> str:
    """Lowercase hex of a record type's current fingerprint (the envelope's `schema_fingerprint`)."""
    return (schemas or schema_set()).fingerprint_of(record_type.AVRO_NAME).hex()


def decode_envelope(data: bytes, registry: WriterSchemaSource | None = None) -> Envelope:
    """Decode a Kafka record value (always an Envelope), in either wire format."""
    return decode_as(data, Envelope, registry=registry)


def open_payload(envelope: Envelope) -> AvroRecord:
    """Decode the command or event carried by an envelope (always single-object encoded)."""
    return decode(envelope.payload)


class EnvelopeCodec(Protocol):
    """How envelopes become Kafka record values and back; the loop uses one per process."""

    def encode_value(self, envelope: Envelope, topic: str) -> bytes:
        """The record value for `envelope` produced to `topic`."""
        ...

    def decode_value(self, data: bytes) -> Envelope:
        """The envelope in a record value (either wire format); raises SerdeError."""
        ...


class SingleObjectCodec:
    """The default EnvelopeCodec: single-object encoding, no registry (Confluent-framed input is refused)."""

    def __init__(self, schemas: SchemaSet | None = None) -> None:
        self.schemas = schemas

    def encode_value(self, envelope: Envelope, topic: str) -> bytes:
        return encode(envelope, self.schemas)

    def decode_value(self, data: bytes) -> Envelope:
        return decode_as(data, Envelope, self.schemas)
