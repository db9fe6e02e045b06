"""Rate limits per (tenant, tool) in Redis: a token bucket with reservations, in one Lua script.

A call that finds a token takes it. A call that finds none reserves the next one (the bucket
goes negative) and is told how long until its token matures; its reservation is kept under its
idem_key, so when the gateway comes back after `retry_after_ms` it is allowed at once, and a
replayed or restarted call never takes a second token. Calls are served in arrival order, not
in a race after each refill. A reservation further out than `max_wait_ms` is not made: the call
is told to come back when the queue has drained that far. Time is Redis's own clock (TIME), so
gateway instances with skewed clocks share one bucket consistently.
"""

from __future__ import annotations

import math

import redis
from redis.exceptions import RedisError

from tether_tool_gateway.domain.canonical import sha256_hex
from tether_tool_gateway.domain.policy import RateAnswer
from tether_tool_gateway.domain.policy_document import RateLimit
from tether_tool_gateway.ports import RateLimiterUnavailable

# KEYS[1] bucket hash {tokens, ts}; KEYS[2] this call's grant (ms at which it may run)
# ARGV: rate per ms, capacity, max wait ms, grant ttl ms, bucket ttl ms
_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local grant = redis.call('GET', KEYS[2])
if grant then
  local at = tonumber(grant)
  if at <= now then return {1, 0} end
  return {0, at - now}
end
local rate = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1])
local ts = tonumber(b[2])
if tokens == nil or ts == nil then
  tokens = cap
  ts = now
end
if now > ts then
  tokens = math.min(cap, tokens + (now - ts) * rate)
  ts = now
end
local after = tokens - 1
local wait = 0
if after < 0 then wait = math.ceil(-after / rate) end
if wait > max_wait then
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(ts))
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {0, math.max(1, wait - max_wait)}
end
redis.call('HSET', KEYS[1], 'tokens', tostring(after), 'ts', tostring(ts))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('SET', KEYS[2], tostring(now + wait), 'PX', ARGV[4])
if wait == 0 then return {1, 0} end
return {0, wait}
"""


def bucket_keys(prefix: str, tenant_id: str, tool_name: str, idem_key: str) -> tuple[str, str]:
    """The bucket's key and the call's grant key; one hash tag, so both live in one cluster slot."""
    tag = sha256_hex(f"{tenant_id}\x1f{tool_name}")[:16]
    base = f"{prefix}ratelimit:{{{tag}}}"
    return f"{base}:bucket", f"{base}:grant:{idem_key}"


def bucket_ttl_ms(limit: RateLimit) -> int:
    """Long enough for an idle bucket to refill completely (then it may as well not exist)."""
    return math.ceil(limit.capacity / limit.rate_per_s * 1000) + 60_000


class RedisRateLimiter:
    """The RateLimiter port on Redis (tether_tool_gateway.ports.RateLimiter)."""

    def __init__(self, client: redis.Redis, *, key_prefix: str = "tether:gateway:", max_wait_ms: int = 300_000,
                 grant_ttl_ms: int = 24 * 3_600_000) -> None:
        self._client = client
        self._prefix = key_prefix
        self._max_wait_ms = max_wait_ms
        self._grant_ttl_ms = grant_ttl_ms
        self._script = client.register_script(_SCRIPT)

    @classmethod
    def from_url(cls, url: str, **kw: object) -> RedisRateLimiter:
        client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        return cls(client, **kw)  # type: ignore[arg-type]

    def acquire(self, tenant_id: str, tool_name: str, limit: RateLimit, idem_key: str) -> RateAnswer:
        bucket, grant = bucket_keys(self._prefix, tenant_id, tool_name, idem_key)
        args = [repr(limit.rate_per_s / 1000), limit.capacity, self._max_wait_ms, self._grant_ttl_ms,
                bucket_ttl_ms(limit)]
        try:
            allowed, wait = self._script(keys=[bucket, grant], args=args)
        except RedisError as exc:
            raise RateLimiterUnavailable(f"redis: {type(exc).__name__}: {exc}") from exc
        return RateAnswer(allowed=bool(allowed), retry_after_ms=int(wait))

    def close(self) -> None:
        self._client.close()
