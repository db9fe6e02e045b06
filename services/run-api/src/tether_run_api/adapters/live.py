"""A run's live events from the projector's Redis Stream `tether:run:{run_id}:events`.

Redis is only the wake-up path: when it is unreachable the stream handler keeps serving from
the read model by polling, so a Redis outage slows streams down but loses nothing.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
import structlog

from tether_run_api.domain.views import EventView
from tether_run_api.ports import LiveEntry

log = structlog.get_logger("tether_run_api.live")

_START = "0-0"


def stream_key(run_id: str, prefix: str = "") -> str:
    """The Redis Stream of a run's events (the projector's contract)."""
    return f"{prefix}tether:run:{run_id}:events"


def _text(fields: dict[bytes, bytes], name: str) -> str | None:
    raw = fields.get(name.encode())
    return raw.decode() if raw is not None else None


def entry_from_fields(run_id: str, fields: dict[bytes, bytes]) -> LiveEntry | None:
    """A live entry from a stream entry's fields; None if it carries no usable seq."""
    seq_text = _text(fields, "seq")
    if seq_text is None or not seq_text.isdigit():
        return None
    seq = int(seq_text)
    event_id = _text(fields, "event_id")
    event_type = _text(fields, "event_type")
    recorded = _text(fields, "recorded_at_ms")
    payload = _text(fields, "payload") or _text(fields, "payload_json")
    if event_id is None or event_type is None or recorded is None or not recorded.lstrip("-").isdigit():
        return LiveEntry(seq=seq, event=None)  # a bare notification: the handler reads the event from the read model
    if payload is not None:
        try:
            payload = json.dumps(json.loads(payload), sort_keys=True)
        except json.JSONDecodeError:
            return LiveEntry(seq=seq, event=None)
    return LiveEntry(
        seq=seq,
        event=EventView(
            run_id=run_id,
            seq=seq,
            event_id=event_id,
            event_type=event_type,
            recorded_at_ms=int(recorded),
            payload_json=payload or "{}",
            hash=_text(fields, "hash") or "",
            prev_hash=_text(fields, "prev_hash") or "",
        ),
    )


class RedisLiveEvents:
    """LiveEvents over Redis Streams (XREVRANGE for the position, XREAD BLOCK to wait)."""

    def __init__(self, client: redis.Redis, *, key_prefix: str = "", batch: int = 200) -> None:
        self._redis = client
        self._prefix = key_prefix
        self._batch = batch

    def position(self, run_id: str) -> str:
        try:
            last: list[tuple[bytes, Any]] = self._redis.xrevrange(stream_key(run_id, self._prefix), count=1)
        except redis.RedisError as exc:
            log.warning("live_feed_unavailable", run_id=run_id, error=type(exc).__name__)
            return _START  # read everything retained once Redis is back; seq dedup drops repeats
        return last[0][0].decode() if last else _START

    def read(self, run_id: str, cursor: str, block_ms: int) -> tuple[list[LiveEntry], str]:
        key = stream_key(run_id, self._prefix)
        try:
            reply = self._redis.xread({key: cursor}, count=self._batch, block=block_ms)
        except redis.RedisError as exc:
            log.warning("live_feed_unavailable", run_id=run_id, error=type(exc).__name__)
            time.sleep(block_ms / 1000.0)  # the caller then polls the read model, as on a quiet feed
            return [], cursor
        entries: list[LiveEntry] = []
        for _key, items in reply or []:
            for entry_id, fields in items:
                cursor = entry_id.decode()
                entry = entry_from_fields(run_id, fields)
                if entry is not None:
                    entries.append(entry)
        return entries, cursor
