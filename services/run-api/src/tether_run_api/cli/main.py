"""`tether`: submit and watch runs, inspect steps and traces, decide approvals, manage agents and tools.

Connection: --addr / TETHER_ADDR (default 127.0.0.1:50051) and --api-key / TETHER_API_KEY.
`tether admin ...` talks to PostgreSQL directly (TETHER_PG_DSN) to set up tenants and keys.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import grpc
import typer
from google.protobuf import field_mask_pb2
from google.protobuf.json_format import ParseDict, ParseError
from google.rpc import error_details_pb2

from tether_api.v1 import (
    agent_service_pb2 as agents_pb,
    approval_service_pb2 as approvals_pb,
    run_service_pb2 as runs_pb,
    tool_service_pb2 as tools_pb,
    types_pb2 as types_pb,
)
from tether_run_api.api.status import error_info
from tether_run_api.cli import render
from tether_run_api.cli.audit import audit_app
from tether_run_api.cli.client import Client, CliError, CliSettings, connect, describe, reason

if TYPE_CHECKING:
    from tether_run_api.admin import GrantRevocation, KeyRevocation, TenantChange

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
approvals_app = typer.Typer(help="List, review and decide approvals.", no_args_is_help=True)
agents_app = typer.Typer(help="Agents: versioned instructions, model, tool allowlist and caps.", no_args_is_help=True)
tools_app = typer.Typer(help="Tools: versioned argument schemas, risk class and executor.", no_args_is_help=True)
admin_app = typer.Typer(help="Operator set-up on PostgreSQL (TETHER_PG_DSN): tenants, keys, grants, demo.",
                        no_args_is_help=True)
app.add_typer(approvals_app, name="approvals")
app.add_typer(agents_app, name="agents")
app.add_typer(tools_app, name="tools")
app.add_typer(admin_app, name="admin")
app.add_typer(audit_app, name="audit")

_STATE: dict[str, Any] = {}
EXIT_NOT_COMPLETED = 2
#: Exit code of revoke-key / revoke-grant when a key or grant to revoke is not there (the others are still done).
EXIT_NOT_FOUND = 3
#: Exit code when an admin command's arguments are refused (INVALID_ARGUMENT: the message names each field).
EXIT_INVALID_ARGUMENT = 5
_TERMINAL = {runs_pb.RUN_STATUS_COMPLETED, runs_pb.RUN_STATUS_TERMINATED, runs_pb.RUN_STATUS_REJECTED}


@app.callback()
def _options(
    addr: Annotated[str | None, typer.Option(help="run-api host:port (env TETHER_ADDR)")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key (env TETHER_API_KEY)")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
) -> None:
    _reset()
    _STATE.update(addr=addr, api_key=api_key, json=json_output)


def _reset() -> None:
    """Close what a previous invocation in this process opened (tests invoke the app repeatedly)."""
    for name in ("client", "approver_client"):
        client = _STATE.pop(name, None)
        if client is not None:
            client.close()
    for close in _STATE.pop("closers", []):
        close()
    _STATE.clear()


def _client(*, approver: bool = False) -> Client:
    name = "approver_client" if approver else "client"
    if name not in _STATE:
        settings = CliSettings()
        key = _STATE.get("api_key") or settings.api_key
        if approver and not _STATE.get("api_key") and settings.approver_key:
            key = settings.approver_key  # TETHER_APPROVER_KEY: decide as the approver principal
        _STATE[name] = connect(_STATE.get("addr") or settings.addr, key)
    return _STATE[name]


def _json() -> bool:
    return bool(_STATE.get("json"))


# -- runs ----------------------------------------------------------------------------------------


@app.command()
def run(
    goal: Annotated[str, typer.Argument(help="what the agent should achieve")],
    agent: Annotated[str, typer.Option("--agent", "-a", help="agent id")] = "demo",
    agent_version: Annotated[int, typer.Option(help="agent version (0 = latest)")] = 0,
    watch: Annotated[bool, typer.Option("--watch/--no-watch", "-w", help="stream events until the run ends")] = False,
    request_id: Annotated[str | None, typer.Option(help="idempotency key (default: a new UUID)")] = None,
    max_steps: Annotated[int, typer.Option(help="tighten the agent's step cap")] = 0,
    max_tokens: Annotated[int, typer.Option(help="tighten the agent's token cap")] = 0,
    max_cost_usd: Annotated[float, typer.Option(help="tighten the agent's cost cap (USD)")] = 0.0,
) -> None:
    """Submit a run; with --watch, stream its events and print the final status and answer."""
    client = _client()
    request = runs_pb.SubmitRunRequest(
        request_id=request_id or str(uuid.uuid4()),
        agent_id=agent,
        agent_version=agent_version,
        goal=goal,
        caps=types_pb.Caps(max_steps=max_steps, max_tokens=max_tokens,
                           max_cost_usd_micros=round(max_cost_usd * 1_000_000)),
    )
    resp = _submit_with_retry(client, request)
    if not watch:
        if _json():
            render.print_json(resp)
        else:
            render.print_line(resp.run_id)
        return
    render.err_console.print(f"run {resp.run_id} (agent {agent} v{resp.agent_version})")
    _watch_and_report(client, resp.run_id, 1)


def _submit_with_retry(client: Client, request: runs_pb.SubmitRunRequest) -> runs_pb.SubmitRunResponse:
    # The request_id makes a retry safe: the server answers it with the same run id.
    for attempt in range(5):
        try:
            return client.runs.SubmitRun(request, metadata=client.metadata, timeout=client.timeout_s)
        except grpc.RpcError as err:
            retryable = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or \
                reason(err) == "RATE_LIMITED"
            if not retryable or attempt == 4:
                raise CliError(describe(err)) from None
            time.sleep(min(5.0, 0.5 * 2**attempt))
    raise CliError("unreachable")


@app.command("watch")
def watch_cmd(
    run_id: Annotated[str, typer.Argument(help="run id")],
    from_seq: Annotated[int, typer.Option(help="first event to show (resume with last seen + 1)")] = 1,
) -> None:
    """Stream a run's events (from --from-seq) until it ends; print the final status and answer."""
    _watch_and_report(_client(), run_id, from_seq)


