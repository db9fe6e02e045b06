"""The projector as a `Processor` on the shared loop in at-least-once mode (docs/projector.md).

The loop commits the input offsets only after `handle` returned, and `handle` returns only
after the event's read-model transaction committed: at-least-once, made harmless by the
(run_id, seq) idempotence of every write.
"""

from __future__ import annotations

import structlog
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from tether_messaging.errors import Unprocessable
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_projector.handlers import BatchResult, Deps, project_batch
from tether_projector.ports import LogEvent, ReadModelUnavailable

log = structlog.get_logger("tether_projector")


class ProjectorProcessor:
    """Projects each run log event into PostgreSQL and Redis; emits nothing to Kafka."""

    name = "projector"
    state_codec = None  # the read model itself is the checkpoint (runs.last_seq)

    def __init__(self, deps: Deps, events_topic: str, *, read_model_attempts: int = 8) -> None:
        self.deps = deps
        self.inputs = (events_topic,)
        self._attempts = read_model_attempts

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
        result = self.project([LogEvent(msg.envelope, msg.payload)])
        if result.rejected:
            _event, error = result.rejected[0]
            raise Unprocessable(error.reason, error.detail)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        # The projector never starts slow work; a delivery here is a loop bug worth seeing.
        log.error("unexpected_work_done", key=done.key, run_id=done.run_id)

    def on_tick(self, ctx: TickContext) -> None:
        pass
