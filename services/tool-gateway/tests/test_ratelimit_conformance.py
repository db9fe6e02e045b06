"""The RateLimiter port's conformance suite, run against the in-memory fake and real Redis (unique key prefix)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from tether_tool_gateway.domain.policy_document import RateLimit
from tether_tool_gateway.ports import RateLimiter, RateLimiterUnavailable
from tether_tool_gateway.ratelimit import RedisRateLimiter, bucket_keys
from tether_tool_gateway.testing import InMemoryRateLimiter

#: Refills one token per 100 s: nothing refills while a test runs, so answers are exact.
SLOW = RateLimit(limit=1, per_s=100, burst=3)
#: Refills one token per 2 s: a reservation matures within a test, and the second call of a
#: test is still inside the first one's slot however slow the machine (50 ms was not always).
FAST = RateLimit(limit=1, per_s=2, burst=1)
SLOT_MS = 100_000


MakeLimiter = Callable[..., RateLimiter]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def make_limiter(request) -> Iterator[MakeLimiter]:
    made: list[RedisRateLimiter] = []
    prefix = f"test-{uuid.uuid4().hex[:12]}:"

    def make(max_wait_ms: int = 1_000_000) -> RateLimiter:
        if request.param == "memory":
            # Real time, like Redis: SLOW does not refill during a test, FAST does.
            return InMemoryRateLimiter(clock_ms=lambda: int(time.time() * 1000), max_wait_ms=max_wait_ms)
        url = request.getfixturevalue("redis_url")
        limiter = RedisRateLimiter.from_url(url, key_prefix=prefix, max_wait_ms=max_wait_ms)
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        client = limiter._client
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        limiter.close()


def test_a_burst_is_allowed_then_calls_reserve_the_next_tokens_in_order(make_limiter):
    rl = make_limiter()
    answers = [rl.acquire("t1", "http_get", SLOW, f"call-{i}") for i in range(6)]
    assert [a.allowed for a in answers] == [True, True, True, False, False, False]
    waits = [a.retry_after_ms for a in answers[3:]]
    # Each waiter holds the next slot: one, two, three refill periods out (minus time already gone).
    for k, wait in enumerate(waits, start=1):
        assert (k - 1) * SLOT_MS < wait <= k * SLOT_MS, waits


def test_asking_again_for_the_same_call_never_takes_a_second_token(make_limiter):
    rl = make_limiter()
    first = rl.acquire("t1", "kv_put", SLOW, "call-a")
    assert first.allowed
    for _ in range(5):
        assert rl.acquire("t1", "kv_put", SLOW, "call-a").allowed
    # Two tokens are still there for others.
    assert rl.acquire("t1", "kv_put", SLOW, "call-b").allowed
    assert rl.acquire("t1", "kv_put", SLOW, "call-c").allowed
    waiting = rl.acquire("t1", "kv_put", SLOW, "call-d")
    again = rl.acquire("t1", "kv_put", SLOW, "call-d")
    assert not waiting.allowed and not again.allowed and again.retry_after_ms <= waiting.retry_after_ms
    # call-d's reservation is the first slot; a newcomer queues behind it.
    assert rl.acquire("t1", "kv_put", SLOW, "call-e").retry_after_ms > again.retry_after_ms


def test_buckets_are_per_tenant_and_tool(make_limiter):
    rl = make_limiter()
    one = RateLimit(limit=1, per_s=100)
    assert rl.acquire("t1", "http_get", one, "a").allowed
    assert not rl.acquire("t1", "http_get", one, "b").allowed
    assert rl.acquire("t2", "http_get", one, "c").allowed
    assert rl.acquire("t1", "kv_get", one, "d").allowed


def test_waits_beyond_max_wait_are_not_reserved(make_limiter):
    rl = make_limiter(max_wait_ms=10_000)
    one = RateLimit(limit=1, per_s=100)
    assert rl.acquire("t1", "x", one, "a").allowed
    b = rl.acquire("t1", "x", one, "b")
    c = rl.acquire("t1", "x", one, "c")
    assert not b.allowed and not c.allowed
    # Told to come back when the queue is within max_wait; nobody queued, so c is not behind b.
    assert 0 < b.retry_after_ms <= SLOT_MS - 10_000 and c.retry_after_ms <= b.retry_after_ms


def test_a_reservation_matures_into_an_allowed_call(make_limiter):
    rl = make_limiter()
    assert rl.acquire("t1", "fast", FAST, "a").allowed
    waiting = rl.acquire("t1", "fast", FAST, "b")
    assert not waiting.allowed and 0 < waiting.retry_after_ms <= 2_000
    deadline = time.monotonic() + 10
    while not rl.acquire("t1", "fast", FAST, "b").allowed:
        assert time.monotonic() < deadline, "the reservation never matured"
        time.sleep(0.01)


@pytest.mark.integration
def test_two_gateway_instances_share_one_bucket(redis_url):
    prefix = f"test-{uuid.uuid4().hex[:12]}:"
    a = RedisRateLimiter.from_url(redis_url, key_prefix=prefix)
    b = RedisRateLimiter.from_url(redis_url, key_prefix=prefix)
    try:
        one = RateLimit(limit=1, per_s=100)
        assert a.acquire("t1", "x", one, "call-1").allowed
        assert not b.acquire("t1", "x", one, "call-2").allowed
        assert b.acquire("t1", "x", one, "call-1").allowed  # the grant is shared too
        bucket, grant = bucket_keys(prefix, "t1", "x", "call-1")
        client = redis.Redis.from_url(redis_url)
        assert client.exists(bucket) and 0 < client.pttl(bucket) <= math.ceil(100 * 1000) + 60_000
        assert 0 < client.pttl(grant)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
    finally:
        a.close()
        b.close()


@pytest.mark.integration
def test_an_unreachable_redis_is_reported_not_guessed():
    rl = RedisRateLimiter.from_url("redis://127.0.0.1:1/0")
    with pytest.raises(RateLimiterUnavailable):
        rl.acquire("t1", "x", SLOW, "call")
    rl.close()