def _watch_and_report(client: Client, run_id: str, from_seq: int) -> None:
    _STATE["run_id"] = run_id
    try:
        last = follow(client, run_id, from_seq, on_event=_print_event, on_missing=_print_missing)
    except KeyboardInterrupt:
        render.err_console.print(f"\nstopped watching; the run goes on. Resume: tether watch {run_id} "
                                 f"--from-seq {_STATE.get('next_seq', from_seq)}")
        raise typer.Exit(130) from None
    final = _final_run(client, run_id, last)
    if _json():
        render.print_json(final)
    else:
        render.show_run(final)
    if final.status != runs_pb.RUN_STATUS_COMPLETED:
        raise typer.Exit(EXIT_NOT_COMPLETED)


def _print_event(event: runs_pb.RunEvent) -> None:
    if _json():
        render.print_line(json.dumps({"seq": event.seq, "event_type": event.event_type,
                                      "payload": json.loads(event.payload_json or "{}")}))
        return
    start = _STATE.setdefault("start_ms", event.record_time.ToMilliseconds())
    render.err_console.print(render.event_line(event, start), markup=False)
    if event.event_type == "tether.v1.ApprovalRequested":
        approval_id = json.loads(event.payload_json or "{}").get("approval_id", "?")
        render.err_console.print(f"        approval needed: tether approvals show {approval_id} && "
                                 f"tether approvals approve {approval_id}", markup=False)


#: How long `follow` keeps reconnecting without receiving an event before it gives up.
RECONNECT_WINDOW_S = 60.0
_MAX_BACKOFF_S = 5.0


