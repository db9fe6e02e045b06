"""The run-api's use cases: one plain function per RPC, the request first, dependencies as named parameters.

They authorise (roles), validate (domain), read and write through the ports, and return
domain values; the gRPC servicers in tether_run_api.api convert to and from protobuf.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from tether_contracts.records import CancelRun, DecideApproval
from tether_messaging.envelopes import derived_id, make_envelope
from tether_messaging.partitioner import partition_for
from tether_messaging.serde import decode_envelope, encode
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import ROLE_ADMIN, ROLE_APPROVER, ROLE_MEMBER, Principal
from tether_run_api.domain.catalog import (
    AGENT_ID,
    TOOL_NAME,
    AgentDraft,
    AgentVersion,
    CatalogLimits,
    ToolDraft,
    ToolVersion,
    canonical_json,
    check_agent_id,
    check_tool_name,
    merge_update,
    validate_agent,
    validate_tool,
)
from tether_run_api.domain.errors import (
    AgentNotFound,
    AgentVersionConflict,
    ApprovalExpired,
    ApprovalNotFound,
    ApprovalNotPending,
    FieldViolation,
    InvalidArgument,
    InvalidPageToken,
    RequestIdReused,
    RunAlreadyFinished,
    RunNotFound,
    SelfApproval,
    StaleArgsHash,
    StreamHole,
    StreamResumeRequired,
    SubmitterUnknown,
    ToolNotFound,
)
from tether_run_api.domain.paging import decode_token, encode_token, page_size
from tether_run_api.domain.runs import (
    RUN_ID,
    RunLimits,
    SubmitRequest,
    build_submit,
    check_request_id,
    check_run_id,
    effective_caps,
    request_fingerprint,
    validate_submit,
)
from tether_run_api.domain.stream import Offer, SeqGate
from tether_run_api.domain.tenancy import AdmissionGate, lane_limits
from tether_run_api.domain.text import check_no_nul
from tether_run_api.domain.trace import Trace, build_trace
from tether_run_api.domain.views import ApprovalView, EventView, RunView, StepView, Submission
from tether_run_api.domain.wire import RESPONSE_OVERHEAD, run_bytes, step_bytes, trace_event_bytes
from tether_run_api.ports import (
    Catalog,
    CommandPublisher,
    Idempotency,
    LiveEvents,
    ReadModel,
    SubmitLedger,
)

PRODUCER = "run-api"
APPROVAL_STATUSES = ("PENDING", "APPROVED", "REJECTED", "EXPIRED", "WITHDRAWN")
_HEX64 = frozenset("0123456789abcdef")
_MAX_INT4 = 2**31 - 1
_MAX_INT8 = 2**63 - 1
#: gRPC's send limit of the server (api.server.start_server's max_send_message_bytes default).
DEFAULT_MAX_RESPONSE_BYTES = 16 * 1024 * 1024


def _resume_key(token: str, listing: str, valid: Callable[[object], bool]) -> object | None:
    """The key a page token resumes after, if it has the shape this listing issues (a token is
    client input: a crafted key must be INVALID_PAGE_TOKEN, never a query error)."""
    after = decode_token(token, listing)
    if after is not None and not valid(after):
        raise InvalidPageToken()
    return after


def _id_key(pattern: re.Pattern[str]) -> Callable[[object], bool]:
    return lambda key: type(key) is str and pattern.fullmatch(key) is not None


def _step_key(key: object) -> bool:
    return type(key) is int and 0 <= key <= _MAX_INT4


def _approval_key(key: object) -> bool:
    # [requested_at_ms, approval_id]; type() rather than isinstance(): JSON true is no int here.
    return (
        type(key) is list
        and len(key) == 2
        and type(key[0]) is int
        and 0 <= key[0] <= _MAX_INT8
        and type(key[1]) is str
        and 0 < len(key[1]) <= 128
        and not check_no_nul(key[1], "page_token")
    )


def _idem(request_id: str, body: object) -> Idempotency | None:
    if not request_id:
        return None
    violations = check_request_id(request_id)
    if violations:
        raise InvalidArgument(violations)
    return Idempotency(request_id, hashlib.sha256(canonical_json(body).encode()).hexdigest())


# -- agents ---------------------------------------------------------------------------------


def create_agent(
    draft: AgentDraft,
    request_id: str,
    *,
    principal: Principal,
    now_ms: int,
    catalog: Catalog,
    limits: CatalogLimits,
) -> AgentVersion:
    """Version 1 of a new agent."""
    principal.require(ROLE_ADMIN)
    spec = validate_agent(draft, limits)
    idem = _idem(request_id, {"op": "CreateAgent", "spec": spec.to_avro()})
    return catalog.create_agent(principal.tenant_id, spec, principal.principal_id, now_ms, idem)


def update_agent(
    draft: AgentDraft,
    update_mask: list[str],
    expected_version: int,
    request_id: str,
    *,
    principal: Principal,
    now_ms: int,
    catalog: Catalog,
    limits: CatalogLimits,
) -> AgentVersion:
    """The next version of an agent: the latest with the masked fields replaced."""
    principal.require(ROLE_ADMIN)
    violations = check_agent_id(draft.agent_id, "agent.agent_id")
    if expected_version < 0:
        violations.append(FieldViolation("agent.version", "must not be negative (0 = no precondition)"))
    if violations:
        raise InvalidArgument(violations)
    body = {"op": "UpdateAgent", "draft": repr(draft), "mask": update_mask, "expected": expected_version}
    idem = _idem(request_id, body)
    # A retry of a stored request gets its first answer (or REQUEST_ID_REUSED) before the
    # precondition is checked: the version it was based on is no longer the latest, by its own doing.
    if idem is not None and (done := catalog.replayed_agent(principal.tenant_id, "UpdateAgent", idem)) is not None:
        return done
    latest = catalog.get_agent(principal.tenant_id, draft.agent_id)
    if latest is None:
        raise AgentNotFound(draft.agent_id)
    if expected_version and expected_version != latest.spec.version:
        raise AgentVersionConflict(draft.agent_id, expected_version, latest.spec.version)
    merged = merge_update(latest.spec, draft, update_mask)
    spec = validate_agent(merged, limits)
    # Without a precondition the store still refuses a concurrent writer that stored
    # latest + 1 first (unique version), so no update is silently lost.
    version = latest.spec.version + 1
    spec = spec.model_copy(update={"version": version})
    return catalog.add_agent_version(principal.tenant_id, spec, principal.principal_id, now_ms, idem)


def get_agent(agent_id: str, version: int, *, principal: Principal, catalog: Catalog) -> AgentVersion:
    """One version of an agent (latest when version is 0)."""
    principal.require(ROLE_MEMBER)
    violations = check_agent_id(agent_id)
    if version < 0:
        violations.append(FieldViolation("version", "must not be negative (0 = latest)"))
    if violations:
        raise InvalidArgument(violations)
    found = catalog.get_agent(principal.tenant_id, agent_id, version or None)
    if found is None:
        raise AgentNotFound(agent_id, version)
    return found


def list_agents(
    size: int, token: str, *, principal: Principal, catalog: Catalog
) -> tuple[list[AgentVersion], str]:
    """A page of agents (latest versions) and the next page token."""
    principal.require(ROLE_MEMBER)
    limit = page_size(size)
    after = _resume_key(token, "agents", _id_key(AGENT_ID))
    rows = catalog.list_agents(principal.tenant_id, after, limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, encode_token("agents", rows[-1].spec.agent_id) if more else ""


# -- tools ----------------------------------------------------------------------------------


def register_tool(
    draft: ToolDraft,
    request_id: str,
    *,
    principal: Principal,
    now_ms: int,
    catalog: Catalog,
    limits: CatalogLimits,
) -> ToolVersion:
    """The next version of a tool (version 1 for a new name)."""
    principal.require(ROLE_ADMIN)
    spec = validate_tool(draft, limits)
    idem = _idem(request_id, {"op": "RegisterTool", "spec": spec.to_avro()})
    return catalog.register_tool(principal.tenant_id, spec, principal.principal_id, now_ms, idem)


def get_tool(name: str, version: int, *, principal: Principal, catalog: Catalog) -> ToolVersion:
    """One version of a tool (latest when version is 0)."""
    principal.require(ROLE_MEMBER)
    violations = check_tool_name(name)
    if version < 0:
        violations.append(FieldViolation("version", "must not be negative (0 = latest)"))
    if violations:
        raise InvalidArgument(violations)
    found = catalog.get_tool(principal.tenant_id, name, version or None)
    if found is None:
        raise ToolNotFound(name, version)
    return found


def list_tools(
    size: int, token: str, show_disabled: bool, *, principal: Principal, catalog: Catalog
) -> tuple[list[ToolVersion], str]:
    """A page of tools (latest versions) and the next page token."""
    principal.require(ROLE_MEMBER)
    limit = page_size(size)
    listing = "tools+disabled" if show_disabled else "tools"
    after = _resume_key(token, listing, _id_key(TOOL_NAME))
    rows = catalog.list_tools(principal.tenant_id, after, limit + 1, show_disabled)
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, encode_token(listing, rows[-1].spec.name) if more else ""


def disable_tool(name: str, version: int, *, principal: Principal, catalog: Catalog) -> list[int]:
    """Disable a tool version (or all versions when version is 0); returns the versions newly disabled."""
    principal.require(ROLE_ADMIN)
    violations = check_tool_name(name)
    if version < 0:
        violations.append(FieldViolation("version", "must not be negative (0 = every version)"))
    if violations:
        raise InvalidArgument(violations)
    disabled = catalog.disable_tool(principal.tenant_id, name, version or None)
    if disabled is None:
        raise ToolNotFound(name, version)
    return disabled


# -- runs: commands ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Partitioning:
    """How runs map to partitions of the command topic."""

    partitions: int


def submit_run(
    req: SubmitRequest,
    *,
    principal: Principal,
    now_ms: int,
    run_id: str,
    catalog: Catalog,
    ledger: SubmitLedger,
    publisher: CommandPublisher,
    limiter: SubmitRateLimiter,
    limits: RunLimits,
    partitioning: Partitioning,
    traceparent: str | None = None,
    admission: AdmissionGate | None = None,
) -> Submission:
    """Snapshot the agent, tools and grants into a SubmitRun command and produce it; idempotent on request_id.

    `run_id` is used only if this request_id is new. The ledger row (unique per tenant and
    request_id) holds the encoded command, so a retry after a lost acknowledgement produces
    the very same record again (same event id: the sequencer drops the duplicate). A new
    submit of a tenant whose runs (queued and running) already fill its limits is refused with
    TENANT_QUEUE_FULL (`admission`, approximate); the command carries the tenant's limits for
    the run's partition lane, which the budget service enforces.
    """
    principal.require(ROLE_MEMBER)
    validate_submit(req, limits)
    fingerprint = request_fingerprint(req)
    tenant = principal.tenant_id

    existing = ledger.get(tenant, req.request_id)
    if existing is None:
        limiter.admit(tenant, now_ms / 1000.0)
        policy = catalog.tenant_policy(tenant)
        agent = catalog.get_agent(tenant, req.agent_id, req.agent_version or None)
        if agent is None:
            raise AgentNotFound(req.agent_id, req.agent_version)
        # An agent stored above the ceilings (before they were lowered; the request may only tighten
        # its caps): the budget would reject the run CAPS_ABOVE_CEILING, so refuse it now, naming the cap.
        above = limits.ceilings.violations(effective_caps(agent.spec.caps, req.caps), "caps")
        if above:
            raise InvalidArgument(above)
        if admission is not None:
            admission.admit(tenant, policy, now_ms)
        tools = catalog.latest_enabled_tools(tenant, list(agent.spec.tool_allowlist))
        grants = catalog.grants_for(tenant, principal.principal_id)
        partition = partition_for(tenant, run_id, partitioning.partitions, policy.lanes(partitioning.partitions))
        lane = lane_limits(policy, tenant, partition, partitioning.partitions)
        command = build_submit(principal, req, agent.spec, [t.spec for t in tools], grants, lane)
        envelope = make_envelope(
            command,
            run_id=run_id,
            tenant_id=tenant,
            event_id=derived_id(run_id, "SubmitRun"),
            producer=PRODUCER,
            recorded_at_ms=now_ms,
            traceparent=traceparent,
        )
        existing = ledger.claim(
            Submission(
                tenant_id=tenant,
                request_id=req.request_id,
                request_hash=fingerprint,
                run_id=run_id,
                principal_id=principal.principal_id,
                agent_id=agent.spec.agent_id,
                agent_version=agent.spec.version,
                goal=req.goal,
                partition=partition,
                envelope=encode(envelope),
                created_at_ms=now_ms,
            )
        )
    if existing.request_hash != fingerprint:
        raise RequestIdReused(req.request_id)
    if not existing.delivered:
        publisher.publish(decode_envelope(existing.envelope), existing.partition)
        ledger.mark_delivered(tenant, req.request_id)
    return existing


def redeliver_submissions(*, ledger: SubmitLedger, publisher: CommandPublisher, now_ms: int, grace_ms: int,
                          limit: int = 100) -> int:
    """Produce the commands of submissions whose acknowledgement never came (the caller gave up
    or the process died between ledger row and ack), so a recorded run is never left unsent.

    The very same record is produced (same event id), so a copy that did reach Kafka is dropped
    by the sequencer. Returns how many were delivered now.
    """
    delivered = 0
    for sub in ledger.undelivered(now_ms - grace_ms, limit):
        publisher.publish(decode_envelope(sub.envelope), sub.partition)
        ledger.mark_delivered(sub.tenant_id, sub.request_id)
        delivered += 1
    return delivered


def _visible_run(tenant: str, run_id: str, read_model: ReadModel, ledger: SubmitLedger) -> RunView:
    violations = check_run_id(run_id)
    if violations:
        raise InvalidArgument(violations)
    view = read_model.get_run(tenant, run_id)
    if view is not None:
        return view
    submission = ledger.find_run(tenant, run_id)
    if submission is None:
        raise RunNotFound(run_id)
    return submission.as_pending_run()


def cancel_run(
    run_id: str,
    reason: str,
    *,
    principal: Principal,
    now_ms: int,
    read_model: ReadModel,
    ledger: SubmitLedger,
    publisher: CommandPublisher,
    partitioning: Partitioning,
    catalog: Catalog,
    traceparent: str | None = None,
) -> None:
    """Produce a CancelRun command for a run of the tenant that has not finished.

    A run whose SubmitRun the ledger holds but Kafka never acknowledged (a submit during an
    outage, GetRun PENDING) gets that very record produced first, to its partition: a cancel
    ahead of its submit would be dead-lettered (UNKNOWN_RUN) and the sweeper's later submit
    would start the run the caller was told was cancelled.
    """
    principal.require(ROLE_MEMBER)
    violations = check_no_nul(reason, "reason")
    if len(reason) > 1000:
        violations.append(FieldViolation("reason", "must be at most 1000 characters"))
    if violations:
        raise InvalidArgument(violations)
    view = _visible_run(principal.tenant_id, run_id, read_model, ledger)
    if view.status.finished:
        raise RunAlreadyFinished(run_id, view.status.value)
    submission = ledger.find_run(principal.tenant_id, run_id)
    if submission is not None and not submission.delivered:
        publisher.publish(decode_envelope(submission.envelope), submission.partition)
        ledger.mark_delivered(principal.tenant_id, submission.request_id)
    envelope = make_envelope(
        CancelRun(principal_id=principal.principal_id, reason=reason or "cancelled by user"),
        run_id=run_id,
        tenant_id=principal.tenant_id,
        # One cancel per run is enough; repeats carry the same id and the sequencer drops them.
        event_id=derived_id(run_id, "CancelRun"),
        producer=PRODUCER,
        recorded_at_ms=now_ms,
        traceparent=traceparent,
    )
    partition = submission.partition if submission is not None else \
        _run_partition(principal.tenant_id, run_id, ledger, catalog, partitioning)
    publisher.publish(envelope, partition)


def _run_partition(
    tenant: str, run_id: str, ledger: SubmitLedger, catalog: Catalog, partitioning: Partitioning
) -> int:
    submission = ledger.find_run(tenant, run_id)
    if submission is not None:
        return submission.partition
    # A run this ledger did not submit (restored from elsewhere): the current lanes are the best
    # knowledge, and equal the submit-time choice unless the spread or the limits changed since.
    lanes = catalog.tenant_policy(tenant).lanes(partitioning.partitions)
    return partition_for(tenant, run_id, partitioning.partitions, lanes)


# -- runs: queries ----------------------------------------------------------------------------


def get_run(run_id: str, *, principal: Principal, read_model: ReadModel, ledger: SubmitLedger) -> RunView:
    """The run as the read model has it, or PENDING if only the submit is recorded so far."""
    principal.require(ROLE_MEMBER)
    return _visible_run(principal.tenant_id, run_id, read_model, ledger)


def list_runs(
    size: int, token: str, *, principal: Principal, read_model: ReadModel, ledger: SubmitLedger
) -> tuple[list[RunView], str]:
    """A page of the tenant's runs, newest first, with their read-model state where it exists."""
    principal.require(ROLE_MEMBER)
    limit = page_size(size)
    before = _resume_key(token, "runs", _id_key(RUN_ID))
    subs = ledger.list_runs(principal.tenant_id, before, limit + 1)
    more = len(subs) > limit
    subs = subs[:limit]
    views = read_model.get_runs(principal.tenant_id, [s.run_id for s in subs])
    runs = [views.get(s.run_id) or s.as_pending_run() for s in subs]
    return runs, encode_token("runs", subs[-1].run_id) if more else ""


