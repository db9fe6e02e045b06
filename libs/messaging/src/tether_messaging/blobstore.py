"""The content-addressed store behind claim checks: large payloads live here, events carry their hash."""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Protocol

from psycopg import sql
from psycopg_pool import ConnectionPool

from tether_contracts.records import BlobRef

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class BlobNotFound(KeyError):
    """No blob is stored under the hash."""

    def __init__(self, sha256: str) -> None:
        super().__init__(sha256)
        self.sha256 = sha256


class BlobCorrupted(Exception):
    """The stored bytes do not hash to their key (storage damage or tampering)."""

    def __init__(self, sha256: str, actual: str) -> None:
        super().__init__(f"blob {sha256} hashes to {actual}")
        self.sha256 = sha256
        self.actual = actual


class InvalidBlobKey(ValueError):
    """A key that is not a lowercase hex SHA-256."""


class InvalidSchemaName(ValueError):
    """A PostgreSQL schema name that is not a plain lowercase identifier."""


def blob_key(data: bytes) -> str:
    """The store key of `data`: lowercase hex SHA-256."""
    return hashlib.sha256(data).hexdigest()


def _check_key(sha256: str) -> None:
    if not _SHA256_HEX.match(sha256):
        raise InvalidBlobKey(f"not a lowercase hex sha256: {sha256!r}")


def check_schema_name(schema: str) -> str:
    """Return `schema` if it is a plain lowercase identifier, else raise `InvalidSchemaName`."""
    if not _SCHEMA_NAME.match(schema):
        raise InvalidSchemaName(f"schema name must match {_SCHEMA_NAME.pattern}: {schema!r}")
    return schema


class BlobStore(Protocol):
    """Content-addressed bytes: the key is the SHA-256 of the content, so a put is idempotent
    and a reader can verify what it got. Implementations are safe to share between threads."""

    def put(self, data: bytes, media_type: str = "application/json") -> BlobRef:
        """Store `data` (a no-op if it is already stored) and return its claim check."""
        ...

    def get(self, sha256: str) -> bytes:
        """The bytes stored under `sha256`; raises `BlobNotFound` or `BlobCorrupted`."""
        ...

    def exists(self, sha256: str) -> bool:
        """Whether bytes are stored under `sha256`."""
        ...


class InMemoryBlobStore:
    """A `BlobStore` in a dict, for unit tests and single-process tools."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, data: bytes, media_type: str = "application/json") -> BlobRef:
        key = blob_key(data)
        with self._lock:
            self._blobs.setdefault(key, bytes(data))
        return BlobRef(sha256=key, size=len(data), media_type=media_type)

    def get(self, sha256: str) -> bytes:
        _check_key(sha256)
        with self._lock:
            data = self._blobs.get(sha256)
        if data is None:
            raise BlobNotFound(sha256)
        actual = blob_key(data)
        if actual != sha256:
            raise BlobCorrupted(sha256, actual)
        return data

    def exists(self, sha256: str) -> bool:
        _check_key(sha256)
        with self._lock:
            return sha256 in self._blobs


class PostgresBlobStore:
    """A `BlobStore` in PostgreSQL: table `<schema>.blobs` (sha256 primary key, bytea content).

    Call `ensure_schema()` once at start-up (idempotent). The schema is configurable so tests
    and services can isolate their data; by default it is `blobs`, shared by every service.
    """

    def __init__(self, pool: ConnectionPool, schema: str = "blobs") -> None:
        self._pool = pool
        self._schema = check_schema_name(schema)
        self._table = sql.Identifier(schema, "blobs")

    def ensure_schema(self) -> None:
        """Create the schema and table if missing."""
        with self._pool.connection() as conn:
            # Several services create it at start-up; the lock stops their DDL racing.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"tether.blobstore.{self._schema}",))
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self._schema)))
            conn.execute(
                sql.SQL(
                    """CREATE TABLE IF NOT EXISTS {} (
                        sha256 text PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{{64}}$'),
                        size bigint NOT NULL,
                        media_type text NOT NULL,
                        content bytea NOT NULL,
                        created_at timestamptz NOT NULL DEFAULT now()
                    )"""
                ).format(self._table)
            )

    def put(self, data: bytes, media_type: str = "application/json") -> BlobRef:
        key = blob_key(data)
        with self._pool.connection() as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (sha256, size, media_type, content) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (sha256) DO NOTHING"
                ).format(self._table),
                (key, len(data), media_type, data),
            )
        return BlobRef(sha256=key, size=len(data), media_type=media_type)

    def get(self, sha256: str) -> bytes:
        _check_key(sha256)
        with self._pool.connection() as conn:
            row = conn.execute(sql.SQL("SELECT content FROM {} WHERE sha256 = %s").format(self._table), (sha256,)).fetchone()
        if row is None:
            raise BlobNotFound(sha256)
        data = bytes(row[0])
        actual = blob_key(data)
        if actual != sha256:
            raise BlobCorrupted(sha256, actual)
        return data

    def exists(self, sha256: str) -> bool:
        _check_key(sha256)
        with self._pool.connection() as conn:
            row = conn.execute(sql.SQL("SELECT 1 FROM {} WHERE sha256 = %s").format(self._table), (sha256,)).fetchone()
        return row is not None
