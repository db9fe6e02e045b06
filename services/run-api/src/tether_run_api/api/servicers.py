"""gRPC servicers of tether.v1: authenticate, check size, call the handler, convert, map refusals."""

from __future__ import annotations

import functools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from tether_api.v1 import (
    agent_service_pb2 as agents_pb,
    agent_service_pb2_grpc as agents_grpc,
    approval_service_pb2 as approvals_pb,
    approval_service_pb2_grpc as approvals_grpc,
    run_service_pb2 as runs_pb,
    run_service_pb2_grpc as runs_grpc,
    tool_service_pb2 as tools_pb,
    tool_service_pb2_grpc as tools_grpc,
)
from tether_run_api import handlers
from tether_run_api.api import convert
from tether_run_api.api.metrics import REFUSALS, RPC_SECONDS, RPCS, STREAMED_EVENTS, STREAMS, SUBMITS
from tether_run_api.api.status import internal_status, rich_status
from tether_run_api.domain.admission import SubmitRateLimiter
from tether_run_api.domain.auth import Principal, api_key_from_metadata, hash_api_key
from tether_run_api.domain.catalog import CatalogLimits
from tether_run_api.domain.errors import (
    ApiError,
    MalformedRequest,
    RequestTooLarge,
    ResponseTooLarge,
    TenantTooManyStreams,
    TooManyStreams,
    Unauthenticated,
)
from tether_run_api.domain.runs import RunLimits, SubmitRequest, new_run_id
from tether_run_api.domain.tenancy import AdmissionGate
from tether_run_api.ports import ApiKeys, Catalog, CommandPublisher, LiveEvents, ReadModel, SubmitLedger

log = structlog.get_logger("tether_run_api.api")


