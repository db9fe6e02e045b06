"""BlobStore conformance: the in-memory fake and the PostgreSQL adapter behave the same."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tether_messaging.blobstore import (
    BlobCorrupted,
    BlobNotFound,
    InMemoryBlobStore,
    InvalidBlobKey,
    InvalidSchemaName,
    PostgresBlobStore,
    blob_key,
)


@pytest.fixture
def memory_store():
    store = InMemoryBlobStore()

    def corrupt(key: str) -> None:
        store._blobs[key] = b"tampered"

    return store, corrupt


@pytest.fixture
def postgres_store(pg_schema):
    from psycopg_pool import ConnectionPool

    schema = pg_schema.name
    pool = ConnectionPool(pg_schema.base_dsn, min_size=1, max_size=4, open=True)
    store = PostgresBlobStore(pool, schema=schema)
    store.ensure_schema()
    store.ensure_schema()  # idempotent

    def corrupt(key: str) -> None:
        with pool.connection() as conn:
            conn.execute(f"UPDATE {schema}.blobs SET content = 'tampered'::bytea WHERE sha256 = %s", (key,))

    try:
        yield store, corrupt
    finally:
        pool.close()


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
def store(request):
    return request.getfixturevalue(f"{request.param}_store")


def test_put_returns_a_claim_check_and_get_returns_the_bytes(store):
    s, _ = store
    data = b'{"result": "' + b"x" * 100_000 + b'"}'
    ref = s.put(data)
    assert ref.sha256 == blob_key(data)
    assert ref.size == len(data)
    assert ref.media_type == "application/json"
    assert s.get(ref.sha256) == data
    assert s.exists(ref.sha256)


def test_put_is_idempotent_and_content_addressed(store):
    s, _ = store
    a = s.put(b"same", media_type="text/plain")
    b = s.put(b"same", media_type="text/plain")
    assert a == b
    assert s.put(b"other").sha256 != a.sha256


def test_missing_blob(store):
    s, _ = store
    key = blob_key(b"never stored")
    assert not s.exists(key)
    with pytest.raises(BlobNotFound):
        s.get(key)


def test_rejects_keys_that_are_not_sha256(store):
    s, _ = store
    with pytest.raises(InvalidBlobKey):
        s.get("../etc/passwd")
    with pytest.raises(InvalidBlobKey):
        s.exists("ABC")


def test_detects_corrupted_content(store):
    s, corrupt = store
    ref = s.put(b"precious")
    corrupt(ref.sha256)
    with pytest.raises(BlobCorrupted):
        s.get(ref.sha256)


def test_concurrent_puts_of_the_same_bytes(store):
    s, _ = store
    with ThreadPoolExecutor(4) as pool:
        refs = list(pool.map(lambda _: s.put(b"concurrent"), range(8)))
    assert len(set(refs)) == 1
    assert s.get(refs[0].sha256) == b"concurrent"


def test_schema_name_must_be_a_plain_identifier():
    with pytest.raises(InvalidSchemaName):
        PostgresBlobStore(pool=None, schema="blobs; DROP TABLE x")  # type: ignore[arg-type]
