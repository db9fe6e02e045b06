"""Building envelopes and Kafka headers around payload records."""

from __future__ import annotations

import hashlib

from tether_contracts.base import AvroRecord
from tether_contracts.records import Envelope
from tether_contracts.schemas import SchemaSet
from tether_messaging.serde import FROM_PROCESS, HEADER_LEN, MAGIC, PinChoice, encode


def make_envelope(
    payload: AvroRecord,
    *,
    run_id: str,
    tenant_id: str,
    event_id: str,
    producer: str,
    recorded_at_ms: int,
    causation_id: str | None = None,
    traceparent: str | None = None,
    schemas: SchemaSet | None = None,
    pin: PinChoice = FROM_PROCESS,
) -> Envelope:
    """Wrap a command or event in an unsequenced envelope.

    The payload is single-object encoded with the process's write pin (TETHER_SCHEMA_WRITE_RELEASE)
    unless `pin` says otherwise, and `schema_fingerprint` is the fingerprint in the encoded payload's
    header: the schema the payload was written with (under a pin the release's, else the current one),
    so the envelope, and the hash chain that covers it, never names a schema the payload was not written with.
    """
    data = encode(payload, schemas, pin)
    if data[: len(MAGIC)] != MAGIC or len(data) < HEADER_LEN:  # encode always writes the single-object header
        raise ValueError(f"{payload.AVRO_NAME}: the payload is not single-object encoded")
    return Envelope(
        event_id=event_id,
        tenant_id=tenant_id,
        run_id=run_id,
        event_type=payload.AVRO_NAME,
        schema_fingerprint=data[len(MAGIC):HEADER_LEN].hex(),
        payload=data,
        recorded_at_ms=recorded_at_ms,
        producer=producer,
        causation_id=causation_id,
        traceparent=traceparent,
    )


#: The record's event type (Avro full name), so a consumer can pass records over without decoding them.
EVENT_TYPE_HEADER = "tether-event-type"


def header_event_type(headers: list[tuple[str, bytes]] | None) -> bytes | None:
    """The `tether-event-type` header's value, or None for a record written without it."""
    return next((v for k, v in headers or () if k == EVENT_TYPE_HEADER), None)


def headers_for(envelope: Envelope) -> list[tuple[str, bytes]]:
    """Kafka headers that let consumers route and filter without decoding the value."""
    headers = [
        ("tether-tenant", envelope.tenant_id.encode()),
        ("tether-run", envelope.run_id.encode()),
        ("tether-event-id", envelope.event_id.encode()),
        (EVENT_TYPE_HEADER, envelope.event_type.encode()),
        ("tether-schema-fingerprint", envelope.schema_fingerprint.encode()),
    ]
    if envelope.traceparent:
        headers.append(("traceparent", envelope.traceparent.encode()))
    return headers


def derived_id(*parts: object) -> str:
    """A deterministic event id from its causes, so a replayed emission has the same id."""
    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()
    return h[:32]
