"""Named refusals of the run-api; the gRPC boundary turns each into a status with an ErrorInfo reason."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

DOMAIN = "tether.dev"


class Category(str, Enum):
    """The kind of refusal; the boundary maps it to the gRPC status code of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"


@dataclass(frozen=True)
class FieldViolation:
    """One invalid field of a request (google.rpc.BadRequest.FieldViolation)."""

    field: str
    description: str
    reason: str = ""


class ApiError(Exception):
    """A request the run-api refuses. `reason` is stable and machine-readable (ErrorInfo.reason)."""

    category: ClassVar[Category]
    reason: ClassVar[str]

    def __init__(self, message: str, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = {k: str(v) for k, v in metadata.items()}

    #: Seconds after which a retry may succeed (google.rpc.RetryInfo); None = do not retry as is.
    retry_after_s: float | None = None


class Unauthenticated(ApiError):
    """No API key, a malformed one, or one that is unknown or revoked (never says which)."""

    category = Category.UNAUTHENTICATED
    reason = "UNAUTHENTICATED_API_KEY"


class MissingRole(ApiError):
    """The principal lacks the role the method needs."""

    category = Category.PERMISSION_DENIED
    reason = "MISSING_ROLE"

    def __init__(self, role: str, any_of: tuple[str, ...] = ()) -> None:
        if len(any_of) > 1:
            super().__init__(f"this method needs one of the roles {', '.join(any_of)}", required_role=role,
                             any_of=",".join(any_of))
        else:
            super().__init__(f"this method needs the {role!r} role", required_role=role)


class InvalidArgument(ApiError):
    """One or more fields are invalid; `violations` lists each (google.rpc.BadRequest)."""

    category = Category.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(self, violations: list[FieldViolation] | FieldViolation) -> None:
        if isinstance(violations, FieldViolation):
            violations = [violations]
        self.violations = list(violations)
        text = "; ".join(f"{v.field}: {v.description}" for v in self.violations)
        super().__init__(f"invalid request: {text}", fields=",".join(v.field for v in self.violations))


class InvalidPageToken(InvalidArgument):
    """A page token that this server did not issue for this listing."""

    reason = "INVALID_PAGE_TOKEN"

    def __init__(self) -> None:
        super().__init__(FieldViolation("page_token", "not a page token issued for this listing"))


class UnstorableValue(InvalidArgument):
    """A value the database refused as data (psycopg DataError: a U+0000 character, a number out of
    range) that validation did not catch; the request cannot succeed unchanged, so not INTERNAL."""

    reason = "UNSTORABLE_VALUE"

    def __init__(self, sqlstate: str | None = None) -> None:
        super().__init__(FieldViolation(
            "request", "holds a value the database cannot store (such as a U+0000 character or a number out of range)"
        ))
        if sqlstate:
            self.metadata["sqlstate"] = sqlstate


class MalformedRequest(ApiError):
    """The request's bytes are not the method's protobuf message; retrying them unchanged cannot succeed."""

    category = Category.INVALID_ARGUMENT
    reason = "MALFORMED_REQUEST"

    def __init__(self, method: str, size_bytes: int) -> None:
        super().__init__(f"the request to {method} is not a valid protobuf message of its type",
                         method=method, size_bytes=size_bytes)


class RequestTooLarge(ApiError):
    """The request is larger than the server accepts; retrying it unchanged cannot succeed."""

    category = Category.RESOURCE_EXHAUSTED
    reason = "REQUEST_TOO_LARGE"

    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(
            f"request is {size_bytes} bytes; the limit is {limit_bytes}",
            size_bytes=size_bytes,
            limit_bytes=limit_bytes,
        )


class ResponseTooLarge(ApiError):
    """The answer would be larger than the server may send (one item alone past the limit, where a
    list cannot be cut smaller); retrying it unchanged cannot succeed."""

    category = Category.RESOURCE_EXHAUSTED
    reason = "RESPONSE_TOO_LARGE"

    def __init__(self, method: str, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(
            f"the response of {method} would be {size_bytes} bytes; the limit is {limit_bytes}",
            method=method,
            size_bytes=size_bytes,
            limit_bytes=limit_bytes,
        )


class RateLimited(ApiError):
    """The tenant submits faster than its admission rate; retry after `retry_after_s`."""

    category = Category.RESOURCE_EXHAUSTED
    reason = "RATE_LIMITED"

    def __init__(self, tenant_id: str, retry_after_s: float, limit_per_s: float) -> None:
        super().__init__(
            f"tenant submit rate above {limit_per_s:g}/s; retry in {retry_after_s:.3f}s",
            tenant_id=tenant_id,
            limit_per_s=f"{limit_per_s:g}",
        )
        self.retry_after_s = retry_after_s


class RunNotFound(ApiError):
    """No such run for this tenant (also for another tenant's run: existence is never revealed)."""

    category = Category.NOT_FOUND
    reason = "RUN_NOT_FOUND"

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found", run_id=run_id)


class AgentNotFound(ApiError):
    """No such agent (or agent version) for this tenant."""

    category = Category.NOT_FOUND
    reason = "AGENT_NOT_FOUND"

    def __init__(self, agent_id: str, version: int | None = None) -> None:
        what = f"agent {agent_id!r}" + (f" version {version}" if version else "")
        super().__init__(f"{what} not found", agent_id=agent_id, version=version or "latest")


class ToolNotFound(ApiError):
    """No such tool (or tool version) for this tenant."""

    category = Category.NOT_FOUND
    reason = "TOOL_NOT_FOUND"

    def __init__(self, name: str, version: int | None = None) -> None:
        what = f"tool {name!r}" + (f" version {version}" if version else "")
        super().__init__(f"{what} not found", tool_name=name, version=version or "latest")


class ApprovalNotFound(ApiError):
    """No such approval for this tenant."""

    category = Category.NOT_FOUND
    reason = "APPROVAL_NOT_FOUND"

    def __init__(self, approval_id: str) -> None:
        super().__init__(f"approval {approval_id!r} not found", approval_id=approval_id)


class AgentAlreadyExists(ApiError):
    """CreateAgent for an agent id the tenant already has (use UpdateAgent)."""

    category = Category.ALREADY_EXISTS
    reason = "AGENT_ALREADY_EXISTS"

    def __init__(self, agent_id: str) -> None:
        super().__init__(f"agent {agent_id!r} already exists; UpdateAgent makes a new version", agent_id=agent_id)


class RequestIdReused(ApiError):
    """A request_id was already used by this tenant for a different request."""

    category = Category.ALREADY_EXISTS
    reason = "REQUEST_ID_REUSED"

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"request_id {request_id!r} was already used for a different request", request_id=request_id
        )


class AgentVersionConflict(ApiError):
    """UpdateAgent based on a version that is no longer the latest; re-read and retry."""

    category = Category.ABORTED
    reason = "AGENT_VERSION_CONFLICT"

    def __init__(self, agent_id: str, expected: int, latest: int) -> None:
        super().__init__(
            f"agent {agent_id!r} is at version {latest}, not {expected}",
            agent_id=agent_id,
            expected_version=expected,
            latest_version=latest,
        )


class RunAlreadyFinished(ApiError):
    """The run has already ended; cancelling it has no effect."""

    category = Category.FAILED_PRECONDITION
    reason = "RUN_ALREADY_FINISHED"

    def __init__(self, run_id: str, status: str) -> None:
        super().__init__(f"run {run_id!r} already ended ({status})", run_id=run_id, status=status)


class ApprovalNotPending(ApiError):
    """The approval was already decided or has expired."""

    category = Category.FAILED_PRECONDITION
    reason = "APPROVAL_NOT_PENDING"

    def __init__(self, approval_id: str, status: str) -> None:
        super().__init__(f"approval {approval_id!r} is {status}, not pending", approval_id=approval_id, status=status)


class StaleArgsHash(ApiError):
    """The decision quotes other arguments than the ones awaiting approval (approval service: same reason)."""

    category = Category.FAILED_PRECONDITION
    reason = "STALE_ARGS_HASH"

    def __init__(self, approval_id: str) -> None:
        super().__init__(
            f"args_hash does not match the arguments awaiting approval {approval_id!r}; re-read the approval",
            approval_id=approval_id,
        )


class ApprovalExpired(ApiError):
    """The approval's deadline has passed; the call will be denied."""

    category = Category.FAILED_PRECONDITION
    reason = "APPROVAL_EXPIRED"

    def __init__(self, approval_id: str, expires_at_ms: int) -> None:
        super().__init__(f"approval {approval_id!r} expired", approval_id=approval_id, expires_at_ms=expires_at_ms)


class SelfApproval(ApiError):
    """An approver may not approve a call of a run they submitted (rejecting it is allowed)."""

    category = Category.PERMISSION_DENIED
    reason = "SELF_APPROVAL"

    def __init__(self, approval_id: str) -> None:
        super().__init__(f"you submitted the run of approval {approval_id!r}; another approver must approve it",
                         approval_id=approval_id)


class SubmitterUnknown(ApiError):
    """The run's submitter is not known yet, so self-approval cannot be ruled out (fails closed)."""

    category = Category.FAILED_PRECONDITION
    reason = "SUBMITTER_UNKNOWN"
    retry_after_s = 1.0

    def __init__(self, approval_id: str) -> None:
        super().__init__(f"the submitter of approval {approval_id!r}'s run is not known yet", approval_id=approval_id)


class CommandNotDelivered(ApiError):
    """Kafka did not acknowledge the command in time; a retry with the same request_id is safe."""

    category = Category.UNAVAILABLE
    reason = "COMMAND_NOT_DELIVERED"
    retry_after_s = 1.0

    def __init__(self, detail: str) -> None:
        super().__init__(f"the command was not acknowledged by Kafka: {detail}")


class BackendUnavailable(ApiError):
    """PostgreSQL or Redis could not be reached; retry later."""

    category = Category.UNAVAILABLE
    reason = "BACKEND_UNAVAILABLE"
    retry_after_s = 1.0

    def __init__(self, backend: str, detail: str) -> None:
        super().__init__(f"{backend} unavailable: {detail}", backend=backend)


class StreamResumeRequired(ApiError):
    """The live stream could not be continued without a gap for now (a seq seen live is not in the read
    model yet); resume from `next_seq` after `retry_after_s`. A permanent hole is StreamHole."""

    category = Category.UNAVAILABLE
    reason = "STREAM_RESUME_REQUIRED"
    retry_after_s = 0.5

    def __init__(self, run_id: str, next_seq: int) -> None:
        super().__init__(
            f"event stream of run {run_id!r} must be resumed from seq {next_seq}", run_id=run_id, next_seq=next_seq
        )


class StreamHole(ApiError):
    """The read model never stored `next_seq` of the run and never will (the projector moved past it):
    no wait fills it, so it is not retryable at next_seq. Either it holds a later event of the run,
    at `next_stored_seq`, or the hole runs to the end of a finished run's log (`next_stored_seq` is
    then its last_seq + 1, where nothing is stored). Either way the client resumes at
    `next_stored_seq` (or investigates with `tether audit verify`); the callers do not tell this
    class which case it is, so its message is true of both."""

    category = Category.DATA_LOSS
    reason = "STREAM_HOLE"

    def __init__(self, run_id: str, next_seq: int, next_stored_seq: int) -> None:
        last_missing = next_stored_seq - 1
        super().__init__(
            f"the read model of run {run_id!r} is missing seq {next_seq}"
            + (f" through {last_missing}" if last_missing > next_seq else "")
            + f" and nothing will fill it; resume at seq {next_stored_seq}: the next stored event, or the end "
            f"of the run's log if its last seq is {last_missing}",
            run_id=run_id,
            next_seq=next_seq,
            next_stored_seq=next_stored_seq,
        )


class TooManyStreams(ApiError):
    """Every event-stream slot of this server is taken; retry shortly (or against another replica)."""

    category = Category.RESOURCE_EXHAUSTED
    reason = "TOO_MANY_STREAMS"
    retry_after_s = 1.0

    def __init__(self, limit: int) -> None:
        super().__init__(f"this server already serves {limit} event streams", limit=limit)


class TenantTooManyStreams(ApiError):
    """The tenant already holds its share of this server's event-stream slots; other tenants still get
    theirs. Retry shortly, or close a stream (a watch of a run that will not end soon)."""

    category = Category.RESOURCE_EXHAUSTED
    reason = "TENANT_TOO_MANY_STREAMS"
    retry_after_s = 1.0

    def __init__(self, tenant_id: str, limit: int) -> None:
        super().__init__(f"tenant {tenant_id} already has {limit} event streams open on this server",
                         tenant_id=tenant_id, limit=limit)


class TenantQueueFull(ApiError):
    """The tenant already has as many runs in the system (running and queued) as its limits allow;
    retry after `retry_after_s`, when some have finished."""

    category = Category.RESOURCE_EXHAUSTED
    reason = "TENANT_QUEUE_FULL"

    def __init__(self, tenant_id: str, backlog: int, capacity: int, retry_after_s: float) -> None:
        super().__init__(
            f"tenant {tenant_id} has {backlog} runs queued or running, its limit is {capacity}; "
            f"retry in {retry_after_s:g}s",
            tenant_id=tenant_id,
            backlog=backlog,
            limit=capacity,
        )
        self.retry_after_s = retry_after_s
