"""Confluent Schema Registry option: a small REST client and the envelope codec that uses its wire format.

Selected when TETHER_SCHEMA_REGISTRY_URL is configured (`envelope_codec(url)`); otherwise
records use single-object encoding. The value subject is `<topic>-value` (Confluent's
TopicNameStrategy). Only three REST calls are used: register a schema under a subject,
fetch a schema by id, and (for tests and tooling) list a subject's versions. See docs/serde.md.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from tether_contracts.records import Envelope
from tether_contracts.schemas import SchemaSet, schema_set
from tether_messaging.serde import (
    FROM_PROCESS,
    EnvelopeCodec,
    PinChoice,
    ResolvedWriter,
    SingleObjectCodec,
    UnknownSchemaId,
    active_pin,
    decode_as,
    encode_confluent,
    resolve_writer,
    write_schema,
)

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
ACCEPT = "application/vnd.schemaregistry.v1+json, application/vnd.schemaregistry+json, application/json"


class SchemaRegistryError(Exception):
    """The registry refused a request (4xx other than an unknown schema id): permanent for that input."""

    def __init__(self, status: int, error_code: int | None, message: str) -> None:
        super().__init__(f"schema registry: HTTP {status} (error {error_code}): {message}")
        self.status = status
        self.error_code = error_code


class SchemaRegistryUnavailable(Exception):
    """The registry could not be reached or failed (network error, 5xx): transient, retry later."""


def value_subject(topic: str) -> str:
    """The subject of a topic's record values (TopicNameStrategy)."""
    return f"{topic}-value"


class SchemaRegistryClient:
    """Registers schemas and looks them up by id, caching both (ids are immutable in a registry).

    Safe to share between threads: the caches only ever gain entries that a repeated call would
    produce again.
    """

    def __init__(self, base_url: str, *, http: httpx.Client | None = None, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http or httpx.Client(timeout=timeout_s, headers={"Accept": ACCEPT})
        self._owns_http = http is None
        self._ids: dict[tuple[str, str], int] = {}
        self._schemas: dict[int, Any] = {}
        self._resolved: dict[tuple[int, int], ResolvedWriter] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, f"{self.base_url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise SchemaRegistryUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise SchemaRegistryUnavailable(f"{method} {path}: HTTP {response.status_code}: {response.text[:200]}")
        return response

    @staticmethod
    def _refused(response: httpx.Response) -> SchemaRegistryError:
        try:
            body = response.json()
        except ValueError:
            body = {}
        return SchemaRegistryError(response.status_code, body.get("error_code"), body.get("message", response.text[:200]))

    def register(self, subject: str, schema: dict[str, Any]) -> int:
        """The id of `schema` under `subject`, registering it if new (the registry is idempotent)."""
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        key = (subject, text)
        cached = self._ids.get(key)
        if cached is not None:
            return cached
        response = self._request(
            "POST",
            f"/subjects/{subject}/versions",
            content=json.dumps({"schema": text}),
            headers={"Content-Type": CONTENT_TYPE},
        )
        if response.status_code != 200:
            raise self._refused(response)
        schema_id = int(response.json()["id"])
        with self._lock:
            self._ids[key] = schema_id
            self._schemas.setdefault(schema_id, schema)
        return schema_id

    def schema(self, schema_id: int) -> Any:
        """The JSON schema registered under `schema_id` (UnknownSchemaId if there is none)."""
        cached = self._schemas.get(schema_id)
        if cached is not None:
            return cached
        response = self._request("GET", f"/schemas/ids/{schema_id}")
        if response.status_code == 404:
            raise UnknownSchemaId(schema_id)
        if response.status_code != 200:
            raise self._refused(response)
        body = response.json()
        if body.get("schemaType", "AVRO") != "AVRO":
            raise UnknownSchemaId(schema_id, f"schema id {schema_id} is a {body['schemaType']} schema, not Avro")
        schema = json.loads(body["schema"])
        with self._lock:
            self._schemas[schema_id] = schema
        return schema

    def versions(self, subject: str) -> list[int]:
        """Version numbers registered under `subject` (empty if the subject does not exist)."""
        response = self._request("GET", f"/subjects/{subject}/versions")
        if response.status_code == 404:
            return []
        if response.status_code != 200:
            raise self._refused(response)
        return [int(v) for v in response.json()]

    def resolved_writer(self, schema_id: int, schemas: SchemaSet) -> ResolvedWriter:
        """WriterSchemaSource: the writer schema of `schema_id`, bound to the current record reading it."""
        key = (schema_id, id(schemas))
        cached = self._resolved.get(key)
        if cached is not None:
            return cached
        resolved = resolve_writer(self.schema(schema_id), schemas, where=f"schema id {schema_id}: ")
        with self._lock:
            self._resolved[key] = resolved
        return resolved


class RegistryCodec:
    """EnvelopeCodec in the Confluent wire format; decodes single-object values too (first byte decides).

    Under the process's pin (TETHER_SCHEMA_WRITE_RELEASE, resolved when it is built) it registers
    and writes with the pinned release's envelope schema.
    """

    def __init__(self, client: SchemaRegistryClient, schemas: SchemaSet | None = None, pin: PinChoice = FROM_PROCESS) -> None:
        self.client = client
        self.schemas = schemas or schema_set()
        self.pin = active_pin(pin, self.schemas)

    def encode_value(self, envelope: Envelope, topic: str) -> bytes:
        schema = write_schema(Envelope.AVRO_NAME, self.schemas, self.pin)
        schema_id = self.client.register(value_subject(topic), schema)
        return encode_confluent(envelope, schema_id, self.schemas, self.pin)

    def decode_value(self, data: bytes) -> Envelope:
        return decode_as(data, Envelope, self.schemas, registry=self.client)


def envelope_codec(registry_url: str | None, *, timeout_s: float = 5.0) -> EnvelopeCodec:
    """The codec for Kafka record values: the registry's wire format when a URL is configured,
    single-object encoding otherwise."""
    if registry_url:
        return RegistryCodec(SchemaRegistryClient(registry_url, timeout_s=timeout_s))
    return SingleObjectCodec()
