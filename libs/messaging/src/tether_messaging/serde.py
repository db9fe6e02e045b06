"""Avro single-object encoding of Tether records, resolved from the bundled schemas.

Wire format (Avro spec, "Single-object encoding"): 0xC3 0x01, the writer schema's 8-byte
little-endian CRC-64-AVRO fingerprint, then the Avro binary body.
"""

from __future__ import annotations

import io
from typing import TypeVar

import fastavro

from tether_contracts.base import AvroRecord
from tether_contracts.records import RECORD_TYPES, Envelope
from tether_contracts.schemas import SchemaSet, schema_set

MAGIC = b"\xc3\x01"
HEADER_LEN = 10

R = TypeVar("R", bound=AvroRecord)


class SerdeError(Exception):
    """A record could not be decoded; `reason` is a stable machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class UnknownFingerprint(SerdeError):
    def __init__(self, fp: bytes) -> None:
        super().__init__("UNKNOWN_FINGERPRINT", f"no bundled schema has fingerprint {fp.hex()}")
        self.fingerprint = fp


class CorruptPayload(SerdeError):
    def __init__(self, detail: str) -> None:
        super().__init__("CORRUPT_PAYLOAD", detail)


def encode(record: AvroRecord, schemas: SchemaSet | None = None) -> bytes:
    """Single-object encode a generated record."""
    schemas = schemas or schema_set()
    name = record.AVRO_NAME
    buf = io.BytesIO()
    buf.write(MAGIC)
    buf.write(schemas.fingerprint_of(name))
    fastavro.schemaless_writer(buf, schemas.parsed[name], record.to_avro())
    return buf.getvalue()


def decode(data: bytes, schemas: SchemaSet | None = None) -> AvroRecord:
    """Decode single-object bytes into the generated record type named by the fingerprint."""
    schemas = schemas or schema_set()
    if len(data) < HEADER_LEN or data[:2] != MAGIC:
        raise CorruptPayload("missing single-object header (C3 01)")
    fp = bytes(data[2:HEADER_LEN])
    name = schemas.by_fingerprint.get(fp)
    if name is None:
        raise UnknownFingerprint(fp)
    buf = io.BytesIO(data)
    buf.seek(HEADER_LEN)
    try:
        datum = fastavro.schemaless_reader(buf, schemas.parsed[name], None)
    except Exception as exc:  # fastavro raises EOFError, ValueError, UnicodeDecodeError, ...
        raise CorruptPayload(f"{name}: {type(exc).__name__}: {exc}") from exc
    if buf.tell() != len(data):
        raise CorruptPayload(f"{name}: {len(data) - buf.tell()} trailing bytes")
    try:
        return RECORD_TYPES[name].from_avro(datum)
    except Exception as exc:
        raise CorruptPayload(f"{name}: {exc}") from exc


def decode_as(data: bytes, record_type: type[R], schemas: SchemaSet | None = None) -> R:
    """Decode and check the record is of the expected type."""
    record = decode(data, schemas)
    if not isinstance(record, record_type):
        raise CorruptPayload(f"expected {record_type.AVRO_NAME}, got {record.AVRO_NAME}")
    return record


def fingerprint_hex(record_type: type[AvroRecord], schemas: SchemaSet | None = None) -> str:
    return (schemas or schema_set()).fingerprint_of(record_type.AVRO_NAME).hex()


def decode_envelope(data: bytes) -> Envelope:
    """Decode a Kafka record value (always an Envelope)."""
    return decode_as(data, Envelope)


def open_payload(envelope: Envelope) -> AvroRecord:
    """Decode the command or event carried by an envelope."""
    return decode(envelope.payload)
