"""Projecting a batch of log events: one read-model transaction, then the live state in Redis."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from tether_projector.domain.errors import UnsealedEvent
from tether_projector.domain.live import hot_state, stream_fields
from tether_projector.domain.project import advance, is_duplicate, problem_kind, run_row
from tether_projector.domain.rows import Upsert, merge
from tether_projector.domain.state import RunFold
from tether_projector.metrics import ProjectorMetrics
from tether_projector.ports import LiveState, LiveUnavailable, LiveUpdate, LogEvent, ReadModel

log = structlog.get_logger("tether_projector")


#: Most live updates kept for a republish while Redis is away; past it only each run's last
#: update is kept (its hot state and active-runs entry heal, the stream entries between are lost).
MAX_UNPUBLISHED = 100_000


@dataclass(frozen=True)
class Deps:
    """What projection needs; `live` is None when Redis is not to be touched (e.g. a rebuild)."""

    read_model: ReadModel
    live: LiveState | None
    metrics: ProjectorMetrics
    #: Per run, in order, the live updates whose publish failed (their read-model rows and the
    #: input offsets are committed, so nothing redelivers them): published again, before anything
    #: newer, by the next publish that gets through (`publish_live`).
    unpublished: dict[str, list[LiveUpdate]] = field(default_factory=dict)


@dataclass
class BatchResult:
    """What a batch did."""

    applied: int = 0
    duplicates: int = 0
    #: Events that can never be projected, with the reason (the caller dead-letters or reports them).
    rejected: list[tuple[LogEvent, UnsealedEvent]] = field(default_factory=list)
    chain_problems: list[str] = field(default_factory=list)


def project_batch(events: Sequence[LogEvent], *, deps: Deps) -> BatchResult:
    """Project events in log order in ONE read-model transaction, then publish them live.

    Idempotent: an event at or below its run's stored last_seq writes nothing (it is still
    re-published live, which Redis dedups, so a crash between the commit and the publish heals
    on redelivery). The transaction commits every event's rows together with its run's
    last_seq, so the read model never holds half an event.
    """
    started = time.monotonic()
    result = BatchResult()
    sealed: list[LogEvent] = []
    for ev in events:
        if ev.envelope.seq is None or ev.envelope.prev_hash is None or ev.envelope.hash is None:
            result.rejected.append((ev, UnsealedEvent(ev.envelope.event_id, ev.envelope.run_id)))
        else:
            sealed.append(ev)

    duplicate_flags: list[bool] = []
    with deps.read_model.transaction() as tx:
        # Fresh objects this batch owns (also on a retry, which loads them again): advanced in place.
        folds: dict[str, RunFold] = tx.load_runs(sorted({ev.envelope.run_id for ev in sealed}))
        advanced: dict[str, RunFold] = {}
        writes: list[Upsert] = []
        for ev in sealed:
            run_id = ev.envelope.run_id
            fold = folds.get(run_id)
            if is_duplicate(fold, ev.envelope):
                duplicate_flags.append(True)
                continue
            projected = advance(fold, ev.envelope, ev.payload)
            folds[run_id] = advanced[run_id] = projected.fold
            writes.extend(projected.writes)
            result.chain_problems.extend(projected.chain_problems)
            duplicate_flags.append(False)
        writes.extend(run_row(fold) for fold in advanced.values())
        tx.write(merge(writes))

    result.applied = duplicate_flags.count(False)
    result.duplicates = duplicate_flags.count(True)
    m = deps.metrics
    m.events.labels("applied").inc(result.applied)
    m.events.labels("duplicate").inc(result.duplicates)
    m.events.labels("rejected").inc(len(result.rejected))
    for problem in result.chain_problems:
        m.chain_problems.labels(problem_kind(problem)).inc()
        log.warning("chain_problem", problem=problem)

    if deps.live is not None and sealed:
        publish_live(deps, [_live_update(ev, folds[ev.envelope.run_id]) for ev in sealed])
    m.batch_seconds.observe(time.monotonic() - started)
    return result


def publish_live(deps: Deps, updates: Sequence[LiveUpdate] = ()) -> bool:
    """Publish `updates` after those an earlier failure left in `deps.unpublished`; False if Redis failed.

    A failure does not fail the batch: PostgreSQL is the source of truth for readers, and failing
    would stall the read model too. But the batch's offsets are committed, so nothing redelivers
    these updates: they are kept and published again first by the next call that gets through (the
    next batch, or the processor's tick). Otherwise an ended run whose last batch met a Redis outage
    stayed "running" in its hot state and in the tenant's active-runs index. Republishing is
    harmless: the stream refuses seqs it has, the hot state and index take no older state.
    """
    if deps.live is None:
        return True
    pending = [u for run_updates in deps.unpublished.values() for u in run_updates]
    if not pending and not updates:
        return True
    try:
        deps.live.publish([*pending, *updates])
    except LiveUnavailable as exc:
        deps.metrics.live_failures.inc()
        for u in updates:
            deps.unpublished.setdefault(u.run_id, []).append(u)
        kept = sum(len(v) for v in deps.unpublished.values())
        if kept > MAX_UNPUBLISHED:
            for run_id, run_updates in deps.unpublished.items():
                deps.unpublished[run_id] = run_updates[-1:]
        log.warning("live_publish_failed", error=str(exc), events=len(updates),
                    runs_unpublished=len(deps.unpublished))
        return False
    if pending:
        log.info("live_republished", runs=len(deps.unpublished), events=len(pending))
    deps.unpublished.clear()
    return True


def _live_update(ev: LogEvent, fold: RunFold) -> LiveUpdate:
    env = ev.envelope
    return LiveUpdate(
        run_id=env.run_id,
        tenant_id=fold.tenant_id,
        seq=env.seq or 0,
        # An event naming another tenant (TENANT_MISMATCH) gets no entry in this run's stream,
        # which its tenant's followers read: it is in the events table under its own tenant.
        entry=stream_fields(env, ev.payload) if env.tenant_id == fold.tenant_id else {},
        hot=hot_state(fold),
        hot_seq=fold.last_seq,
        created_at_ms=fold.created_at_ms,
        ended=fold.ended,
    )