def follow(client: Client, run_id: str, from_seq: int, *, on_event, on_missing=None,
           reconnect_window_s: float = RECONNECT_WINDOW_S, sleep=time.sleep,
           monotonic=time.monotonic) -> runs_pb.RunEvent | None:
    """Stream events from from_seq until the server ends the stream after the terminal event and the
    facts stored after it (the late outcome of a tool call that ran as the run ended), reconnecting
    from the next seq on a dropped stream, so each event is handed to on_event exactly once.
    Returns the terminal event (None if the server ended the stream before it).

    A permanent hole in the read model (DATA_LOSS / STREAM_HOLE: seqs the projector never stored)
    is handed to `on_missing(first, last, err)` at once and the stream goes on from the server's
    `next_stored_seq`; without `on_missing` it is a CliError. UNAVAILABLE (STREAM_RESUME_REQUIRED
    among them: a seq seen live and not stored yet) is asked again with backoff, never skipped;
    reconnecting stops with a CliError when `reconnect_window_s` passes without an event."""
    next_seq = from_seq
    failures = 0
    stalled_since: float | None = None  # first failure since the last event (or the hole skipped)
    terminal: runs_pb.RunEvent | None = None
    while True:
        try:
            stream = client.runs.StreamRunEvents(
                runs_pb.StreamRunEventsRequest(run_id=run_id, from_seq=next_seq), metadata=client.metadata
            )
            for resp in stream:
                event = resp.event
                if event.seq < next_seq:
                    continue  # never show an event twice, whatever the server sends
                on_event(event)
                next_seq = event.seq + 1
                _STATE["next_seq"] = next_seq
                failures, stalled_since = 0, None
                if event.terminal:
                    terminal = event  # the server sends the facts stored after it, then ends the call
            return terminal
        except grpc.RpcError as err:
            if reason(err) == "STREAM_HOLE":
                resume_at = _next_stored_seq(err, next_seq)
                if on_missing is None:
                    raise CliError(f"{describe(err)}\n  seqs {next_seq}..{resume_at - 1} of run {run_id} are "
                                   f"missing from the read model; resume past them: tether watch {run_id} "
                                   f"--from-seq {resume_at}; investigate: tether audit verify --run {run_id}"
                                   ) from None
                on_missing(next_seq, resume_at - 1, err)
                next_seq = resume_at
                _STATE["next_seq"] = next_seq
                failures, stalled_since = 0, None
                continue
            if reason(err) != "STREAM_RESUME_REQUIRED" and err.code() not in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL
            ):
                raise CliError(describe(err)) from None
            now = monotonic()
            stalled_since = now if stalled_since is None else stalled_since
            if now - stalled_since >= reconnect_window_s:
                raise CliError(f"{describe(err)}\n  no event for {now - stalled_since:.0f} s of reconnecting; "
                               f"resume: tether watch {run_id} --from-seq {next_seq}") from None
            failures += 1
            delay = max(_retry_after_s(err), min(_MAX_BACKOFF_S, 0.25 * 2 ** min(failures, 5)))
            sleep(max(0.0, min(delay, stalled_since + reconnect_window_s - now)))  # never past the window


def _next_stored_seq(err: grpc.RpcError, next_seq: int) -> int:
    """Where the log goes on after the hole a STREAM_HOLE names; a CliError if the answer names no
    seq after the one the stream is at (going on from there could loop or skip what was not missing)."""
    info, _ = error_info(err)
    value = info.metadata.get("next_stored_seq", "") if info else ""
    if not value.isdigit() or int(value) <= next_seq:
        raise CliError(f"{describe(err)}\n  the server named no stored seq after {next_seq} "
                       f"(next_stored_seq={value!r}); investigate: tether audit verify --run "
                       f"{_STATE.get('run_id', '?')}") from None
    return int(value)


def _retry_after_s(err: grpc.RpcError) -> float:
    """The server's RetryInfo delay, or 0."""
    for detail in error_info(err)[1]:
        if isinstance(detail, error_details_pb2.RetryInfo):
            return detail.retry_delay.ToMilliseconds() / 1000
    return 0.0


def _print_missing(first: int, last: int, err: grpc.RpcError) -> None:
    run_id = _STATE.get("run_id", "?")
    if _json():
        for seq in range(first, last + 1):
            render.print_line(json.dumps({"seq": seq, "missing": True, "reason": reason(err)}))
    seqs = f"seq {first}" if first == last else f"seqs {first}..{last}"
    render.err_console.print(
        f"  {seqs} missing from the read model ({reason(err) or err.code().name}: the projector never "
        f"stored them): not shown; going on from seq {last + 1}. The log is the truth; "
        f"investigate: tether audit verify --run {run_id}", markup=False, soft_wrap=True,
    )


def _final_run(client: Client, run_id: str, terminal: runs_pb.RunEvent | None) -> runs_pb.Run:
    # The read model's run row may trail the terminal event by a moment.
    run_row = client.call(client.runs.GetRun, runs_pb.GetRunRequest(run_id=run_id)).run
    deadline = time.monotonic() + 10.0
    while terminal is not None and run_row.status not in _TERMINAL and time.monotonic() < deadline:
        time.sleep(0.2)
        run_row = client.call(client.runs.GetRun, runs_pb.GetRunRequest(run_id=run_id)).run
    return run_row


@app.command()
def get(run_id: Annotated[str, typer.Argument(help="run id")]) -> None:
    """Show a run: status, usage, answer or termination report."""
    client = _client()
    r = client.call(client.runs.GetRun, runs_pb.GetRunRequest(run_id=run_id)).run
    if _json():
        render.print_json(r)
    else:
        render.show_run(r)


@app.command()
def runs(page_size: Annotated[int, typer.Option(help="runs to show")] = 20) -> None:
    """List recent runs, newest first."""
    client = _client()
    resp = client.call(client.runs.ListRuns, runs_pb.ListRunsRequest(page_size=page_size))
    if _json():
        render.print_json(resp)
    else:
        render.console.print(render.runs_table(list(resp.runs)))


