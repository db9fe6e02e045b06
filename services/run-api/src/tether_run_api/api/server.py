"""The gRPC server: the four tether.v1 services, health checking and reflection, message size limits."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether_api.v1 import (
    agent_service_pb2,
    agent_service_pb2_grpc,
    approval_service_pb2,
    approval_service_pb2_grpc,
    run_service_pb2,
    run_service_pb2_grpc,
    tool_service_pb2,
    tool_service_pb2_grpc,
)
from tether_run_api.api.servicers import (
    AgentService,
    ApprovalService,
    Gate,
    RunService,
    Services,
    ToolService,
    UndecodableRequest,
)

SERVICE_NAMES = (
    agent_service_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    tool_service_pb2.DESCRIPTOR.services_by_name["ToolService"].full_name,
    run_service_pb2.DESCRIPTOR.services_by_name["RunService"].full_name,
    approval_service_pb2.DESCRIPTOR.services_by_name["ApprovalService"].full_name,
)


class DecodeGuard(grpc.ServerInterceptor):
    """Bytes that are not the method's request message reach the servicer as an UndecodableRequest,
    which it refuses as INVALID_ARGUMENT / MALFORMED_REQUEST; gRPC alone would answer a bare
    INTERNAL ("Exception deserializing request!") without a machine-readable reason."""

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.request_streaming or handler.request_deserializer is None \
                or not method.startswith("/tether.v1."):
            return handler
        decode = handler.request_deserializer

        def guarded(data: bytes) -> object:
            try:
                return decode(data)
            except Exception:  # protobuf's DecodeError, or any other parse failure of untrusted bytes
                return UndecodableRequest(method, len(data))

        return handler._replace(request_deserializer=guarded)


@dataclass
class RunningServer:
    """A started server, the port it is bound to, and its health servicer (to report NOT_SERVING at shutdown)."""

    server: grpc.Server
    port: int
    health: health.HealthServicer

    def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, then let in-flight calls finish for up to grace_s."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


def start_server(
    services: Services,
    *,
    host: str = "127.0.0.1",
    port: int = 50051,
    workers: int = 64,
    max_receive_message_bytes: int = 4 * 1024 * 1024,
    max_send_message_bytes: int = 16 * 1024 * 1024,
) -> RunningServer:
    """Build, bind and start the server; port 0 binds an ephemeral port (see RunningServer.port)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc"),
        interceptors=[DecodeGuard()],
        options=[
            ("grpc.max_receive_message_length", max_receive_message_bytes),
            ("grpc.max_send_message_length", max_send_message_bytes),
            # Long-lived event streams: keep idle connections alive through proxies.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    gate = Gate(services, max_response_bytes=max_send_message_bytes)
    agent_service_pb2_grpc.add_AgentServiceServicer_to_server(AgentService(gate), server)
    tool_service_pb2_grpc.add_ToolServiceServicer_to_server(ToolService(gate), server)
    run_service_pb2_grpc.add_RunServiceServicer_to_server(RunService(gate), server)
    approval_service_pb2_grpc.add_ApprovalServiceServicer_to_server(ApprovalService(gate), server)

    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC on {host}:{port}")
    server.start()
    for name in ("", *SERVICE_NAMES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, port=bound, health=health_servicer)