def list_run_steps(
    run_id: str,
    size: int,
    token: str,
    *,
    principal: Principal,
    read_model: ReadModel,
    ledger: SubmitLedger,
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> tuple[list[StepView], str]:
    """A page of a run's steps, oldest first.

    The page also ends before the steps would pass `max_bytes` (the response's send limit; steps
    with large tool results): then it holds fewer than page_size steps and the next page token
    resumes after the last one it holds (AIP-158). It holds at least one step.
    """
    principal.require(ROLE_MEMBER)
    limit = page_size(size)
    listing = f"steps:{run_id}"
    after = _resume_key(token, listing, _step_key)
    _visible_run(principal.tenant_id, run_id, read_model, ledger)
    steps = read_model.list_steps(principal.tenant_id, run_id, after or 0, limit + 1)
    more = len(steps) > limit
    steps = steps[:limit]
    budget, used = max_bytes - RESPONSE_OVERHEAD, 0
    for i, step in enumerate(steps):
        used += step_bytes(step)
        if used > budget and i > 0:
            steps, more = steps[:i], True
            break
    return steps, encode_token(listing, steps[-1].step) if more else ""


def get_run_trace(
    run_id: str,
    *,
    principal: Principal,
    read_model: ReadModel,
    ledger: SubmitLedger,
    max_events: int,
    max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> tuple[RunView, Trace]:
    """The run and its first events as a trace: at most max_events events, and no more than fit in
    `max_bytes` (the response's send limit; runs with large tool results); truncated says if the
    run has more. GetRunTrace has no continuation: the rest is read with StreamRunEvents from the
    seq after the trace's last event."""
    principal.require(ROLE_MEMBER)
    view = _visible_run(principal.tenant_id, run_id, read_model, ledger)
    events: list[EventView] = []
    budget, used = max_bytes - RESPONSE_OVERHEAD - run_bytes(view), 0
    truncated = False
    seq = 1
    while not truncated:
        page = read_model.events(principal.tenant_id, run_id, seq, min(1000, max_events + 1 - len(events)))
        if not page:
            break
        for ev in page:
            used += trace_event_bytes(ev)
            if len(events) == max_events or used > budget:
                truncated = True
                break
            events.append(ev)
        seq = page[-1].seq + 1
    return view, build_trace(events, truncated=truncated)


@dataclass(frozen=True)
class StreamPolicy:
    """How a live stream waits (settings)."""

    page: int = 500  # events per catch-up query
    block_ms: int = 1000  # longest wait on the live feed before re-checking the read model
    gap_wait_s: float = 5.0  # how long a seq seen live may be missing from the read model
    gap_poll_s: float = 0.1


def stream_run_events(
    run_id: str,
    from_seq: int,
    *,
    principal: Principal,
    read_model: ReadModel,
    ledger: SubmitLedger,
    live: LiveEvents,
    policy: StreamPolicy,
    is_active: Callable[[], bool],
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Iterator[EventView]:
    """The run's events from from_seq, each exactly once and in order, through the terminal event and
    then the facts the read model already holds after it (up to the run's last_seq once the terminal
    event is sent): the budget still records the outcome of a tool call that was running when the
    run ended, and a client that cancelled a run must learn that it ran.

    The read model is the truth and the live feed a wake-up: the feed position is taken
    before the catch-up query, so an event committed during catch-up is seen on the feed
    (and dropped there if catch-up already sent it); a seq that arrives ahead of the next
    one owed makes the stream fetch the missing range from the read model first; a quiet
    feed makes it re-check the read model, so a lost live publish delays an event but
    never loses it. Raises StreamResumeRequired (retryable: the client resumes from the next seq
    it is owed) if a seen seq stays missing from the read model for gap_wait_s, and StreamHole
    (permanent, with the next stored seq) at once when the read model holds a later seq of the
    run but not the one owed, a hole no projector write can fill. A hole at the end of a finished run
    (its last_seq is past every event the read model holds for this tenant at or after the seq owed:
    the projector stores an event naming another tenant under that tenant and still advances
    last_seq) is a StreamHole too, naming last_seq + 1: nothing will fill it, and the run's end
    would otherwise never be reached, the stream re-reading the read model until the client left.

    A from_seq past the run's last event sends nothing and ends once the run has finished
    (at once if it already had): when the feed shows the terminal event below from_seq, or
    when a quiet feed's re-check finds the run finished with its last seq below from_seq.
    """
    principal.require(ROLE_MEMBER)
    if from_seq < 0:
        raise InvalidArgument(FieldViolation("from_seq", "must not be negative"))
    tenant = principal.tenant_id
    view = _visible_run(tenant, run_id, read_model, ledger)
    gate = SeqGate(from_seq)

    def past_the_end(run: RunView | None) -> bool:
        return run is not None and run.status.finished and 0 < run.last_seq < gate.next_seq

    def hole_at_the_end(run: RunView | None) -> StreamHole | None:
        # Called only after a catch-up that read the events after `run` and found none from
        # gate.next_seq on: the projector commits an event with its run's last_seq, so a finished run
        # whose last_seq is at or past the seq owed holds that seq under another tenant (or not at
        # all). The stream would never reach the run's end; say where the log ends instead.
        if run is None or not run.status.finished or gate.done or run.last_seq < gate.next_seq:
            return None
        return StreamHole(run_id, gate.next_seq, run.last_seq + 1)

    if past_the_end(view):
        return  # resuming after the terminal event: nothing more will come
    cursor = live.position(run_id)

    def catch_up() -> Iterator[EventView]:
        while not gate.done:
            page = read_model.events(tenant, run_id, gate.next_seq, policy.page)
            for ev in page:
                if gate.offer(ev.seq) is not Offer.NEXT:
                    # A later seq stored and this one not (one query, one snapshot): the projector
                    # stores a run's events in seq order and never below its last_seq, so it moved
                    # past an event it did not store (docs/projector.md) and nothing will fill the
                    # hole. Waiting would hold a stream slot for ever, and a retry at the same seq
                    # would find the same hole: end the call there, saying where the log goes on.
                    raise StreamHole(run_id, gate.next_seq, ev.seq)
                gate.sent(ev)
                yield ev
                if gate.done:
                    return
            if len(page) < policy.page:
                return

    yield from catch_up()
    if (hole := hole_at_the_end(view)) is not None:
        raise hole
    while not gate.done and is_active():
        entries, cursor = live.read(run_id, cursor, policy.block_ms)
        if not entries:
            before = gate.next_seq
            yield from catch_up()
            if gate.next_seq != before:
                continue
            # Nothing new in the read model either: the run may have ended below from_seq,
            # its terminal event never shown on the feed (a lost publish), so ask the run.
            run = read_model.get_run(tenant, run_id)
            if past_the_end(run):
                return
            if hole_at_the_end(run) is not None:
                # Read again after the run: an event committed between the catch-up and get_run
                # is no hole.
                yield from catch_up()
                if gate.next_seq == before and (hole := hole_at_the_end(run)) is not None:
                    raise hole
            continue
        for entry in entries:
            offer = gate.offer(entry.seq)
            if offer is Offer.SEEN:
                if entry.event is not None and entry.event.terminal:
                    return  # the run ended below from_seq (had it been sent, the gate would be done)
                continue
            if offer is Offer.AHEAD or entry.event is None:
                yield from _fill(gate, entry.seq - (0 if entry.event is None else 1), catch_up, policy,
                                 sleep, monotonic, run_id)
                if gate.offer(entry.seq) is Offer.SEEN:
                    continue
            if entry.event is not None and gate.offer(entry.seq) is Offer.NEXT:
                gate.sent(entry.event)
                yield entry.event
            if gate.done:
                break
    if gate.done:
        yield from _after_the_terminal(gate, tenant, run_id, read_model, policy)


def _after_the_terminal(
    gate: SeqGate, tenant: str, run_id: str, read_model: ReadModel, policy: StreamPolicy
) -> Iterator[EventView]:
    """The stored events after the terminal one, up to the run's last_seq as the read model has it
    now (late facts: services/budget decisions._after_end). One catch-up, no wait: a fact stored
    later is read by a resume from the next seq. A seq up to last_seq that is not stored for this
    tenant is a StreamHole, in the middle as at the end (then naming last_seq + 1)."""
    run = read_model.get_run(tenant, run_id)
    last_seq = run.last_seq if run is not None else 0
    while gate.next_seq <= last_seq:
        page = [ev for ev in read_model.events(tenant, run_id, gate.next_seq, policy.page) if ev.seq <= last_seq]
        for ev in page:
            if gate.offer(ev.seq) is not Offer.NEXT:
                raise StreamHole(run_id, gate.next_seq, ev.seq)  # as in catch-up: nothing will fill it
            gate.sent(ev)
            yield ev
        if not page:
            # last_seq is past every event stored for this tenant (one naming another tenant is stored
            # under that tenant): a hole at the end, reported as a resume from here would report it.
            raise StreamHole(run_id, gate.next_seq, last_seq + 1)


def _fill(
    gate: SeqGate,
    through_seq: int,
    catch_up: Callable[[], Iterator[EventView]],
    policy: StreamPolicy,
    sleep: Callable[[float], None],
    monotonic: Callable[[], float],
    run_id: str,
) -> Iterator[EventView]:
    """Send every seq up to through_seq from the read model, waiting briefly for the projector."""
    deadline = monotonic() + policy.gap_wait_s
    while gate.next_seq <= through_seq and not gate.done:
        before = gate.next_seq
        yield from catch_up()
        if gate.next_seq > through_seq or gate.done:
            return
        if gate.next_seq == before and monotonic() >= deadline:
            raise StreamResumeRequired(run_id, gate.next_seq)
        sleep(policy.gap_poll_s)


# -- approvals ----------------------------------------------------------------------------------


def list_approvals(
    status: str,
    run_id: str,
    size: int,
    token: str,
    *,
    principal: Principal,
    read_model: ReadModel,
    now_ms: int,
) -> tuple[list[ApprovalView], str]:
    """A page of the tenant's approvals in `status` (default PENDING) as of now_ms, oldest request first.

    The status is the effective one the response shows: a PENDING approval past its expiry is
    EXPIRED (listed there, not under PENDING) even before the approval service records it. An
    approver may read what they may decide (member or approver).
    """
    principal.require_any(ROLE_MEMBER, ROLE_APPROVER)
    status = status or "PENDING"
    violations = []
    if status not in APPROVAL_STATUSES:
        violations.append(FieldViolation("status", f"must be one of {', '.join(APPROVAL_STATUSES)}"))
    if run_id:
        violations += check_run_id(run_id)
    if violations:
        raise InvalidArgument(violations)
    limit = page_size(size)
    listing = f"approvals:{status}:{run_id}"
    after = _resume_key(token, listing, _approval_key)
    key = (after[0], after[1]) if isinstance(after, list) else None
    rows = read_model.list_approvals(principal.tenant_id, status, run_id or None, key, limit + 1, now_ms)
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, encode_token(listing, [rows[-1].requested_at_ms, rows[-1].approval_id]) if more else ""


def get_approval(approval_id: str, *, principal: Principal, read_model: ReadModel) -> ApprovalView:
    """One approval of the tenant (member or approver: `tether approvals approve` reads it first)."""
    principal.require_any(ROLE_MEMBER, ROLE_APPROVER)
    violations = check_no_nul(approval_id, "approval_id")
    if not approval_id or len(approval_id) > 128:
        violations.append(FieldViolation("approval_id", "must be 1-128 characters"))
    if violations:
        raise InvalidArgument(violations)
    approval = read_model.get_approval(principal.tenant_id, approval_id)
    if approval is None:
        raise ApprovalNotFound(approval_id)
    return approval


@dataclass(frozen=True)
class Decision:
    """An approver's decision as sent."""

    approval_id: str
    args_hash: str
    approve: bool
    comment: str = ""


def decide_approval(
    decision: Decision,
    *,
    principal: Principal,
    now_ms: int,
    read_model: ReadModel,
    ledger: SubmitLedger,
    catalog: Catalog,
    publisher: CommandPublisher,
    partitioning: Partitioning,
    forbid_self_approval: bool = True,
    traceparent: str | None = None,
) -> ApprovalView:
    """Check now what the approval service will check (same reason codes: the approval is the
    tenant's and pending, not expired, not approved by the run's own submitter, for these args)
    and produce a DecideApproval command; the approval service makes the binding decision."""
    principal.require(ROLE_APPROVER)
    violations = check_no_nul(decision.approval_id, "approval_id")
    if not decision.approval_id or len(decision.approval_id) > 128:
        violations.append(FieldViolation("approval_id", "must be 1-128 characters"))
    if len(decision.args_hash) != 64 or not set(decision.args_hash) <= _HEX64:
        violations.append(FieldViolation("args_hash", "must be the 64-character lowercase hex sha256 of the args"))
    if len(decision.comment) > 4000:
        violations.append(FieldViolation("comment", "must be at most 4000 characters"))
    violations += check_no_nul(decision.comment, "comment")
    if violations:
        raise InvalidArgument(violations)
    tenant = principal.tenant_id
    approval = read_model.get_approval(tenant, decision.approval_id)
    if approval is None:
        raise ApprovalNotFound(decision.approval_id)
    if approval.status != "PENDING":
        raise ApprovalNotPending(decision.approval_id, approval.status)
    if decision.approve and forbid_self_approval:
        submission = ledger.find_run(tenant, approval.run_id)
        run = None if submission is not None else read_model.get_run(tenant, approval.run_id)
        submitter = submission.principal_id if submission is not None else (run.principal_id if run else "")
        if not submitter:
            raise SubmitterUnknown(decision.approval_id)
        if submitter == principal.principal_id:
            raise SelfApproval(decision.approval_id)
    if approval.args_hash != decision.args_hash:
        raise StaleArgsHash(decision.approval_id)
    if approval.effective_status(now_ms) == "EXPIRED":
        raise ApprovalExpired(decision.approval_id, approval.expires_at_ms or 0)
    command = DecideApproval(
        approval_id=approval.approval_id,
        call_id=approval.call_id,
        args_hash=decision.args_hash,
        approver_id=principal.principal_id,
        approver_roles=sorted(principal.roles),
        approve=decision.approve,
        comment=decision.comment,
    )
    envelope = make_envelope(
        command,
        run_id=approval.run_id,
        tenant_id=tenant,
        event_id=derived_id(approval.run_id, "DecideApproval", approval.approval_id, principal.principal_id,
                            decision.approve),
        producer=PRODUCER,
        recorded_at_ms=now_ms,
        traceparent=traceparent,
    )
    publisher.publish(envelope, _run_partition(tenant, approval.run_id, ledger, catalog, partitioning))
    return replace(
        approval,
        status="APPROVED" if decision.approve else "REJECTED",
        decided_by=principal.principal_id,
        decided_at_ms=now_ms,
        comment=decision.comment,
    )
