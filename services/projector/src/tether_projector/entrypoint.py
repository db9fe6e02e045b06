"""The projector as a `Processor` on the shared loop in at-least-once mode (docs/projector.md).

`handle` collects the loop batch's events; `before_commit`, which the loop calls before it
commits the batch's input offsets, projects them in ONE read-model transaction and then
publishes them to Redis. So offsets never pass an event whose rows are not committed
(at-least-once), and a redelivery is harmless: every write is keyed by (run_id, seq).
"""

from __future__ import annotations

import structlog
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from tether_messaging.errors import Unprocessable
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_projector.domain.errors import UnsealedEvent
from tether_projector.handlers import BatchResult, Deps, project_batch, publish_live
from tether_projector.ports import LogEvent, ReadModelUnavailable

log = structlog.get_logger("tether_projector")


def unknown_schema_reasons(schema_registry_url: str | None) -> frozenset[str]:
    """Decode failures meaning this build does not know the record's schema (yet): the projector
    stops on them (`LoopConfig.fail_on_decode_errors`) and a rebuild fails, instead of dropping
    the event for good — its run would get a false GAP, and the event, re-driven after the upgrade,
    would be ignored as a duplicate. Other decode failures (corrupt bytes) are still dead-lettered.
    """
    # A newer producer's payload or envelope schema (single-object), or a record the registry
    # knows that no bundled record reads.
    reasons = {"UNKNOWN_FINGERPRINT", "INCOMPATIBLE_SCHEMA"}
    if not schema_registry_url:
        reasons.add("UNKNOWN_SCHEMA_ID")  # registry-framed records, and no registry configured to read them
    return frozenset(reasons)


class ProjectorProcessor:
    """Projects each run log event into PostgreSQL and Redis; emits nothing to Kafka."""

    name = "projector"
    state_codec = None  # the read model itself is the checkpoint (runs.last_seq)

    def __init__(self, deps: Deps, events_topic: str, *, read_model_attempts: int = 8) -> None:
        self.deps = deps
        self.inputs = (events_topic,)
        self._attempts = read_model_attempts
        self._pending: list[LogEvent] = []

    def project(self, events: list[LogEvent]) -> BatchResult:
        """`project_batch`, retried while PostgreSQL is unavailable (the transaction is idempotent)."""
        retrying = Retrying(
            retry=retry_if_exception_type(ReadModelUnavailable),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=0.1, max=5),
            before_sleep=lambda state: (
                self.deps.metrics.read_model_retries.inc(),
                log.warning("read_model_unavailable", attempt=state.attempt_number,
                            error=str(state.outcome.exception()) if state.outcome else ""),
            ),
            reraise=True,
        )
        return retrying(project_batch, events, deps=self.deps)

    def handle(self, msg: Inbound, ctx: Context) -> None:
        env = msg.envelope
        if env.seq is None or env.prev_hash is None or env.hash is None:
            # Dead-lettered by the loop: only the budget writes the log, and always sealed.
            err = UnsealedEvent(env.event_id, env.run_id)
            raise Unprocessable(err.reason, err.detail)
        self._pending.append(LogEvent(env, msg.payload))

    def before_commit(self) -> None:
        """Project the batch's events; raising stops the loop before it commits their offsets."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        self.project(events)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        # The projector never starts slow work; a delivery here is a loop bug worth seeing.
        log.error("unexpected_work_done", key=done.key, run_id=done.run_id)

    def on_tick(self, ctx: TickContext) -> None:
        # Live updates a Redis outage left behind are retried even while no event arrives.
        if self.deps.unpublished:
            publish_live(self.deps)
