"""Named errors → google.rpc.Status with ErrorInfo (domain tether.dev), BadRequest and RetryInfo details."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from tether_run_api.domain.errors import DOMAIN, ApiError, InvalidArgument


def rich_status(err: ApiError) -> grpc.Status:
    """The gRPC status (code, message, details in grpc-status-details-bin) for a refusal."""
    details = []
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata)
    details.append(info)
    if isinstance(err, InvalidArgument):
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                    for v in err.violations
                ]
            )
        )
    if err.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(max(1, round(err.retry_after_s * 1000)))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    code = getattr(code_pb2, err.category.value)
    return rpc_status.to_status(status_pb2.Status(code=code, message=err.message, details=packed))


def internal_status() -> grpc.Status:
    """A bug or an unexpected failure: no detail leaks to the client (the log has it)."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="INTERNAL", domain=DOMAIN))
    return rpc_status.to_status(
        status_pb2.Status(code=code_pb2.INTERNAL, message="internal error", details=[info])
    )


def error_info(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo | None, list]:
    """Client side: the ErrorInfo and all details of a failed call (None, [] if it carried none)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return None, []
    found = None
    unpacked = []
    for d in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if d.Is(cls.DESCRIPTOR):
                msg = cls()
                d.Unpack(msg)
                unpacked.append(msg)
                if cls is error_details_pb2.ErrorInfo:
                    found = msg
    return found, unpacked