@app.command()
def steps(run_id: Annotated[str, typer.Argument(help="run id")]) -> None:
    """Show a run's steps and tool calls."""
    client = _client()
    out, token = [], ""
    while True:
        resp = client.call(client.runs.ListRunSteps,
                           runs_pb.ListRunStepsRequest(run_id=run_id, page_size=200, page_token=token))
        out += list(resp.steps)
        token = resp.next_page_token
        if not token:
            break
    if _json():
        render.print_json(runs_pb.ListRunStepsResponse(steps=out))
    else:
        render.console.print(render.steps_table(out))


@app.command()
def trace(run_id: Annotated[str, typer.Argument(help="run id")]) -> None:
    """Show every event of a run with its timing, and the spans of model calls, tool calls and approvals."""
    client = _client()
    resp = client.call(client.runs.GetRunTrace, runs_pb.GetRunTraceRequest(run_id=run_id))
    if _json():
        render.print_json(resp)
        return
    events, spans = render.trace_tables(resp)
    render.console.print(events)
    render.console.print(spans)
    render.console.print(f"duration {resp.duration_ms} ms" + ("  (truncated)" if resp.truncated else ""))


@app.command()
def cancel(
    run_id: Annotated[str, typer.Argument(help="run id")],
    reason_text: Annotated[str, typer.Option("--reason", help="why")] = "",
) -> None:
    """Ask for a run to be cancelled."""
    client = _client()
    client.call(client.runs.CancelRun, runs_pb.CancelRunRequest(run_id=run_id, reason=reason_text))
    render.console.print(f"cancel requested for {run_id}")


# -- approvals -------------------------------------------------------------------------------------


_APPROVAL_STATUS = {"pending": 1, "approved": 2, "rejected": 3, "expired": 4, "withdrawn": 5}


@approvals_app.command("list")
def approvals_list(
    status: Annotated[str, typer.Option(help="pending, approved, rejected, expired or withdrawn")] = "pending",
    run_id: Annotated[str, typer.Option("--run", help="only this run")] = "",
) -> None:
    """List approvals (pending by default)."""
    if status not in _APPROVAL_STATUS:
        raise CliError(f"--status must be one of {', '.join(_APPROVAL_STATUS)}")
    client = _client()
    resp = client.call(client.approvals.ListApprovals,
                       approvals_pb.ListApprovalsRequest(status=_APPROVAL_STATUS[status], run_id=run_id,
                                                         page_size=200))
    if _json():
        render.print_json(resp)
    else:
        render.console.print(render.approvals_table(list(resp.approvals)))


@approvals_app.command("show")
def approvals_show(approval_id: Annotated[str, typer.Argument(help="approval id")]) -> None:
    """Show an approval with the exact arguments that would run."""
    client = _client()
    a = client.call(client.approvals.GetApproval, approvals_pb.GetApprovalRequest(approval_id=approval_id)).approval
    if _json():
        render.print_json(a)
    else:
        render.show_approval(a)


def _decide(approval_id: str, approve: bool, comment: str, yes: bool) -> None:
    client = _client(approver=True)
    a = client.call(client.approvals.GetApproval, approvals_pb.GetApprovalRequest(approval_id=approval_id)).approval
    if not _json():
        render.show_approval(a)
    if not yes and not typer.confirm("approve these arguments?" if approve else "reject this call?"):
        raise typer.Exit(1)
    # The decision quotes the hash of the arguments just shown, so it cannot approve other ones.
    resp = client.call(client.approvals.DecideApproval, approvals_pb.DecideApprovalRequest(
        approval_id=approval_id, args_hash=a.args_hash, approve=approve, comment=comment))
    render.console.print(f"{'approved' if approve else 'rejected'} {approval_id} "
                         f"({render.approval_status(resp.approval.status)})")


@approvals_app.command("approve")
def approvals_approve(
    approval_id: Annotated[str, typer.Argument(help="approval id")],
    comment: Annotated[str, typer.Option(help="recorded with the decision")] = "",
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
) -> None:
    """Approve a pending tool call (after showing its arguments)."""
    _decide(approval_id, True, comment, yes)


@approvals_app.command("reject")
def approvals_reject(
    approval_id: Annotated[str, typer.Argument(help="approval id")],
    comment: Annotated[str, typer.Option(help="recorded with the decision")] = "",
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
) -> None:
    """Reject a pending tool call."""
    _decide(approval_id, False, comment, yes)


# -- agents and tools ------------------------------------------------------------------------------


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CliError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise CliError(f"{path}: expected a JSON object")
    return data


