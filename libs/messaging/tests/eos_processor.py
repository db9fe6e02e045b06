"""A test processor for the exactly-once kill test: one output per input, numbered by a per-run counter.

Run as a process: ``python eos_processor.py`` (settings from TETHER_* / TETHER_EOS_* env).
Each input is a StepGranted whose `step` is the run-local input number. Every output is a
StepGranted whose `step` is the run's counter (kept in the changelogged state) and whose
causation id is the input's event id. Inputs whose number is a multiple of WORK_EVERY start
slow work first; inputs behind them wait in the state until the work is done, so outputs stay
in input order. The processor deliberately does NOT drop repeated inputs itself: a record the
loop re-delivered wrongly would show up as a duplicate or a gap in the counters.
"""

from __future__ import annotations

import time

from pydantic import BaseModel
from pydantic_settings import SettingsConfigDict

from tether_contracts.records import Remaining, StepGranted
from tether_messaging.envelopes import derived_id
from tether_messaging.loop import serve_processor
from tether_messaging.processor import Context, Inbound, PydanticStateCodec, TickContext, WorkDone
from tether_messaging.topics import Topics
from tether_runtime.settings import LoopServiceSettings

WORK_EVERY = 7
NAME = "eos"
REMAINING = Remaining(steps=0, tokens=0, cost_usd_micros=0, wall_clock_ms=0)


class EosSettings(LoopServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TETHER_EOS_")
    work_sleep_ms: int = 30
    #: None: as a service decides it (static when the instance id is set); True/False forces it.
    static_membership: bool | None = None


class RunCounter(BaseModel):
    tenant_id: str
    counter: int = 0
    waiting: int | None = None  # input number whose work has not finished
    waiting_event: str | None = None
    queued: list[tuple[int, str]] = []  # inputs behind the waiting one: (number, event id)


class EosProcessor:
    state_codec = PydanticStateCodec(RunCounter)

    def __init__(self, topics: Topics, work_sleep_ms: int) -> None:
        self.name = NAME
        self.inputs = [topics.commands]
        self.output = topics.run_events
        self.work_sleep_s = work_sleep_ms / 1000

    def handle(self, msg: Inbound, ctx: Context) -> None:
        run_id, n = msg.envelope.run_id, msg.payload.step
        state = ctx.get_state(run_id) or RunCounter(tenant_id=msg.envelope.tenant_id)
        if state.waiting is not None and n <= state.waiting:
            # A held input replayed after a failover (inputs arrive in order, so a new one is
            # always beyond the waiting one): the run's unfinished work, which this input or
            # a work chain it began started, never finished. Start it again.
            self._start(ctx, run_id, state, state.waiting)
            return
        if state.waiting is not None:
            state = state.model_copy(update={"queued": [*state.queued, (n, msg.envelope.event_id)]})
        else:
            state = self._process(ctx, run_id, state, n, msg.envelope.event_id)
        ctx.put_state(run_id, state)

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        state = ctx.get_state(done.run_id)
        if state is None or state.waiting is None or done.error is not None or done.result != state.waiting:
            raise RuntimeError(f"unexpected work outcome {done} for state {state}")
        state = self._output(ctx, done.run_id, state, state.waiting, state.waiting_event)
        state = state.model_copy(update={"waiting": None, "waiting_event": None})
        queued = list(state.queued)
        while queued and state.waiting is None:
            n, event_id = queued.pop(0)
            state = self._process(ctx, done.run_id, state.model_copy(update={"queued": queued}), n, event_id)
        ctx.put_state(done.run_id, state.model_copy(update={"queued": queued}))

    def on_tick(self, ctx: TickContext) -> None:
        pass

    def _process(self, ctx: Context, run_id: str, state: RunCounter, n: int, event_id: str) -> RunCounter:
        if n % WORK_EVERY == 0:
            state = state.model_copy(update={"waiting": n, "waiting_event": event_id})
            self._start(ctx, run_id, state, n)
            return state
        return self._output(ctx, run_id, state, n, event_id)

    def _start(self, ctx: Context, run_id: str, state: RunCounter, n: int) -> None:
        sleep_s = self.work_sleep_s

        def work() -> int:
            time.sleep(sleep_s)
            return n

        ctx.start_work(f"{run_id}:{n}", run_id, state.tenant_id, work)

    def _output(self, ctx: Context, run_id: str, state: RunCounter, n: int, event_id: str) -> RunCounter:
        counter = state.counter + 1
        ctx.emit(
            self.output,
            StepGranted(step=counter, remaining=REMAINING),
            run_id=run_id,
            tenant_id=state.tenant_id,
            event_id=derived_id(NAME, run_id, n),
            causation_id=event_id,
        )
        return state.model_copy(update={"counter": counter})


def main() -> int:
    settings = EosSettings()
    overrides = {} if settings.static_membership is None else {"static_membership": settings.static_membership}
    return serve_processor(EosProcessor(Topics(settings.topic_prefix), settings.work_sleep_ms), settings, **overrides)


if __name__ == "__main__":
    raise SystemExit(main())
