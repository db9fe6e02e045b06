"""Queries over the projector's read model (schema read_model); run-api only reads it.

The tables and columns used here are the projector's contract (services/projector/README.md).
Every query is filtered by tenant_id, so another tenant's run or approval reads as absent.
"""

from __future__ import annotations

import json
from typing import Any

from psycopg import errors, sql
from psycopg_pool import ConnectionPool

from tether_contracts.records import TerminationReport, Usage
from tether_run_api.adapters.postgres import unavailable_as_error
from tether_run_api.domain.errors import BackendUnavailable
from tether_run_api.domain.views import (
    ApprovalView,
    EventView,
    RefusedDecisionView,
    RunStatus,
    RunView,
    StepView,
    ToolCallView,
)


def _usage(row: dict[str, Any], prefix: str = "") -> Usage:
    return Usage(
        input_tokens=row.get(f"{prefix}input_tokens") or 0,
        output_tokens=row.get(f"{prefix}output_tokens") or 0,
        cost_usd_micros=row.get(f"{prefix}cost_usd_micros") or 0,
    )


def _json(value: Any) -> Any:
    if value is None or isinstance(value, (dict, list)):
        return value
    return json.loads(value)


# The projector's runs.status values (tether_projector.domain.state.RunStatus) → the API's.
_STATUS = {
    "QUEUED": RunStatus.QUEUED,  # waiting in its tenant's queue (RunQueued)
    "ACCEPTED": RunStatus.RUNNING,  # admitted, no step granted yet
    "RUNNING": RunStatus.RUNNING,
    "WAITING_APPROVAL": RunStatus.WAITING,
    "OUTCOME_UNKNOWN": RunStatus.WAITING,  # a human must resolve a call whose outcome is unknown
    "COMPLETED": RunStatus.COMPLETED,
    "TERMINATED": RunStatus.TERMINATED,
    "REJECTED": RunStatus.REJECTED,
}


def _status(value: str) -> RunStatus:
    # A status the projector added later than this run-api: the run exists and is not known
    # to be finished, so RUNNING is the honest reading.
    return _STATUS.get(value, RunStatus.RUNNING)


def _run(row: dict[str, Any]) -> RunView:
    report = _json(row.get("termination"))
    return RunView(
        run_id=row["run_id"],
        status=_status(row["status"]),
        agent_id=row.get("agent_id") or "",
        agent_version=row.get("agent_version") or 0,
        goal=row.get("goal") or "",
        principal_id=row.get("principal_id") or "",
        answer=row.get("answer") or "",
        usage=_usage(row),
        steps=row.get("steps") or 0,
        termination=TerminationReport.model_validate(report) if report else None,
        created_at_ms=row.get("created_at_ms") or 0,
        updated_at_ms=row.get("updated_at_ms") or 0,
        ended_at_ms=row.get("ended_at_ms"),
        last_seq=row.get("last_seq") or 0,
        chain_ok=row.get("chain_ok"),
    )


def _event(row: dict[str, Any]) -> EventView:
    payload = row.get("payload")
    return EventView(
        run_id=row["run_id"],
        seq=row["seq"],
        event_id=row["event_id"],
        event_type=row["event_type"],
        recorded_at_ms=row["recorded_at_ms"],
        payload_json=payload if isinstance(payload, str) else json.dumps(payload or {}, sort_keys=True),
        hash=row.get("hash") or "",
        prev_hash=row.get("prev_hash") or "",
    )


def _tool_call(row: dict[str, Any]) -> ToolCallView:
    return ToolCallView(
        call_id=row["call_id"],
        tool_name=row.get("tool_name") or "",
        args_json=row.get("args_json") or "",
        args_hash=row.get("args_hash") or "",
        status=row.get("status") or "",
        result_json=row.get("result_json") or "",
        error_code=row.get("error_code") or "",
        detail=row.get("detail") or "",
        approval_id=row.get("approval_id") or "",
    )


def _approval(row: dict[str, Any]) -> ApprovalView:
    return ApprovalView(
        approval_id=row["approval_id"],
        run_id=row["run_id"],
        call_id=row["call_id"],
        args_hash=row["args_hash"],
        status=row["status"],
        step=row.get("step") or 0,
        tool_name=row.get("tool_name") or "",
        args_json=row.get("args_json") or "",
        risk_class=row.get("risk_class") or "",
        reasons=tuple(row.get("reasons") or ()),
        provenance_json=row.get("provenance_json") or "",
        requested_at_ms=row.get("requested_at_ms") or 0,
        expires_at_ms=row.get("expires_at_ms"),
        decided_by=row.get("decided_by") or "",
        decided_at_ms=row.get("decided_at_ms"),
        comment=row.get("comment") or "",
        refused_decision=_refused_decision(row.get("refused_decision")),
    )