def _parse(data: dict[str, Any], message, path: Path):
    try:
        return ParseDict(data, message)
    except ParseError as exc:
        raise CliError(f"{path}: {exc}") from None


@agents_app.command("list")
def agents_list() -> None:
    """List agents (latest versions)."""
    client = _client()
    resp = client.call(client.agents.ListAgents, agents_pb.ListAgentsRequest(page_size=500))
    if _json():
        render.print_json(resp)
    else:
        render.console.print(render.agents_table(list(resp.agents)))


@agents_app.command("get")
def agents_get(agent_id: str, version: Annotated[int, typer.Option(help="0 = latest")] = 0) -> None:
    """Show one agent version."""
    client = _client()
    a = client.call(client.agents.GetAgent, agents_pb.GetAgentRequest(agent_id=agent_id, version=version)).agent
    render.print_json(a)


@agents_app.command("create")
def agents_create(
    file: Annotated[Path, typer.Option("--file", "-f", help="Agent as JSON (tether.v1.Agent fields)")],
    request_id: Annotated[str | None, typer.Option(help="idempotency key")] = None,
) -> None:
    """Create an agent (version 1) from a JSON file."""
    client = _client()
    agent = _parse(_load(file), agents_pb.Agent(), file)
    a = client.call(client.agents.CreateAgent,
                    agents_pb.CreateAgentRequest(agent=agent, request_id=request_id or str(uuid.uuid4()))).agent
    render.console.print(f"created agent {a.agent_id} v{a.version}")


@agents_app.command("update")
def agents_update(
    file: Annotated[Path, typer.Option("--file", "-f", help="Agent as JSON; agent_id names the agent")],
    mask: Annotated[str, typer.Option(help="comma-separated fields to take from the file (default: all)")] = "",
    expected_version: Annotated[int, typer.Option(help="fail if the latest version is not this one")] = 0,
    request_id: Annotated[str | None, typer.Option(help="idempotency key")] = None,
) -> None:
    """Create the next version of an agent."""
    client = _client()
    agent = _parse(_load(file), agents_pb.Agent(), file)
    agent.version = expected_version
    paths = [p.strip() for p in mask.split(",") if p.strip()]
    a = client.call(client.agents.UpdateAgent, agents_pb.UpdateAgentRequest(
        agent=agent, update_mask=field_mask_pb2.FieldMask(paths=paths), request_id=request_id or str(uuid.uuid4()),
    )).agent
    render.console.print(f"agent {a.agent_id} is now v{a.version}")


@tools_app.command("list")
def tools_list(show_disabled: Annotated[bool, typer.Option(help="include disabled tools")] = False) -> None:
    """List tools (latest versions)."""
    client = _client()
    resp = client.call(client.tools.ListTools, tools_pb.ListToolsRequest(page_size=500, show_disabled=show_disabled))
    if _json():
        render.print_json(resp)
    else:
        render.console.print(render.tools_table(list(resp.tools)))


@tools_app.command("get")
def tools_get(name: str, version: Annotated[int, typer.Option(help="0 = latest")] = 0) -> None:
    """Show one tool version."""
    client = _client()
    t = client.call(client.tools.GetTool, tools_pb.GetToolRequest(name=name, version=version)).tool
    render.print_json(t)


@tools_app.command("register")
def tools_register(
    file: Annotated[Path, typer.Option("--file", "-f", help="Tool as JSON; args_schema, executor_config and "
                                                            "constraints may be objects")],
    request_id: Annotated[str | None, typer.Option(help="idempotency key")] = None,
) -> None:
    """Register the next version of a tool from a JSON file."""
    data = _load(file)
    for obj_key, text_key in (("args_schema", "args_schema_json"), ("executor_config", "executor_config_json"),
                              ("constraints", "constraints_json")):
        if obj_key in data:
            data[text_key] = json.dumps(data.pop(obj_key))
    client = _client()
    tool = _parse(data, tools_pb.Tool(), file)
    t = client.call(client.tools.RegisterTool,
                    tools_pb.RegisterToolRequest(tool=tool, request_id=request_id or str(uuid.uuid4()))).tool
    render.console.print(f"registered tool {t.name} v{t.version}")


@tools_app.command("disable")
def tools_disable(name: str, version: Annotated[int, typer.Option(help="0 = every version")] = 0) -> None:
    """Disable a tool version (or all); new runs stop getting it."""
    client = _client()
    resp = client.call(client.tools.DisableTool, tools_pb.DisableToolRequest(name=name, version=version))
    render.console.print(f"disabled {name} versions {list(resp.disabled_versions) or '(already disabled)'}")


