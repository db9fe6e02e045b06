"""The planner stream processor: consumes the run event log, emits model outcomes to run intake."""

from __future__ import annotations

import structlog

from tether_messaging.processor import Context, Inbound, TickContext, WorkDone
from tether_planner.handlers import HANDLERS, Deps, on_step_work_done
from tether_planner.statecodec import RunStateCodec

log = structlog.get_logger("tether_planner")


class PlannerProcessor:
    """Driven by `tether_messaging.loop` (or the in-memory driver in tests).

    Per-run state is the run's working context (`RunState`), checkpointed to the `planner`
    changelog (compressed JSON) in the same transaction as the events emitted for it.
    """

    name = "planner"
    state_codec = RunStateCodec()

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.inputs = (deps.topics.run_events,)
        # The events no handler acts on are passed over by their type header, undecoded.
        self.event_types = {deps.topics.run_events: frozenset(cls.AVRO_NAME for cls in HANDLERS)}

    def handle(self, msg: Inbound, ctx: Context) -> None:
        handler = HANDLERS.get(type(msg.payload))
        if handler is not None:
            handler(msg, ctx, deps=self.deps)
        # Other log events (ToolCallBudgeted, approvals, RunRejected) do not change the context.

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        on_step_work_done(done, ctx, deps=self.deps)

    def on_tick(self, ctx: TickContext) -> None:
        # No timers: a step's deadline is the budget's (wall-clock cap) and the provider's timeouts.
        return
