"""Tenant-home partitioning: Java Kafka's murmur2 and toPositive, so every client agrees."""

from __future__ import annotations

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


class InvalidSpread(ValueError):
    """A tenant's spread must be between 1 and the partition count."""


def murmur2(data: bytes) -> int:
    """org.apache.kafka.common.utils.Utils.murmur2: a signed 32-bit int, exactly as Java returns it."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    n4 = length // 4
    for i in range(n4):
        i4 = i * 4
        k = data[i4] | (data[i4 + 1] << 8) | (data[i4 + 2] << 16) | (data[i4 + 3] << 24)
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    tail = length & ~3
    rest = length % 4
    # Java's switch falls through: 3 → 2 → 1.
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def to_positive(n: int) -> int:
    """Utils.toPositive: clears the sign bit (not abs(), which differs for negatives)."""
    return n & 0x7FFFFFFF


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Java's default partitioner (and librdkafka's murmur2 partitioners) picks for a key."""
    return to_positive(murmur2(key)) % partitions


def home_partition(tenant_id: str, partitions: int) -> int:
    """A tenant's home partition."""
    return key_partition(tenant_id.encode(), partitions)


def partition_for(tenant_id: str, run_id: str, partitions: int, spread: int = 1) -> int:
    """The partition of a run: the tenant's home partition plus murmur2(run) mod spread.

    With spread 1 every run of the tenant lands on its home partition; a large tenant with
    spread N uses N consecutive partitions (wrapping). Chosen once, at submit.
    """
    if partitions < 1:
        raise InvalidSpread(f"partition count must be positive, got {partitions}")
    if not 1 <= spread <= partitions:
        raise InvalidSpread(f"spread {spread} is not between 1 and {partitions}")
    offset = key_partition(run_id.encode(), spread) if spread > 1 else 0
    return (home_partition(tenant_id, partitions) + offset) % partitions
