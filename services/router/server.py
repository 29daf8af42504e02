"""The public Router gRPC service: a thin servicer over `RouterCore`, and the process entry.

`python -m services.router.server --port 50051 --engines 127.0.0.1:50061 --tokenizer
127.0.0.1:50052` (or `sluice serve router ...`). Health is NOT_SERVING until a tokenizer and an
engine are connected. SIGTERM (or SIGINT) drains: new calls get UNAVAILABLE, in-flight requests
get up to `--shutdown-grace-s` seconds to finish, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from protos.sluice.v1 import router_pb2, router_pb2_grpc
from services.common import event_loop, tracing
from services.common.config import describe
from services.common.errors import SluiceError
from services.common.grpc_server import RunningServer, start_server
from services.common.heap import freeze_startup_heap
from services.common.metrics import start_metrics_server
from services.router import adapter_admin, generation
from services.router.config import RouterConfig, RouterSettings
from services.router.core import RouterCore
from services.router.openai_http.app import HttpFront
from services.router.shared_state import SHARED_STATE_HEALTH, SharedState

log = logging.getLogger("services.router")

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Converts protobuf to the core's calls and streams the request's own channel back."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        # The response headers go out now, while the prompt is tokenized, instead of with the
        # first token: a gRPC client reads a stream's first message only after its headers, a
        # wake-up of its own, which is then off the first token's path.
        headers: asyncio.Future | None = asyncio.ensure_future(_send_headers(context))
        try:
            async for response in self._responses(request, context):
                if headers is not None:  # done long before; a second send would be refused
                    await headers
                    headers = None
                yield response
        finally:
            if headers is not None:  # an error's status must not race the headers either
                await headers

    async def _responses(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        metadata = context.invocation_metadata()
        async for response in generation.generate(
            self.core, request, metadata, context.time_remaining
        ):
            yield response

    async def ListModels(  # noqa: N802 - gRPC method name
        self, request: router_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        return generation.list_models(self.core, context.invocation_metadata())

    async def AddAdapter(  # noqa: N802 - gRPC method name
        self, request: router_pb2.AddAdapterRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.AdapterInfo:
        return await adapter_admin.add_adapter(self.core, request, context.invocation_metadata())

    async def ListAdapters(  # noqa: N802 - gRPC method name
        self, request: router_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListAdaptersResponse:
        return adapter_admin.list_adapters(self.core, context.invocation_metadata())

    async def RemoveAdapter(  # noqa: N802 - gRPC method name
        self, request: router_pb2.RemoveAdapterRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.AdapterInfo:
        return await adapter_admin.remove_adapter(self.core, request, context.invocation_metadata())


async def _send_headers(context: grpc.aio.ServicerContext) -> None:
    with contextlib.suppress(Exception):  # the call ended first: nothing left to tell
        await context.send_initial_metadata(())


async def start(
    config: RouterConfig, *, shared: SharedState | None = None, **core_options: Any
) -> tuple[RouterCore, RunningServer]:
    """Start the core and the gRPC server (health follows the core's readiness).

    `core_options` go to `RouterCore` (discovery=, policy=, authenticator=, ...). With `shared`
    (Redis-backed state) the registry, API keys, rate limits and idempotency come from it, and
    the health service `sluice.v1.Router.SharedState` is NOT_SERVING while Redis is unreachable
    (the overall status only follows readiness: the router keeps serving from its last view).
    """
    if shared is not None:
        core_options.setdefault("discovery", shared.discovery)
        core_options.setdefault("authenticator", shared.authenticator)
        core_options.setdefault("rate_limiter", shared.rate_limiter)
        core_options.setdefault("idempotency", shared.idempotency)
        core_options.setdefault("adapters", shared.adapters)
    core = RouterCore(config, **core_options)
    servicer = RouterServicer(core)
    server = await start_server(
        config.address,
        lambda s: router_pb2_grpc.add_RouterServicer_to_server(servicer, s),
        [SERVICE_NAME],
    )
    loop = asyncio.get_running_loop()
    pending_health: set[asyncio.Task] = set()

    def on_degraded(degraded: bool) -> None:
        log.log(
            logging.WARNING if degraded else logging.INFO,
            "shared state (Redis) %s",
            "unreachable: serving from the last view with local limits" if degraded else "ok",
        )
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if degraded
            else health_pb2.HealthCheckResponse.SERVING
        )
        task = loop.create_task(server.health.set(SHARED_STATE_HEALTH, status))
        pending_health.add(task)
        task.add_done_callback(pending_health.discard)

    if shared is not None:
        shared.follow_registry(core.pool.refresh)
        shared.on_degraded(on_degraded)
        on_degraded(shared.degraded)

    def on_readiness(serving: bool) -> None:
        task = loop.create_task(server.set_serving(serving))
        pending_health.add(task)
        task.add_done_callback(pending_health.discard)

    core.on_readiness = on_readiness
    await core.start()
    return core, server


async def shutdown(
    core: RouterCore, server: RunningServer, grace_s: float, *, front: HttpFront | None = None
) -> bool:
    """Drain (stop admitting, let in-flight requests finish within `grace_s`), then stop."""
    drained = await core.drain(grace_s)
    if not drained:
        log.warning("grace period over with %d requests still in flight", len(core.active))
    if front is not None:
        await front.stop()
    await server.stop(0.5)
    await core.close()
    return drained


async def serve(settings: RouterSettings, *, stop: asyncio.Event | None = None) -> int:
    """Run the router until SIGTERM/SIGINT (or `stop` is set), drain, and return 0."""
    config = settings.router
    sys.setswitchinterval(event_loop.GIL_SWITCH_INTERVAL_S)
    start_metrics_server(config.metrics_port)
    tracing.configure(settings.tracing, "sluice-router")
    shared = await SharedState.open(settings)
    core, server = await start(config, shared=shared)
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    print(f"router listening on {config.host}:{server.port}", flush=True)
    front = None
    if config.http_port:
        front = HttpFront(core)
        await front.start(config.host, config.http_port)
        print(f"router OpenAI-compatible HTTP on http://{config.host}:{front.port}/v1", flush=True)
    await stop.wait()
    log.info("shutting down")
    await shutdown(core, server, config.shutdown_grace_s, front=front)
    await shared.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = RouterSettings.from_argv(argv)
        config = settings.router
    except SluiceError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log.info("%s", describe(config))
    freeze_startup_heap()  # the imports: never walked by a collection again
    try:
        return event_loop.run(serve(settings))
    except (OSError, SluiceError) as error:
        print(f"error: cannot run the router: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
