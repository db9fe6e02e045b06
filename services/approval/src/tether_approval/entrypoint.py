"""The approval stream processor: parks tool calls awaiting a human, decides them, expires them."""

from __future__ import annotations

import structlog

from tether_approval.domain.decisions import wake_at
from tether_approval.domain.state import RunApprovals
from tether_approval.handlers import (
    COMMAND_HANDLERS,
    NOTIFY_PREFIX,
    RUN_EVENT_HANDLERS,
    Deps,
    expire_approvals,
    on_notification_done,
)
from tether_messaging.errors import Unprocessable
from tether_messaging.processor import Context, Inbound, PydanticStateCodec, TickContext, WorkDone

log = structlog.get_logger("tether_approval")


class ApprovalProcessor:
    """Driven by `tether_messaging.loop` (or the in-memory driver in tests).

    Consumes the run event log and the commands topic; per-run state is `RunApprovals`,
    checkpointed to the `approval` changelog in the same transaction as the decisions emitted.
    Its tick (expiry) waits on each partition until the input backlog found at assignment is read,
    and expires only what the commands read so far show no decision came for in time.
    """

    name = "approval"
    state_codec = PydanticStateCodec(RunApprovals)

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.inputs = (deps.topics.run_events, deps.topics.commands)
        self._tables = {deps.topics.run_events: RUN_EVENT_HANDLERS, deps.topics.commands: COMMAND_HANDLERS}
        # Every other event on these topics belongs to another service: the loop passes over
        # them by their type header instead of decoding them (tether_messaging.processor.EventFilter).
        self.event_types = {topic: frozenset(cls.AVRO_NAME for cls in table) for topic, table in self._tables.items()}
        # Expiry decides that no decision came in time. After a restart or rebalance the loop would
        # tick as soon as the states are restored, before it has read the decisions (commands) and
        # requests, withdrawals and run ends (run events) that piled up meanwhile: approvals a human
        # decided in time would expire. A partition ticks only once that backlog is handled, and a
        # running loop behind its input tells the tick how far it has read
        # (tether_messaging.processor.BacklogBeforeTick; the rule is `domain.decisions.expire_due`).
        self.tick_after_backlog = frozenset(self.inputs)

    def handle(self, msg: Inbound, ctx: Context) -> None:
        table = self._tables.get(msg.topic)
        if table is None:
            raise Unprocessable("UNEXPECTED_TOPIC", f"approval does not consume {msg.topic}")
        handler = table.get(type(msg.payload))
        if handler is not None:  # every other event and command belongs to another service
            handler(msg.payload, msg, ctx, deps=self.deps)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        if done.key.startswith(NOTIFY_PREFIX):
            on_notification_done(done, ctx, deps=self.deps)
        else:
            log.error("unexpected_work_done", key=done.key, run_id=done.run_id)

    def on_tick(self, ctx: TickContext) -> None:
        expire_approvals(ctx, deps=self.deps)

    def wake_at_ms(self, state: RunApprovals) -> int | None:
        """When a pending approval expires or an early decision goes stale (`expire_approvals`
        visits only runs due by this)."""
        return wake_at(state, self.deps.policy)
