"""Avro encoding of Tether records: single-object encoding by default, Confluent wire format as an option.

Single-object encoding (Avro spec, "Single object encoding specification"): 0xC3 0x01, the
writer schema's 8-byte little-endian CRC-64-AVRO fingerprint, then the Avro binary body. The
fingerprint may name the current schema or the writer schema of a released snapshot; the
latter is read into the current type by Avro schema resolution.

Confluent Schema Registry wire format: 0x00, the 4-byte big-endian schema id, then the body;
the writer schema comes from the registry (tether_messaging.registry). `decode` picks the
format by the first byte, so one consumer reads both.

A rolling upgrade pins the writer: with TETHER_SCHEMA_WRITE_RELEASE=<release> (read once per
process) every record is written with that released snapshot's schema, so pods still running
the previous release read what upgraded pods write (docs/serde.md, "Rolling upgrades").
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final, Protocol, TypeVar

import fastavro
from fastavro.read import SchemaResolutionError
from fastavro.schema import to_parsing_canonical_form

from tether_contracts.base import AvroRecord
from tether_contracts.compat import compare
from tether_contracts.records import RECORD_TYPES, Envelope
from tether_contracts.schemas import SchemaSet, schema_set

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
CONFLUENT_MAGIC = b"\x00"
CONFLUENT_HEADER_LEN = 5
#: The released snapshot producers write with during phase 1 of a rolling upgrade (unset: the current schemas).
WRITE_RELEASE_ENV = "TETHER_SCHEMA_WRITE_RELEASE"

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


class WriteReleaseRefused(Exception):
    """The pinned write release cannot write every current record; raised when a codec is built
    (start-up), so a process never runs writing records that the release's readers would lose."""

    def __init__(self, release: str, problems: list[str]) -> None:
        super().__init__(
            f"{WRITE_RELEASE_ENV}={release} refused: {len(problems)} problem(s): " + "; ".join(problems)
        )
        self.release = release
        self.problems = problems


@dataclass(frozen=True)
class WritePin:
    """Records are written with a released snapshot's writer schemas instead of the current ones.

    `fingerprints` maps every current record the release can write to the fingerprint of its
    writer schema in that release (the current fingerprint where the record has not changed).
    """

    release: str
    fingerprints: dict[str, bytes]


def write_pin(release: str, schemas: SchemaSet | None = None) -> WritePin:
    """The pin for writing with `release`'s schemas, checked for every current record.

    Refused (WriteReleaseRefused, listing every problem) when the release is not bundled, when a
    current command, event or the envelope has no schema in it (a new record type: its readers
    could not read it whatever we write), or when a record does not resolve both ways against
    the release (a field the release lacks must have a default; the compatibility gate
    guarantees it, this asserts it at start-up).
    """
    schemas = schemas or schema_set()
    written = schemas.releases.get(release)
    if written is None or schemas.current_tree is None:
        known = ", ".join(sorted(schemas.releases)) or "none"
        raise WriteReleaseRefused(release, [f"no released snapshot named {release!r} is bundled (known: {known})"])
    problems = [
        f"{name}: not in release {release} (a new record type; readers of {release} cannot read it)"
        for rel, name in sorted(schemas.current_tree.top_level.items(), key=lambda item: item[1])
        if name not in written and PurePosixPath(rel).parent.name != "types"  # types are only ever nested
    ]
    problems += [str(p) for p in compare(schemas.release_trees[release], schemas.current_tree, release)]
    if problems:
        raise WriteReleaseRefused(release, problems)
    return WritePin(release, dict(written))


class _ProcessPin:
    """Marker: write with the process's pin (TETHER_SCHEMA_WRITE_RELEASE), if any."""


FROM_PROCESS: Final = _ProcessPin()
#: What a writer is given: a pin, None (the current schemas) or FROM_PROCESS.
PinChoice = WritePin | None | _ProcessPin

_process_pins: dict[int, tuple[SchemaSet, WritePin | None]] = {}


def process_write_pin(schemas: SchemaSet | None = None) -> WritePin | None:
    """The pin TETHER_SCHEMA_WRITE_RELEASE names (None when it is unset or empty), for `schemas`.

    Read and checked once per process and schema set; every codec resolves it when it is built,
    so a release that cannot write every record stops the process at start-up.
    """
    schemas = schemas or schema_set()
    hit = _process_pins.get(id(schemas))
    if hit is not None and hit[0] is schemas:
        return hit[1]
    release = os.environ.get(WRITE_RELEASE_ENV, "").strip()
    pin = write_pin(release, schemas) if release else None
    _process_pins[id(schemas)] = (schemas, pin)
    return pin


