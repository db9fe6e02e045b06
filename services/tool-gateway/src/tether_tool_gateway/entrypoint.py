"""The tool-gateway stream processor: consumes the run event log, emits decisions and outcomes to intake."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import structlog

from tether_messaging.errors import Unprocessable
from tether_messaging.processor import Context, Inbound, PydanticStateCodec, TickContext, WorkDone
from tether_tool_gateway.domain.errors import ProtocolViolation
from tether_tool_gateway.domain.state import CallStatus, RunState
from tether_tool_gateway.handlers import (
    HANDLERS,
    Deps,
    StartedCalls,
    call_work_key,
    on_call_work_done,
    on_sweep_done,
    start_execution,
    sweep_work_key,
)

log = structlog.get_logger("tether_tool_gateway.entrypoint")

NAME = "tool-gateway"
SWEEP_RUN_ID = "__gateway_sweep__"  # sweep work belongs to no run; run ids never look like this


class GatewayProcessor:
    """Processor "tool-gateway": input `tether.run-events.v1`, output `tether.run-intake.v1`.

    Per-run state (RunState) is checkpointed by the loop. Executions and sweeps run as work off
    the loop thread. on_tick re-starts calls that are EXECUTING without work in this process
    (after a failover, or after waiting for another instance's lease), starts RATE_LIMITED calls
    whose not-before time has come, and, every `sweep_interval_ms`, sweeps each owned
    partition's expired ledger leases.
    """

    name = NAME

    def __init__(self, deps: Deps, *, sweep_interval_ms: int = 5_000, sweep_limit: int = 100) -> None:
        self.deps = deps
        self.inputs: Sequence[str] = [deps.topics.run_events]
        # Run events no handler acts on (StepGranted, ModelCallCompleted, ...) are passed over by
        # their type header, undecoded (tether_messaging.processor.EventFilter).
        self.event_types = {deps.topics.run_events: frozenset(cls.AVRO_NAME for cls in HANDLERS)}
        self.state_codec = PydanticStateCodec(RunState)
        self._sweep_interval_ms = sweep_interval_ms
        self._sweep_limit = sweep_limit
        self._next_sweep_ms = 0
        # Work keys this process started for calls not yet resolved. A call EXECUTING in the
        # state but absent here was started by a previous owner: on_tick starts it again at once.
        self._seen = StartedCalls()

    def handle(self, msg: Inbound, ctx: Context) -> None:
        handler = HANDLERS.get(type(msg.payload))
        if handler is None:
            return  # run events the gateway does not act on (StepGranted, ModelCallCompleted, ...)
        try:
            handler(msg.payload, msg, ctx, deps=self.deps, seen=self._seen)
        except ProtocolViolation as exc:
            raise Unprocessable(exc.reason, exc.detail) from exc

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        kind, _, rest = done.key.partition(":")
        if kind == "sweep":
            if done.error is not None:
                log.warning("sweep_failed", partition=ctx.partition, error=f"{type(done.error).__name__}: {done.error}")
                return
            on_sweep_done(done.result, ctx, deps=self.deps)
            return
        idem_key = rest.split(":", 1)[0]
        on_call_work_done(done.result, done.error, ctx, deps=self.deps, run_id=done.run_id, idem_key=idem_key,
                          seen=self._seen)

    def on_tick(self, ctx: TickContext) -> None:
        now = ctx.now_ms
        sweep_due = now >= self._next_sweep_ms
        if sweep_due:
            self._next_sweep_ms = now + self._sweep_interval_ms
        owned = ctx.owned_partitions()
        self._seen.keep_only(owned)  # calls of partitions that moved away are no longer ours
        for partition in owned:
            pctx = ctx.for_partition(partition)
            self._restart_stalled(pctx, ctx.runs_due(partition), now)
            if sweep_due:
                pctx.start_work(sweep_work_key(partition), SWEEP_RUN_ID, "",
                                partial(self.deps.runner.sweep, partition, self._sweep_limit))

    def wake_at_ms(self, state: RunState) -> int | None:
        """When on_tick may have to start one of the run's calls (the loop's timer index).

        An EXECUTING call is due at every tick: whether its work runs in this process is known
        only here (`_seen`), not from the state, and after a failover it must start at once.
        Such runs have work in flight, so they are few; a run parked on an approval has none.
        """
        times = [0 if c.status is CallStatus.EXECUTING else c.not_before_ms
                 for c in state.calls.values() if c.status in (CallStatus.EXECUTING, CallStatus.RATE_LIMITED)]
        return min(times, default=None)

    def _restart_stalled(self, ctx: Context, run_ids: Sequence[str], now: int) -> None:
        for run_id in run_ids:
            run = ctx.get_state(run_id)
            if run is None:
                continue
            due = [c for c in run.calls.values()
                   if (c.status is CallStatus.EXECUTING
                       and (now >= c.recheck_at_ms or call_work_key(c.idem_key) not in self._seen))
                   or (c.status is CallStatus.RATE_LIMITED and now >= c.not_before_ms)]
            if not due:
                continue
            run = run.model_copy(deep=True)
            for call in due:
                start_execution(run.calls[call.call_id], run, run_id, ctx, self.deps, self._seen)
            ctx.put_state(run_id, run)