def _refused_decision(value: Any) -> RefusedDecisionView | None:
    if not isinstance(value, dict):
        return None
    return RefusedDecisionView(
        approver_id=str(value.get("approver_id") or ""),
        approve=bool(value.get("approve")),
        comment=str(value.get("comment") or ""),
        decided_at_ms=int(value.get("decided_at_ms") or 0),
        reason=str(value.get("reason") or ""),
    )


class PostgresReadModel:
    """ReadModel over the projector's tables: runs, steps, tool_calls, events, approvals."""

    def __init__(self, pool: ConnectionPool, schema: str = "read_model") -> None:
        self._pool = pool
        self._s = sql.Identifier(schema)

    def _all(self, text: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
        try:
            with self._pool.connection() as conn:
                return conn.execute(sql.SQL(text).format(s=self._s), params).fetchall()
        except (errors.UndefinedTable, errors.InvalidSchemaName) as exc:
            # The projector creates the read model at its start-up; until then queries cannot be answered.
            raise BackendUnavailable("read model", "its tables do not exist yet; is the projector running?") from exc

    @unavailable_as_error
    def get_run(self, tenant_id: str, run_id: str) -> RunView | None:
        rows = self._all("SELECT * FROM {s}.runs WHERE tenant_id = %s AND run_id = %s", (tenant_id, run_id))
        return _run(rows[0]) if rows else None

    @unavailable_as_error
    def get_runs(self, tenant_id: str, run_ids: list[str]) -> dict[str, RunView]:
        if not run_ids:
            return {}
        rows = self._all("SELECT * FROM {s}.runs WHERE tenant_id = %s AND run_id = ANY(%s)", (tenant_id, run_ids))
        return {r["run_id"]: _run(r) for r in rows}

    @unavailable_as_error
    def list_steps(self, tenant_id: str, run_id: str, after_step: int, limit: int) -> list[StepView]:
        steps = self._all(
            "SELECT * FROM {s}.steps WHERE tenant_id = %s AND run_id = %s AND step > %s ORDER BY step LIMIT %s",
            (tenant_id, run_id, after_step, limit),
        )
        if not steps:
            return []
        calls = self._all(
            "SELECT * FROM {s}.tool_calls WHERE tenant_id = %s AND run_id = %s AND step = ANY(%s) "
            "ORDER BY step, call_index",
            (tenant_id, run_id, [s["step"] for s in steps]),
        )
        by_step: dict[int, list[ToolCallView]] = {}
        for c in calls:
            by_step.setdefault(c["step"], []).append(_tool_call(c))
        return [
            StepView(
                step=s["step"],
                status=s.get("status") or "",
                usage=_usage(s),
                assistant_text=s.get("assistant_text") or "",
                finish_reason=s.get("finish_reason") or "",
                tool_calls=tuple(by_step.get(s["step"], ())),
                started_at_ms=s.get("started_at_ms"),
                ended_at_ms=s.get("ended_at_ms"),
            )
            for s in steps
        ]

    @unavailable_as_error
    def events(self, tenant_id: str, run_id: str, from_seq: int, limit: int) -> list[EventView]:
        rows = self._all(
            "SELECT * FROM {s}.events WHERE tenant_id = %s AND run_id = %s AND seq >= %s ORDER BY seq LIMIT %s",
            (tenant_id, run_id, from_seq, limit),
        )
        return [_event(r) for r in rows]

    @unavailable_as_error
    def get_approval(self, tenant_id: str, approval_id: str) -> ApprovalView | None:
        rows = self._all(
            "SELECT * FROM {s}.approvals WHERE tenant_id = %s AND approval_id = %s", (tenant_id, approval_id)
        )
        return _approval(rows[0]) if rows else None

    @unavailable_as_error
    def list_approvals(self, tenant_id: str, status: str, run_id: str | None,
                       after: tuple[int, str] | None, limit: int, now_ms: int) -> list[ApprovalView]:
        after_ms, after_id = after if after is not None else (-1, "")
        # The effective status (ApprovalView.effective_status), not the stored one: a PENDING row
        # past its expiry is listed (and shown) as EXPIRED until the approval service records it.
        # Each branch keeps `status = ...` leading, for the (tenant_id, status, ...) index.
        if status == "PENDING":
            where, params = "status = 'PENDING' AND (expires_at_ms IS NULL OR expires_at_ms >= %s)", (now_ms,)
        elif status == "EXPIRED":
            where = "status IN ('EXPIRED', 'PENDING') AND (status = 'EXPIRED' OR expires_at_ms < %s)"
            params = (now_ms,)
        else:
            where, params = "status = %s", (status,)
        rows = self._all(
            "SELECT * FROM {s}.approvals WHERE tenant_id = %s AND " + where + " "
            "AND (%s::text IS NULL OR run_id = %s::text) AND (requested_at_ms, approval_id) > (%s, %s) "
            "ORDER BY requested_at_ms, approval_id LIMIT %s",
            (tenant_id, *params, run_id, run_id, after_ms, after_id, limit),
        )
        return [_approval(r) for r in rows]