def active_pin(pin: PinChoice, schemas: SchemaSet | None = None) -> WritePin | None:
    """`pin` itself, or the process's pin for FROM_PROCESS."""
    return process_write_pin(schemas) if isinstance(pin, _ProcessPin) else pin


def write_schema(name: str, schemas: SchemaSet | None = None, pin: PinChoice = FROM_PROCESS) -> Any:
    """The self-contained JSON schema a record named `name` is written with (what a registry is given)."""
    schemas = schemas or schema_set()
    active = active_pin(pin, schemas)
    if active is None:
        return schemas.standalone[name]
    return schemas.writers[_pinned_fingerprint(name, active)].standalone


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


def _current_body(record: AvroRecord, schemas: SchemaSet) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schemas.parsed[record.AVRO_NAME], record.avro_datum())
    return buf.getvalue()


def _pinned_fingerprint(name: str, pin: WritePin) -> bytes:
    fp = pin.fingerprints.get(name)
    if fp is None:  # a nested-only type written on its own: write_pin lets those through
        raise WriteReleaseRefused(pin.release, [f"{name}: not in release {pin.release}"])
    return fp


def _body(record: AvroRecord, schemas: SchemaSet, pin: WritePin | None) -> tuple[bytes, bytes]:
    """The writer fingerprint and the Avro body of `record`, written with the pinned release's
    schema when there is a pin and the record changed since that release."""
    name = record.AVRO_NAME
    body = _current_body(record, schemas)
    if pin is None:
        return schemas.fingerprint_of(name), body
    fp = _pinned_fingerprint(name, pin)
    writer = schemas.writers[fp]
    if writer.release is None:  # unchanged since the release
        return fp, body
    # Avro schema resolution turns the current datum into what a reader of the release sees
    # (fields it lacks dropped, nested records and unions resolved the same way); that datum is
    # then written with the release's schema.
    datum = fastavro.schemaless_reader(io.BytesIO(body), schemas.parsed[name], writer.parsed)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, writer.parsed, datum)
    return fp, buf.getvalue()


def encode(
    record: AvroRecord, schemas: SchemaSet | None = None, pin: PinChoice = FROM_PROCESS
) -> bytes:
    """Single-object encode a generated record, with the pinned release's writer schema if there is
    a pin (by default the process's, TETHER_SCHEMA_WRITE_RELEASE; None = the current schemas)."""
    schemas = schemas or schema_set()
    fp, body = _body(record, schemas, active_pin(pin, schemas))
    return MAGIC + fp + body


def encode_confluent(
    record: AvroRecord,
    schema_id: int,
    schemas: SchemaSet | None = None,
    pin: PinChoice = FROM_PROCESS,
) -> bytes:
    """Confluent wire format: 0x00, 4-byte big-endian schema id, body. The id must be the one
    registered for `write_schema(record's name, schemas, pin)` (the pinned release's schema under a pin)."""
    if not 0 <= schema_id < 2**31:
        raise ValueError(f"schema id out of range: {schema_id}")
    schemas = schemas or schema_set()
    _, body = _body(record, schemas, active_pin(pin, schemas))
    return CONFLUENT_MAGIC + schema_id.to_bytes(4, "big") + body


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
    """Lowercase hex of a record type's current schema's fingerprint.

    It is an envelope's `schema_fingerprint` only when the payload is written with the current
    schema; under a write pin (TETHER_SCHEMA_WRITE_RELEASE) the envelope names the pinned schema,
    read off the encoded payload (`make_envelope`).
    """
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
    """The default EnvelopeCodec: single-object encoding, no registry (Confluent-framed input is refused).

    It writes with the process's pin (TETHER_SCHEMA_WRITE_RELEASE), resolved when it is built:
    a release that cannot write every record raises WriteReleaseRefused at start-up.
    """

    def __init__(self, schemas: SchemaSet | None = None, pin: PinChoice = FROM_PROCESS) -> None:
        self.schemas = schemas
        self.pin = active_pin(pin, schemas)

    def encode_value(self, envelope: Envelope, topic: str) -> bytes:
        return encode(envelope, self.schemas, self.pin)

    def decode_value(self, data: bytes) -> Envelope:
        return decode_as(data, Envelope, self.schemas)
