"""The live state in Redis: hot-state hash, live event stream and per-tenant active-run index.

Keys (the contract with run-api; `prefix` is TETHER_PROJECTOR_REDIS_KEY_PREFIX, empty in production):
  {prefix}tether:run:{run_id}                      hash: the run's hot state
  {prefix}tether:run:{run_id}:events               stream: one entry per log event, id "{seq}-0"
  {prefix}tether:tenant:{tenant_id}:active-runs    sorted set: live run ids scored by created_at_ms
                                                   (runs created more than the live TTL before the
                                                   newest are dropped; the key lives as long as that TTL)
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from tether_projector.ports import LiveUnavailable, LiveUpdate

# One round trip per event, atomic: add the stream entry unless the stream already reached
# this seq (or there is none), raise the hot state only forwards, and keep the tenant index and
# the keys' lifetime only from a hot state at least as new as the stored one: a late publish
# of an old owner (a rebalance) must not re-add an ended run to the index or renew its keys.
_PUBLISH = """
local hot_key, stream_key, index_key = KEYS[1], KEYS[2], KEYS[3]
local seq = tonumber(ARGV[1])
local hot_seq = tonumber(ARGV[2])
local ended = ARGV[3] == '1'
local ttl = tonumber(ARGV[4])
local maxlen = ARGV[5]
local created = ARGV[6]
local run_id = ARGV[7]
local n_entry = tonumber(ARGV[8])
local first_hot = 9 + 2 * n_entry
local added = 0
local top = redis.call('XREVRANGE', stream_key, '+', '-', 'COUNT', 1)
local top_seq = 0
if #top > 0 then top_seq = tonumber(string.match(top[1][1], '^(%d+)')) end
if n_entry > 0 and seq > top_seq then
  local args = {'XADD', stream_key, 'MAXLEN', '~', maxlen, seq .. '-0'}
  for i = 9, first_hot - 1 do args[#args + 1] = ARGV[i] end
  redis.call(unpack(args))
  added = 1
end
local cur = tonumber(redis.call('HGET', hot_key, 'last_seq') or '0')
if hot_seq > cur then
  local h = {'HSET', hot_key}
  for i = first_hot, #ARGV do h[#h + 1] = ARGV[i] end
  redis.call(unpack(h))
end
if hot_seq >= cur then
  if ended then
    redis.call('ZREM', index_key, run_id)
  else
    redis.call('ZADD', index_key, created, run_id)
    -- Runs that went quiet without an ending (their keys expired) leave the index too.
    redis.call('ZREMRANGEBYSCORE', index_key, '-inf', '(' .. (tonumber(created) - ttl * 1000))
    redis.call('EXPIRE', index_key, ttl)
  end
  redis.call('EXPIRE', hot_key, ttl)
  redis.call('EXPIRE', stream_key, ttl)
elseif added == 1 and redis.call('TTL', stream_key) == -1 then
  redis.call('EXPIRE', stream_key, ttl)  -- never leave a stream without a lifetime
end
return added
"""


def run_key(run_id: str, prefix: str = "") -> str:
    """The run's hot-state hash."""
    return f"{prefix}tether:run:{run_id}"


def stream_key(run_id: str, prefix: str = "") -> str:
    """The run's live event stream."""
    return f"{prefix}tether:run:{run_id}:events"


def tenant_index_key(tenant_id: str, prefix: str = "") -> str:
    """The tenant's live runs."""
    return f"{prefix}tether:tenant:{tenant_id}:active-runs"


class RedisLiveState:
    """LiveState over Redis, one Lua call per event, pipelined per batch."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "",
        stream_maxlen: int = 10_000,
        live_ttl_s: int = 30 * 24 * 3600,
        ended_ttl_s: int = 24 * 3600,
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._maxlen = stream_maxlen
        self._live_ttl = live_ttl_s
        self._ended_ttl = ended_ttl_s
        self._script = client.register_script(_PUBLISH)

    def publish(self, updates: Sequence[LiveUpdate]) -> None:
        if not updates:
            return
        try:
            pipe = self._redis.pipeline(transaction=False)
            for u in updates:
                args: list[str | int] = [
                    u.seq,
                    u.hot_seq,
                    "1" if u.ended else "0",
                    self._ended_ttl if u.ended else self._live_ttl,
                    self._maxlen,
                    u.created_at_ms,
                    u.run_id,
                    len(u.entry),
                ]
                for k, v in u.entry.items():
                    args += [k, v]
                for k, v in u.hot.items():
                    args += [k, v]
                keys = [
                    run_key(u.run_id, self._prefix),
                    stream_key(u.run_id, self._prefix),
                    tenant_index_key(u.tenant_id, self._prefix),
                ]
                self._script(keys=keys, args=args, client=pipe)
            pipe.execute()
        except redis.RedisError as exc:
            raise LiveUnavailable(f"{type(exc).__name__}: {exc}") from exc
