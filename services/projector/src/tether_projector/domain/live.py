"""What the projector puts in Redis for a run: the hot-state hash and one live-stream entry per event."""

from __future__ import annotations

import json

from tether_contracts.base import AvroRecord
from tether_contracts.records import Envelope
from tether_projector.domain.state import RunFold


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no whitespace (the project's canonical form)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stream_id(seq: int) -> str:
    """The live-stream entry id of a run's event: its seq, so re-adding an event is refused by Redis."""
    return f"{seq}-0"


def stream_fields(envelope: Envelope, payload: AvroRecord) -> dict[str, str]:
    """Fields of the live-stream entry of one log event."""
    return {
        "seq": str(envelope.seq),
        "event_id": envelope.event_id,
        "event_type": envelope.event_type,
        "recorded_at_ms": str(envelope.recorded_at_ms),
        "tenant_id": envelope.tenant_id,
        "payload": canonical_json(payload.to_avro()),
        "hash": envelope.hash or "",
        "prev_hash": envelope.prev_hash or "",
    }


def hot_state(fold: RunFold) -> dict[str, str]:
    """Fields of the run's hot-state hash (all strings; ended_at_ms is empty while the run is live)."""
    return {
        "tenant_id": fold.tenant_id,
        "status": fold.status,
        "last_seq": str(fold.last_seq),
        "step": str(fold.current_step),
        "steps": str(fold.steps),
        "input_tokens": str(fold.input_tokens),
        "output_tokens": str(fold.output_tokens),
        "cost_usd_micros": str(fold.cost_usd_micros),
        "created_at_ms": str(fold.created_at_ms),
        "updated_at_ms": str(fold.updated_at_ms),
        "ended_at_ms": "" if fold.ended_at_ms is None else str(fold.ended_at_ms),
    }