from tether_run_api.cli import user_tools  # noqa: E402 (its commands join tools_app)

tools_app.command("import-mcp")(user_tools.import_mcp)
tools_app.command("update")(user_tools.update)


# -- admin (PostgreSQL) ----------------------------------------------------------------------------


@contextmanager
def _refusals() -> Iterator[None]:
    """An admin use case's INVALID_ARGUMENT as a one-line error and its own exit code, not a traceback."""
    from tether_run_api.domain.errors import InvalidArgument

    try:
        yield
    except InvalidArgument as err:
        raise CliError(f"{err.reason}: {err.message}", exit_code=EXIT_INVALID_ARGUMENT) from None


def _store():
    from tether_run_api.bootstrap import open_store
    from tether_run_api.settings import RunApiSettings

    store, pool = open_store(RunApiSettings())
    _STATE.setdefault("closers", []).append(pool.close)
    return store


@admin_app.command("create-tenant")
def admin_create_tenant(
    tenant_id: str,
    display_name: Annotated[str | None, typer.Option(help="human-readable name (default: keep it)")] = None,
    spread: Annotated[int | None, typer.Option(
        help="partitions the tenant's runs spread over (default: keep it; 1 for a new tenant)")] = None,
) -> None:
    """Create a tenant (or change its name / spread; what is not given is kept)."""
    from tether_run_api import admin

    with _refusals():
        change = admin.create_tenant(_store(), tenant_id, display_name=display_name, spread=spread)
    _print_tenant_change(change)


def _print_tenant_change(change: TenantChange) -> None:
    """One line (one JSON object with --json): whether the tenant is new and whether its spread moved."""
    if _json():
        render.print_line(json.dumps({"tenant_id": change.tenant_id, "created": change.created,
                                      "spread": change.spread, "previous_spread": change.previous_spread}))
    else:
        render.print_line(_tenant_line(change))


def _tenant_line(change: TenantChange) -> str:
    if change.created:
        return f"tenant {change.tenant_id} created (spread {change.spread})"
    if change.spread_changed:
        return (f"tenant {change.tenant_id}: spread {change.previous_spread} -> {change.spread} "
                "(for runs submitted from now on)")
    return f"tenant {change.tenant_id} (spread {change.spread})"


@admin_app.command("tenant-limits")
def admin_tenant_limits(
    tenant_id: str,
    max_concurrent_runs: Annotated[int, typer.Option(help="runs at once (0 = no cap)")] = 0,
    max_queued_runs: Annotated[int, typer.Option(help="runs waiting beyond the cap (0 = no queue)")] = 0,
    spend_cap_usd_micros: Annotated[int, typer.Option(help="model spend per window, µUSD (0 = no cap)")] = 0,
    spend_window_ms: Annotated[int, typer.Option(help="spend window, ms (0 = lifetime total)")] = 0,
    tokens_per_minute: Annotated[int, typer.Option(help="model tokens per minute (0 = no cap)")] = 0,
) -> None:
    """Set a tenant's limits (totals, split over its spread; docs/tenancy.md)."""
    from tether_run_api import admin
    from tether_run_api.domain.tenancy import TenantPolicy

    policy = TenantPolicy(max_concurrent_runs=max_concurrent_runs, max_queued_runs=max_queued_runs,
                          spend_cap_usd_micros=spend_cap_usd_micros, spend_window_ms=spend_window_ms,
                          tokens_per_minute=tokens_per_minute)
    with _refusals():
        admin.set_tenant_limits(_store(), tenant_id, policy)
    render.console.print(f"tenant {tenant_id}: {policy}")


@admin_app.command("create-key")
def admin_create_key(
    tenant_id: str,
    principal_id: str,
    role: Annotated[list[str], typer.Option(help="member, admin, approver (repeat)")] = ["member"],
    label: Annotated[str, typer.Option(help="note stored with the key")] = "",
) -> None:
    """Issue an API key for a principal of a tenant (printed once)."""
    from tether_run_api import admin

    key = admin.issue_key(_store(), tenant_id, principal_id, role, label=label)
    render.err_console.print(f"key id {key.key_id} (list-keys, revoke-key --key-id)", markup=False)
    render.print_line(key.api_key)


@admin_app.command("list-keys")
def admin_list_keys(
    tenant_id: str,
    principal_id: Annotated[str | None, typer.Option("--principal", help="only this principal's keys")] = None,
) -> None:
    """A tenant's API keys, revoked ones too: key id, principal, roles, label, dates (never a key)."""
    from tether_run_api import admin

    with _refusals():
        keys = admin.list_keys(_store(), tenant_id, principal_id)
    if _json():
        render.print_line(json.dumps([_key_json(k) for k in keys], indent=2))
    else:
        render.console.print(render.keys_table(keys))


