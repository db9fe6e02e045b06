"""The budget stream processor: consumes commands and run intake, appends the run event log."""

from __future__ import annotations

import structlog

from tether_budget.domain.decisions import wake_at
from tether_budget.domain.errors import ProtocolViolation
from tether_budget.domain.ledger import Ledger
from tether_budget.domain.tenancy import TenantLedger
from tether_budget.handlers import COMMAND_HANDLERS, INTAKE_HANDLERS, Deps, check_timers
from tether_messaging.errors import Unprocessable
from tether_messaging.processor import Context, Inbound, TickContext, WorkDone

log = structlog.get_logger("tether_budget")

_TENANT_MARK = b'{"kind":"tenant"'


class BudgetStateCodec:
    """Changelog codec of the budget's two kinds of state: run ledgers (key = run id) and tenant
    ledgers (key `tenant:<id>`), both pydantic JSON; a tenant ledger's JSON starts with its kind."""

    def encode(self, state: Ledger | TenantLedger) -> bytes:
        return state.model_dump_json().encode()

    def decode(self, data: bytes) -> Ledger | TenantLedger:
        if data.startswith(_TENANT_MARK):
            return TenantLedger.model_validate_json(data)
        return Ledger.model_validate_json(data)


class BudgetProcessor:
    """The sequencer and ledger keeper, driven by `tether_messaging.loop` (or the in-memory driver).

    Per-run state is the run's `Ledger`, per-tenant state (on each partition lane) the tenant's
    `TenantLedger`, both checkpointed to the `budget` changelog in the same transaction as the
    events appended.
    """

    name = "budget"
    state_codec = BudgetStateCodec()

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.inputs = (deps.topics.commands, deps.topics.run_intake)
        self._tables = {deps.topics.commands: COMMAND_HANDLERS, deps.topics.run_intake: INTAKE_HANDLERS}

    def handle(self, msg: Inbound, ctx: Context) -> None:
        table = self._tables.get(msg.topic)
        if table is None:
            raise Unprocessable("UNEXPECTED_TOPIC", f"budget does not consume {msg.topic}")
        handler = table.get(type(msg.payload))
        if handler is None:
            # E.g. a command smuggled into the intake topic, or a log event fed back as intake.
            raise Unprocessable("UNEXPECTED_RECORD", f"{msg.envelope.event_type} is not accepted on {msg.topic}")
        try:
            handler(msg, ctx, deps=self.deps)
        except ProtocolViolation as exc:
            log.warning(
                "record_refused",
                run_id=msg.envelope.run_id,
                event_id=msg.envelope.event_id,
                event_type=msg.envelope.event_type,
                reason=exc.reason,
                detail=exc.detail,
            )
            raise Unprocessable(exc.reason, exc.detail) from exc

    def on_work_done(self, done: WorkDone, ctx: Context) -> None:
        # The budget never starts slow work; a delivery here is a loop bug worth seeing.
        log.error("unexpected_work_done", key=done.key, run_id=done.run_id)

    def on_tick(self, ctx: TickContext) -> None:
        check_timers(ctx, deps=self.deps)

    def wake_at_ms(self, state: Ledger | TenantLedger) -> int | None:
        """When `on_tick` has work for this ledger: a run's wall-clock cap or retention step, a
        tenant's deferred grants (the loop's timer index; `check_timers` visits only those)."""
        if isinstance(state, TenantLedger):
            return state.deferred_due_at()
        return wake_at(state, retention=self.deps.retention)
