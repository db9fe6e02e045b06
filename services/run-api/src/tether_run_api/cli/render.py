"""How the CLI shows runs, steps, events, traces, agents, tools and approvals (rich tables, or JSON)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from tether_api.v1 import approval_service_pb2 as approvals_pb, run_service_pb2 as runs_pb, types_pb2 as types_pb

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

_STATUS_STYLE = {
    "PENDING": "yellow", "RUNNING": "cyan", "WAITING": "magenta", "COMPLETED": "green",
    "TERMINATED": "red", "REJECTED": "red",
}


def as_json(message: Message) -> str:
    return json.dumps(MessageToDict(message, preserving_proto_field_name=True), indent=2, sort_keys=True)


def print_json(message: Message) -> None:
    """JSON on stdout, unwrapped and unstyled (rich would wrap long lines inside strings)."""
    print(as_json(message), flush=True)


def print_line(text: str) -> None:
    """A plain line on stdout (run ids, JSON lines) for scripts."""
    print(text, flush=True)


def run_status(status: int) -> str:
    return runs_pb.RunStatus.Name(status).removeprefix("RUN_STATUS_")


def approval_status(status: int) -> str:
    return approvals_pb.ApprovalStatus.Name(status).removeprefix("APPROVAL_STATUS_")


def risk(value: int) -> str:
    return types_pb.RiskClass.Name(value).removeprefix("RISK_CLASS_")


def when(ts) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    return datetime.fromtimestamp(ts.ToMilliseconds() / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def usd(micros: int) -> str:
    return f"${micros / 1_000_000:.4f}"


def show_run(run: runs_pb.Run) -> None:
    status = run_status(run.status)
    console.print(f"[bold]run[/] {run.run_id}  [{_STATUS_STYLE.get(status, 'white')}]{status}[/]")
    console.print(f"  agent     {run.agent_id} v{run.agent_version}   submitted by {run.principal_id or '-'}")
    console.print(f"  goal      {run.goal}")
    console.print(f"  steps     {run.steps}   events {run.last_seq}   "
                  f"tokens {run.usage.input_tokens}+{run.usage.output_tokens}   cost {usd(run.usage.cost_usd_micros)}")
    console.print(f"  created   {when(run.create_time)}   ended {when(run.end_time)}")
    if run.HasField("chain_ok") and not run.chain_ok:
        console.print(f"[bold red]chain broken[/]: the run's event log fails its hash-chain check; "
                      f"investigate: tether audit verify --run {run.run_id}")
    if run.answer:
        console.print("[bold]answer[/]")
        console.print(run.answer, markup=False)
    t = run.termination
    if t.reason_code and status != "COMPLETED":
        console.print(f"[bold red]stopped[/] {t.reason_code}: {t.detail}", markup=True)
        for label, items in (("done", t.tool_calls_done), ("pending", t.pending)):
            for item in items:
                console.print(f"  {label:8} {item}", markup=False)
        if t.last_error:
            console.print(f"  last error  {t.last_error}", markup=False)
        if t.suggested_next_action:
            console.print(f"  next        {t.suggested_next_action}", markup=False)


def runs_table(runs: list[runs_pb.Run]) -> Table:
    table = Table("run", "status", "agent", "steps", "created", "goal")
    for r in runs:
        table.add_row(r.run_id, run_status(r.status), f"{r.agent_id} v{r.agent_version}", str(r.steps),
                      when(r.create_time), r.goal[:60])
    return table


def steps_table(steps: list[runs_pb.RunStep]) -> Table:
    table = Table("step", "status", "tokens", "call", "tool", "call status", "detail")
    for s in steps:
        tokens = f"{s.usage.input_tokens}+{s.usage.output_tokens}"
        if not s.tool_calls:
            table.add_row(str(s.step), s.status, tokens, "", "", "", s.assistant_text[:60])
        for i, c in enumerate(s.tool_calls):
            detail = c.error_code or c.detail or c.result_json or c.args_json
            table.add_row(str(s.step) if i == 0 else "", s.status if i == 0 else "", tokens if i == 0 else "",
                          c.call_id, c.tool_name, c.status, detail[:60])
    return table


def event_line(e: runs_pb.RunEvent, start_ms: int | None = None) -> str:
    payload = {}
    try:
        payload = json.loads(e.payload_json or "{}")
    except json.JSONDecodeError:
        pass
    short = e.event_type.removeprefix("tether.v1.")
    bits = []
    for key in ("step", "call_id", "tool_name", "reason_code", "error_code", "finish_reason"):
        if payload.get(key) not in (None, ""):
            bits.append(f"{key}={payload[key]}")
    call = payload.get("call")
    if isinstance(call, dict):
        bits.append(f"call_id={call.get('call_id')} tool={call.get('tool_name')}")
    if short == "ApprovalRequested":
        bits.append(f"approval_id={payload.get('approval_id')}")
    offset = "" if start_ms is None else f"+{e.record_time.ToMilliseconds() - start_ms:>7} ms  "
    return f"{e.seq:>5}  {offset}{short:<24} {' '.join(bits)}"


def trace_tables(resp: runs_pb.GetRunTraceResponse) -> tuple[Table, Table]:
    events = Table("seq", "offset ms", "+ms", "event", "step", "call")
    for t in resp.events:
        events.add_row(str(t.seq), str(t.offset_ms), str(t.since_previous_ms),
                       t.event_type.removeprefix("tether.v1."), str(t.step or ""), t.call_id)
    spans = Table("span", "kind", "start ms", "duration ms", "outcome", "seq")
    for s in resp.spans:
        spans.add_row(s.name, s.kind, str(s.start_offset_ms), str(s.duration_ms), s.outcome or "(open)",
                      f"{s.start_seq}-{s.end_seq}")
    return events, spans


def agents_table(agents) -> Table:
    table = Table("agent", "version", "name", "model", "tools", "max steps", "created")
    for a in agents:
        table.add_row(a.agent_id, str(a.version), a.display_name, f"{a.model.provider}/{a.model.name}",
                      ", ".join(a.tool_allowlist), str(a.caps.max_steps), when(a.create_time))
    return table


def tools_table(tools) -> Table:
    table = Table("tool", "version", "risk", "executor", "idempotent", "untrusted", "egress", "disabled")
    for t in tools:
        table.add_row(t.name, str(t.version), risk(t.risk_class), t.executor_kind, str(t.idempotent),
                      str(t.untrusted_source), str(t.egress), str(t.disabled))
    return table


def keys_table(keys) -> Table:
    """API keys by key id (tether admin list-keys); there is no key to show, only its hash is stored."""
    # The key id is what revoke-key --key-id takes: never wrapped or cut.
    table = Table(Column("key id", no_wrap=True, min_width=12), "principal", "roles", "label", "created", "revoked")
    for k in keys:
        table.add_row(k.key_id, Text(k.principal_id), ", ".join(k.roles), Text(k.label),
                      k.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                      k.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if k.revoked_at else "-")
    return table


def approvals_table(approvals) -> Table:
    table = Table("approval", "status", "run", "call", "tool", "reasons", "expires", "args")
    for a in approvals:
        table.add_row(a.approval_id, approval_status(a.status), a.run_id, a.call_id, a.tool_name,
                      ", ".join(a.reasons), when(a.expire_time), a.args_json[:60])
    return table


def show_approval(a: approvals_pb.Approval) -> None:
    console.print(f"[bold]approval[/] {a.approval_id}  {approval_status(a.status)}")
    console.print(f"  run {a.run_id}  call {a.call_id}  tool [bold]{a.tool_name}[/] ({risk(a.risk_class)})")
    console.print(f"  reasons   {', '.join(a.reasons) or '-'}", markup=False)
    console.print(f"  expires   {when(a.expire_time)}")
    console.print("  arguments", markup=False)
    try:
        console.print_json(a.args_json)
    except Exception:  # not JSON: show it verbatim rather than fail the review
        console.print(a.args_json, markup=False)
    console.print(f"  args hash {a.args_hash}", markup=False)
