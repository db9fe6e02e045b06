"""A thin gRPC client for the CLI: channel, stubs with the API key attached, readable errors."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tether_api.v1 import (
    agent_service_pb2_grpc,
    approval_service_pb2_grpc,
    run_service_pb2_grpc,
    tool_service_pb2_grpc,
)
from tether_run_api.api.status import error_info


class CliSettings(BaseSettings):
    """Where the CLI connects and with which key (TETHER_ADDR, TETHER_API_KEY; flags override)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_", extra="ignore")

    addr: str = Field("127.0.0.1:50051", description="run-api address host:port")
    api_key: str = Field("", description="API key (tk_...)")
    approver_key: str = Field("", description="API key used by `approvals approve|reject` when set")


class CliError(Exception):
    """A failure to show the user (message) with the process exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Client:
    """Stubs of the four services over one channel; every call carries the API key."""

    channel: grpc.Channel
    api_key: str
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self.agents = agent_service_pb2_grpc.AgentServiceStub(self.channel)
        self.tools = tool_service_pb2_grpc.ToolServiceStub(self.channel)
        self.runs = run_service_pb2_grpc.RunServiceStub(self.channel)
        self.approvals = approval_service_pb2_grpc.ApprovalServiceStub(self.channel)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        if not self.api_key:
            raise CliError("no API key: set TETHER_API_KEY or pass --api-key (see `tether admin bootstrap-demo`)")
        return [("authorization", f"Bearer {self.api_key}")]

    def call(self, method, request):
        """A unary call with the key and the default deadline; errors become CliError."""
        try:
            return method(request, metadata=self.metadata, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise CliError(describe(err)) from None

    def close(self) -> None:
        self.channel.close()


def connect(addr: str, api_key: str) -> Client:
    """A client on an insecure channel (run-api listens on loopback; put TLS in front when deployed)."""
    return Client(grpc.insecure_channel(addr), api_key)


def describe(err: grpc.RpcError) -> str:
    """One readable paragraph: code, reason, message, field violations, retry hint."""
    code = err.code().name if err.code() else "UNKNOWN"
    info, details = error_info(err)
    head = f"{code}" + (f" {info.reason}" if info else "") + f": {err.details()}"
    lines = [head]
    for d in details:
        if isinstance(d, error_details_pb2.BadRequest):
            lines += [f"  {v.field}: {v.description}" for v in d.field_violations]
        elif isinstance(d, error_details_pb2.RetryInfo):
            lines.append(f"  retry after {d.retry_delay.ToMilliseconds()} ms")
    if code == "UNAVAILABLE" and info is None:
        lines.append("  is run-api running? (TETHER_ADDR / --addr)")
    return "\n".join(lines)


def reason(err: grpc.RpcError) -> str:
    """The ErrorInfo reason of a failed call, or ''."""
    info, _ = error_info(err)
    return info.reason if info else ""