@dataclass
class Services:
    """What the servicers need: the ports, the policies, and the clock and id sources."""

    keys: ApiKeys
    catalog: Catalog
    ledger: SubmitLedger
    read_model: ReadModel
    live: LiveEvents
    publisher: CommandPublisher
    limiter: SubmitRateLimiter
    partitioning: handlers.Partitioning
    catalog_limits: CatalogLimits = CatalogLimits()
    run_limits: RunLimits = RunLimits()
    stream_policy: handlers.StreamPolicy = handlers.StreamPolicy()
    max_request_bytes: int = 1024 * 1024
    max_trace_events: int = 10_000
    max_streams: int = 32
    #: Streams one tenant may hold at once (0: a quarter of max_streams, at least 1), so one tenant
    #: watching many long runs cannot take every slot from the others.
    max_streams_per_tenant: int = 0
    auth_cache_s: float = 10.0
    forbid_self_approval: bool = True
    #: The approximate tenant-capacity check at submit (None: only the budget service enforces it).
    admission: AdmissionGate | None = None
    clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000
    new_run_id: Callable[[int], str] | None = None

    def streams_per_tenant(self) -> int:
        return min(self.max_streams, self.max_streams_per_tenant or max(1, self.max_streams // 4))

    def run_id(self, now_ms: int) -> str:
        if self.new_run_id is not None:
            return self.new_run_id(now_ms)
        return new_run_id(now_ms, os.urandom(10))


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands for a request whose bytes did not parse (see server.DecodeGuard), so that the servicer
    refuses it like any bad request, after authentication, as MALFORMED_REQUEST."""

    method: str
    size_bytes: int

    def ByteSize(self) -> int:  # noqa: N802 (the protobuf message method the size check calls)
        return self.size_bytes


class Gate:
    """Authentication (with a short cache of key lookups), the per-request size and shape check, and the
    response size check (`max_response_bytes`: the server's gRPC send limit)."""

    _MAX_CACHED = 10_000

    def __init__(self, services: Services, max_response_bytes: int = handlers.DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self.services = services
        self.max_response_bytes = max_response_bytes
        self._cache: dict[str, tuple[Principal | None, float]] = {}
        self._lock = threading.Lock()
        self._streams = threading.BoundedSemaphore(services.max_streams)
        self._streams_per_tenant = services.streams_per_tenant()
        self._tenant_streams: dict[str, int] = {}
        self._slots_lock = threading.Lock()

    def authenticate(self, context: grpc.ServicerContext) -> Principal:
        key_hash = hash_api_key(api_key_from_metadata(context.invocation_metadata() or ()))
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key_hash)
        if cached is not None and cached[1] > now:
            principal = cached[0]
        else:
            principal = self.services.keys.principal_for(key_hash)
            with self._lock:
                if len(self._cache) >= self._MAX_CACHED:
                    self._cache.clear()
                self._cache[key_hash] = (principal, now + self.services.auth_cache_s)
        if principal is None:
            raise Unauthenticated("invalid API key")
        return principal

    def check_size(self, request: Any) -> None:
        if isinstance(request, UndecodableRequest):
            raise MalformedRequest(request.method, request.size_bytes)
        size = request.ByteSize()
        if size > self.services.max_request_bytes:
            raise RequestTooLarge(size, self.services.max_request_bytes)

    def check_response_size(self, method: str, response: Any) -> None:
        """Refuse, with a reason, a response gRPC would fail to send (a bare RESOURCE_EXHAUSTED after the
        call was counted OK). The queries cut their lists by bytes first; this catches what they cannot
        (one step larger than the limit)."""
        size = response.ByteSize()
        if size > self.max_response_bytes:
            raise ResponseTooLarge(method, size, self.max_response_bytes)

    def stream_slot(self, tenant_id: str) -> None:
        """Take one of the server's stream slots for the tenant; its own share is checked first, so a
        tenant at its cap is told so (TENANT_TOO_MANY_STREAMS) even while the server has slots."""
        with self._slots_lock:
            held = self._tenant_streams.get(tenant_id, 0)
            if held >= self._streams_per_tenant:
                raise TenantTooManyStreams(tenant_id, self._streams_per_tenant)
            if not self._streams.acquire(blocking=False):
                raise TooManyStreams(self.services.max_streams)
            self._tenant_streams[tenant_id] = held + 1
        STREAMS.inc()

    def release_stream_slot(self, tenant_id: str) -> None:
        STREAMS.dec()
        with self._slots_lock:
            left = self._tenant_streams[tenant_id] - 1
            if left:
                self._tenant_streams[tenant_id] = left
            else:
                del self._tenant_streams[tenant_id]
            self._streams.release()


def _traceparent(context: grpc.ServicerContext) -> str | None:
    for item in context.invocation_metadata() or ():
        if item.key == "traceparent" and isinstance(item.value, str):
            return item.value
    return None


def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a unary method `fn(self, request, context, principal)` with auth, size check, metrics, errors."""
    method = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: _Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        status: grpc.Status | None = None
        code = "OK"
        try:
            principal = self.gate.authenticate(context)
            self.gate.check_size(request)
            response = fn(self, request, context, principal)
            self.gate.check_response_size(method, response)
            return response
        except ApiError as err:
            code = err.category.value
            REFUSALS.labels(err.reason).inc()
            status = rich_status(err)
        except Exception:
            code = "INTERNAL"
            log.exception("rpc_failed", method=method)
            status = internal_status()
        finally:
            RPCS.labels(method, code).inc()
            RPC_SECONDS.labels(method).observe(time.perf_counter() - started)
        context.abort_with_status(status)

    return wrapper


def server_stream(fn: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    """Wrap a server-streaming method like `unary`, holding one of the server's stream slots (and of the
    caller's tenant's share of them)."""
    method = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: _Servicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        status: grpc.Status | None = None
        code = "OK"
        slot: str | None = None  # the tenant holding one of the server's stream slots
        try:
            principal = self.gate.authenticate(context)
            self.gate.check_size(request)
            self.gate.stream_slot(principal.tenant_id)
            slot = principal.tenant_id
            yield from fn(self, request, context, principal)
        except ApiError as err:
            code = err.category.value
            REFUSALS.labels(err.reason).inc()
            status = rich_status(err)
        except Exception:
            code = "INTERNAL"
            log.exception("rpc_failed", method=method)
            status = internal_status()
        finally:
            if slot is not None:
                self.gate.release_stream_slot(slot)
            RPCS.labels(method, code).inc()
        if status is not None:
            context.abort_with_status(status)

    return wrapper


class _Servicer:
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.s = gate.services


class AgentService(_Servicer, agents_grpc.AgentServiceServicer):
    """tether.v1.AgentService."""

    @unary
    def CreateAgent(self, request, context, principal):  # noqa: N802 (gRPC names)
        agent = handlers.create_agent(
            convert.agent_draft(request.agent), request.request_id,
            principal=principal, now_ms=self.s.clock_ms(), catalog=self.s.catalog, limits=self.s.catalog_limits,
        )
        return agents_pb.CreateAgentResponse(agent=convert.agent_pb(agent))

    @unary
    def UpdateAgent(self, request, context, principal):  # noqa: N802
        agent = handlers.update_agent(
            convert.agent_draft(request.agent), list(request.update_mask.paths), request.agent.version,
            request.request_id,
            principal=principal, now_ms=self.s.clock_ms(), catalog=self.s.catalog, limits=self.s.catalog_limits,
        )
        return agents_pb.UpdateAgentResponse(agent=convert.agent_pb(agent))

    @unary
    def GetAgent(self, request, context, principal):  # noqa: N802
        agent = handlers.get_agent(request.agent_id, request.version, principal=principal, catalog=self.s.catalog)
        return agents_pb.GetAgentResponse(agent=convert.agent_pb(agent))

    @unary
    def ListAgents(self, request, context, principal):  # noqa: N802
        rows, token = handlers.list_agents(request.page_size, request.page_token, principal=principal,
                                           catalog=self.s.catalog)
        return agents_pb.ListAgentsResponse(agents=[convert.agent_pb(a) for a in rows], next_page_token=token)


class ToolService(_Servicer, tools_grpc.ToolServiceServicer):
    """tether.v1.ToolService."""

    @unary
    def RegisterTool(self, request, context, principal):  # noqa: N802
        tool = handlers.register_tool(
            convert.tool_draft(request.tool), request.request_id,
            principal=principal, now_ms=self.s.clock_ms(), catalog=self.s.catalog, limits=self.s.catalog_limits,
        )
        return tools_pb.RegisterToolResponse(tool=convert.tool_pb(tool))

    @unary
    def GetTool(self, request, context, principal):  # noqa: N802
        tool = handlers.get_tool(request.name, request.version, principal=principal, catalog=self.s.catalog)
        return tools_pb.GetToolResponse(tool=convert.tool_pb(tool))

    @unary
    def ListTools(self, request, context, principal):  # noqa: N802
        rows, token = handlers.list_tools(request.page_size, request.page_token, request.show_disabled,
                                          principal=principal, catalog=self.s.catalog)
        return tools_pb.ListToolsResponse(tools=[convert.tool_pb(t) for t in rows], next_page_token=token)

    @unary
    def DisableTool(self, request, context, principal):  # noqa: N802
        versions = handlers.disable_tool(request.name, request.version, principal=principal, catalog=self.s.catalog)
        return tools_pb.DisableToolResponse(disabled_versions=versions)


class RunService(_Servicer, runs_grpc.RunServiceServicer):
    """tether.v1.RunService."""

    @unary
    def SubmitRun(self, request, context, principal):  # noqa: N802
        now = self.s.clock_ms()
        run_id = self.s.run_id(now)
        req = SubmitRequest(
            request_id=request.request_id or str(uuid.uuid4()),
            agent_id=request.agent_id,
            goal=request.goal,
            agent_version=request.agent_version,
            caps=convert.caps_draft(request.caps),
            delegated_scope=tuple(request.delegated_scope.tools) if request.HasField("delegated_scope") else None,
        )
        sub = handlers.submit_run(
            req, principal=principal, now_ms=now, run_id=run_id, catalog=self.s.catalog, ledger=self.s.ledger,
            publisher=self.s.publisher, limiter=self.s.limiter, limits=self.s.run_limits,
            partitioning=self.s.partitioning, traceparent=_traceparent(context), admission=self.s.admission,
        )
        SUBMITS.labels("new" if sub.run_id == run_id else "replayed").inc()
        return runs_pb.SubmitRunResponse(run_id=sub.run_id, agent_version=sub.agent_version)

    @unary
    def GetRun(self, request, context, principal):  # noqa: N802
        run = handlers.get_run(request.run_id, principal=principal, read_model=self.s.read_model, ledger=self.s.ledger)
        return runs_pb.GetRunResponse(run=convert.run_pb(run))

    @unary
    def ListRuns(self, request, context, principal):  # noqa: N802
        rows, token = handlers.list_runs(request.page_size, request.page_token, principal=principal,
                                         read_model=self.s.read_model, ledger=self.s.ledger)
        return runs_pb.ListRunsResponse(runs=[convert.run_pb(r) for r in rows], next_page_token=token)

    @unary
    def ListRunSteps(self, request, context, principal):  # noqa: N802
        rows, token = handlers.list_run_steps(request.run_id, request.page_size, request.page_token,
                                              principal=principal, read_model=self.s.read_model, ledger=self.s.ledger,
                                              max_bytes=self.gate.max_response_bytes)
        return runs_pb.ListRunStepsResponse(steps=[convert.step_pb(s) for s in rows], next_page_token=token)

    @server_stream
    def StreamRunEvents(self, request, context, principal):  # noqa: N802
        events = handlers.stream_run_events(
            request.run_id, request.from_seq, principal=principal, read_model=self.s.read_model,
            ledger=self.s.ledger, live=self.s.live, policy=self.s.stream_policy, is_active=context.is_active,
        )
        for ev in events:
            STREAMED_EVENTS.inc()
            yield runs_pb.StreamRunEventsResponse(event=convert.event_pb(ev))

    @unary
    def CancelRun(self, request, context, principal):  # noqa: N802
        handlers.cancel_run(
            request.run_id, request.reason, principal=principal, now_ms=self.s.clock_ms(),
            read_model=self.s.read_model, ledger=self.s.ledger, publisher=self.s.publisher,
            partitioning=self.s.partitioning, catalog=self.s.catalog, traceparent=_traceparent(context),
        )
        return runs_pb.CancelRunResponse(run_id=request.run_id)

    @unary
    def GetRunTrace(self, request, context, principal):  # noqa: N802
        run, trace = handlers.get_run_trace(request.run_id, principal=principal, read_model=self.s.read_model,
                                            ledger=self.s.ledger, max_events=self.s.max_trace_events,
                                            max_bytes=self.gate.max_response_bytes)
        return convert.trace_pb(run, trace)


class ApprovalService(_Servicer, approvals_grpc.ApprovalServiceServicer):
    """tether.v1.ApprovalService."""

    @unary
    def ListApprovals(self, request, context, principal):  # noqa: N802
        now = self.s.clock_ms()  # one instant for the filter and the statuses shown
        rows, token = handlers.list_approvals(
            convert.approval_status_filter(request.status), request.run_id, request.page_size, request.page_token,
            principal=principal, read_model=self.s.read_model, now_ms=now,
        )
        return approvals_pb.ListApprovalsResponse(approvals=[convert.approval_pb(a, now) for a in rows],
                                                  next_page_token=token)

    @unary
    def GetApproval(self, request, context, principal):  # noqa: N802
        approval = handlers.get_approval(request.approval_id, principal=principal, read_model=self.s.read_model)
        return approvals_pb.GetApprovalResponse(approval=convert.approval_pb(approval, self.s.clock_ms()))

    @unary
    def DecideApproval(self, request, context, principal):  # noqa: N802
        now = self.s.clock_ms()
        approval = handlers.decide_approval(
            handlers.Decision(request.approval_id, request.args_hash, request.approve, request.comment),
            principal=principal, now_ms=now, read_model=self.s.read_model, ledger=self.s.ledger,
            catalog=self.s.catalog, publisher=self.s.publisher, partitioning=self.s.partitioning,
            forbid_self_approval=self.s.forbid_self_approval, traceparent=_traceparent(context),
        )
        return approvals_pb.DecideApprovalResponse(approval=convert.approval_pb(approval, now))
