"""Shared gRPC plumbing for every Sluice server: health, reflection and error mapping.

`start_server` builds a grpc.aio server bound on the given address with
- `grpc.health.v1` (overall "" and per-service status, NOT_SERVING until `set_serving(True)`),
- server reflection for the listed services,
- an interceptor that turns `SluiceError` into its status code (plus a `retry-after` trailer when
  the error carries one) and any other exception into INTERNAL with a generic message, so a
  user's mistake is never UNKNOWN and a bug never leaks a traceback to the caller,
- and, when tracing is switched on (services/common/tracing/), its interceptor.
Servicers stay thin: they convert protobuf to domain objects, call the domain and raise
SluiceError subclasses.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.common import tracing
from services.common.errors import SluiceError

log = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after"
LIVENESS_SERVICE = "sluice.liveness"  # health name that is SERVING while the process answers
# Messages up to 64 MiB: a batched engine step for many sequences can be large.
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)


def status_code(error: SluiceError) -> grpc.StatusCode:
    """The grpc.StatusCode member named by the error's `code`."""
    return getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)


def error_trailers(error: SluiceError) -> tuple[tuple[str, str], ...]:
    if error.retry_after_s is None:
        return ()
    return ((RETRY_AFTER_KEY, f"{max(error.retry_after_s, 0.0):.3f}"),)


async def abort_with(context: grpc.aio.ServicerContext, error: SluiceError) -> None:
    """Abort the RPC with the error's status, message and retry hint (raises)."""
    await context.abort(status_code(error), error.message, trailing_metadata=error_trailers(error))


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a handler to status codes (see module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """A handler that returns its answer, or (streaming) writes with `context.write`."""

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            await _abort_for(exc, context, method)

    return wrapped


def _wrap_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """A handler that streams its answers: an async generator, or one that writes them."""
    if not inspect.isasyncgenfunction(behavior):
        return _wrap_unary(behavior, method)

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for response in behavior(request, context):
                yield response
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            await _abort_for(exc, context, method)

    return wrapped


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, SluiceError):
        await abort_with(context, exc)
    if _is_abort(exc):
        raise exc  # context.abort() already set the status
    log.exception("internal error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}")


def _is_abort(exc: BaseException) -> bool:
    # grpc.aio signals context.abort() with cygrpc.AbortError; re-raise it untouched.
    return isinstance(exc, cygrpc.AbortError)


@dataclass
class RunningServer:
    """A started server, its bound port and its health state."""

    server: grpc.aio.Server
    port: int
    health: HealthServicer
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = DEFAULT_OPTIONS,
) -> RunningServer:
    """Start a grpc.aio server on `address` ("host:port"; port 0 picks a free one).

    `register(server)` adds the servicers; `service_names` are their full names (e.g.
    "sluice.v1.Router") for health and reflection. The server starts NOT_SERVING.
    """
    server = grpc.aio.server(
        interceptors=[*interceptors, *tracing.server_interceptors(), ErrorMappingInterceptor()],
        options=list(options),
    )
    register(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            *service_names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    await server.start()
    running = RunningServer(server, port, health, tuple(service_names))
    await running.set_serving(False)
    # Liveness, apart from readiness: SERVING while the process answers, whatever its peers do
    # (a router without engines is alive, only not ready). Kubernetes' liveness probes ask it.
    await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    log.info("gRPC server listening on port %d (%s)", port, ", ".join(service_names))
    return running