def _key_json(key) -> dict[str, Any]:
    return {"key_id": key.key_id, "tenant_id": key.tenant_id, "principal_id": key.principal_id,
            "roles": list(key.roles), "label": key.label, "created_at": key.created_at.isoformat(),
            "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None}


@admin_app.command("revoke-key")
def admin_revoke_key(
    key_file: Annotated[typer.FileText | None, typer.Option(
        help="read the key(s) to revoke from this file, - = stdin: one a line, bare or NAME=key")] = None,
    key_id: Annotated[str | None, typer.Option(help="the key id (create-key, list-keys) of the key to revoke")] = None,
    tenant_id: Annotated[str | None, typer.Option("--tenant", help="leave keys of any other tenant alone")] = None,
    stray: Annotated[list[str] | None, typer.Argument(hidden=True, show_default=False)] = None,
) -> None:
    """Revoke API keys, by the key itself (read from a file or stdin) or by key id. Idempotent.

    A key is never taken from the command line (it would show in ps and the shell history), and
    never printed: the output names it by key id. Prints one line per key (JSON with --json):
    revoked, already revoked (exit 0) or not found (exit 3). A server may accept a revoked key for
    up to its TETHER_RUN_API_AUTH_CACHE_S; runs already submitted with it go on.
    """
    from tether_run_api import admin

    if stray:
        raise CliError("revoke-key takes no argument: pass the key on stdin (--key-file -) or in a file, "
                       "or name it with --key-id", exit_code=EXIT_INVALID_ARGUMENT)
    if (key_file is None) == (key_id is None):
        raise CliError("give exactly one of --key-file FILE (- = stdin) and --key-id ID",
                       exit_code=EXIT_INVALID_ARGUMENT)
    with _refusals():
        if key_file is not None:
            keys = admin.api_keys_in(key_file.read())
            results = admin.revoke_keys(_store(), keys, tenant_id=tenant_id)
        else:
            results = [admin.revoke_key_by_id(_store(), key_id or "", tenant_id=tenant_id)]
    for result in results:
        render.print_line(json.dumps(_key_revocation_json(result)) if _json() else _key_revocation_line(result))
    if any(r.outcome == admin.REVOKED for r in results) and not _json():
        render.err_console.print("a server may still accept a revoked key for up to TETHER_RUN_API_AUTH_CACHE_S "
                                 "(10 s by default); runs already submitted with it go on", markup=False)
    if any(r.outcome == admin.NOT_FOUND for r in results):
        raise typer.Exit(EXIT_NOT_FOUND)


def _key_revocation_json(result: KeyRevocation) -> dict[str, Any]:
    return {"key_id": result.key_id, "status": result.outcome,
            **({k: v for k, v in _key_json(result.key).items() if k != "key_id"} if result.key else {})}


def _key_revocation_line(result: KeyRevocation) -> str:
    from tether_run_api.admin import REVOKED

    key = result.key
    if key is None:
        return f"key {result.key_id}: not found"
    whose = f"key {key.key_id} of {key.principal_id} in {key.tenant_id}"
    if result.outcome == REVOKED:
        return f"revoked {whose} (roles {','.join(key.roles)})"
    return f"{whose}: already revoked at {key.revoked_at.isoformat() if key.revoked_at else '?'}"


@admin_app.command("grant")
def admin_grant(
    tenant_id: str,
    tools: Annotated[list[str], typer.Argument(help="tool names")],
    principal_id: Annotated[str, typer.Option("--principal", help="'*' = every principal of the tenant")] = "*",
) -> None:
    """Grant tools to a principal (default: every principal of the tenant)."""
    from tether_run_api import admin

    with _refusals():
        admin.grant_tools(_store(), tenant_id, principal_id, tools)
    render.console.print(f"granted {', '.join(tools)} to {principal_id} in {tenant_id}")


@admin_app.command("revoke-grant")
def admin_revoke_grant(
    tenant_id: str,
    tools: Annotated[list[str], typer.Argument(help="tool names")],
    principal_id: Annotated[str, typer.Option("--principal", help="'*' = the grant to every principal")] = "*",
) -> None:
    """Revoke grants made with `grant` (same arguments).

    New runs are submitted without the tool; runs already submitted keep theirs. One line per tool
    (JSON with --json): revoked, or not found (exit 3).
    """
    from tether_run_api import admin

    with _refusals():
        results = admin.revoke_grants(_store(), tenant_id, principal_id, tools)
    for result in results:
        if _json():
            render.print_line(json.dumps({"tenant_id": result.tenant_id, "principal_id": result.principal_id,
                                          "tool_name": result.tool_name, "status": result.outcome,
                                          "still_granted": result.still_granted}))
        else:
            render.print_line(_grant_revocation_line(result))
    if any(r.outcome == admin.NOT_FOUND for r in results):
        raise typer.Exit(EXIT_NOT_FOUND)


def _grant_revocation_line(result: GrantRevocation) -> str:
    from tether_run_api.admin import REVOKED

    who = "every principal ('*')" if result.principal_id == "*" else result.principal_id
    line = (f"revoked grant of {result.tool_name} to {who} in {result.tenant_id}" if result.outcome == REVOKED
            else f"grant of {result.tool_name} to {who} in {result.tenant_id}: not found")
    if result.still_granted:
        line += f"; still granted to every principal ('*'): revoke-grant {result.tenant_id} {result.tool_name}"
    return line


@admin_app.command("bootstrap-demo")
def admin_bootstrap_demo(
    tenant_id: Annotated[str, typer.Option("--tenant")] = "demo",
    principal_id: Annotated[str, typer.Option("--principal", help="submits runs (member, admin)")] = "demo-user",
    approver_id: Annotated[str, typer.Option("--approver", help="decides approvals")] = "demo-approver",
    api_key: Annotated[str | None, typer.Option(help="the user's key instead of a new random one")] = None,
    approver_key: Annotated[str | None, typer.Option(help="the approver's key instead of a new one")] = None,
    model_provider: Annotated[str, typer.Option(help="openai or anthropic")] = "openai",
    model_name: Annotated[str, typer.Option(help="model name")] = "tether-scripted",
    kv_url: Annotated[str, typer.Option(help="the KV dev service")] = "http://127.0.0.1:8091",
    smtp_host: Annotated[str, typer.Option(help="SMTP host for send_email")] = "127.0.0.1",
    smtp_port: Annotated[int, typer.Option(help="SMTP port for send_email")] = 2525,
    email_from: Annotated[str, typer.Option(help="sender of send_email")] = "tether-demo@localhost",
    http_allow_host: Annotated[list[str], typer.Option(help="hosts http_get may reach (repeat)")] = [
        "example.com", "127.0.0.1", "localhost"],
    env_file: Annotated[Path | None, typer.Option(help="also write the keys (KEY=value lines) to this file")] = None,
) -> None:
    """Create the demo tenant, a user key and an approver key, the built-in tools, grants and the demo agent.

    Prints `export TETHER_API_KEY=...` (the user) and `export TETHER_APPROVER_KEY=...` (used by
    `tether approvals approve|reject`): nobody may approve calls of a run they submitted.
    """
    from tether_run_api import admin
    from tether_tool_gateway.builtin_tools import builtin_tool_specs

    tools = builtin_tool_specs(kv_url=kv_url, smtp_host=smtp_host, smtp_port=smtp_port, email_from=email_from,
                               http_allow_hosts=http_allow_host)
    agent = admin.demo_agent_spec(model_provider, model_name, [t.name for t in tools])
    with _refusals():
        setup = admin.bootstrap_demo(_store(), tenant_id=tenant_id, principal_id=principal_id,
                                     approver_id=approver_id, tools=tools, agent=agent,
                                     now_ms=time.time_ns() // 1_000_000, api_key=api_key, approver_key=approver_key)
    for change in setup.changed:
        render.err_console.print(f"  + {change}", markup=False)
    if setup.tenant is not None:
        render.err_console.print(_tenant_line(setup.tenant), markup=False)
    render.err_console.print(f"agent {setup.agent.agent_id} v{setup.agent.version} with tools "
                             f"{', '.join(t.name for t in setup.tools)}", markup=False)
    lines = []
    if setup.key is not None:
        lines.append(f"TETHER_API_KEY={setup.key.api_key}")
    if setup.approver_key is not None:
        lines.append(f"TETHER_APPROVER_KEY={setup.approver_key.api_key}")
    if env_file is not None and lines:
        env_file.write_text("".join(f"{line}\n" for line in lines))
        env_file.chmod(0o600)
    for line in lines:
        render.print_line(f"export {line}")


def main() -> None:
    """Console entry point `tether`."""
    try:
        app()
    except CliError as err:
        render.err_console.print(f"[red]error[/] {err}")
        raise SystemExit(err.exit_code) from None
    finally:
        _reset()


if __name__ == "__main__":
    main()
