"""One Generate call from admission to its last response, shared by every front of the router.

The gRPC servicer (server.py) and the OpenAI-compatible HTTP front (openai_http/) both call
`generate` and `list_models`, so API keys, rate limits, idempotency, the deadline, metrics and
the release of every resource (queue entry, engine sequence, detokenizer state) are one code
path, whichever protocol the client speaks. Closing the iterator early (the client went away)
releases the request at once (the inner iterators are closed, not left to the garbage
collector), which aborts it on its engine and frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable

from protos.sluice.v1 import router_pb2
from services.common.errors import DeadlineExceededError, SluiceError
from services.router import metrics
from services.router.adapter_admin import adapter_infos
from services.router.convert import response_pb
from services.router.core import RouterCore
from services.router.idempotency import ClaimKind, payload_hash, scoped_id

Metadata = Iterable[tuple[str, str | bytes]] | None
TimeRemaining = Callable[[], float | None]


async def generate(
    core: RouterCore,
    request: router_pb2.GenerateRequest,
    metadata: Metadata,
    time_remaining: TimeRemaining,
) -> AsyncIterator[router_pb2.GenerateResponse]:
    """The responses of one request; raises the SluiceError that ends it.

    `time_remaining()` gives the caller's seconds left (None: no deadline). With a request id and
    an idempotency cache, a repeat of the same payload replays the recorded (or in-flight)
    stream instead of generating twice; another payload under that id is ALREADY_EXISTS.
    """
    cache = core.idempotency
    if cache is None or not request.request_id:
        async with contextlib.aclosing(_generate(core, request, metadata, time_remaining)) as run:
            async for response in run:
                yield response
        return
    caller = core.auth.check(metadata)
    scoped = scoped_id(getattr(caller, "key_id", ""), request.request_id)
    payload = router_pb2.GenerateRequest()
    payload.CopyFrom(request)
    payload.request_id = ""
    claim = await cache.claim(scoped, payload_hash(payload.SerializeToString(deterministic=True)))
    if claim.kind is not ClaimKind.NEW:
        async for raw in cache.replay(scoped, timeout_s=time_remaining()):
            yield router_pb2.GenerateResponse.FromString(raw)
        return
    finished = False
    try:
        async with contextlib.aclosing(_generate(core, request, metadata, time_remaining)) as run:
            async for response in run:
                await cache.append(scoped, response.SerializeToString())
                yield response
        finished = True
    finally:
        with contextlib.suppress(Exception):
            if finished:
                await cache.complete(scoped)
            else:
                await cache.abandon(scoped)


async def _generate(
    core: RouterCore,
    request: router_pb2.GenerateRequest,
    metadata: Metadata,
    time_remaining: TimeRemaining,
) -> AsyncIterator[router_pb2.GenerateResponse]:
    routed = await core.admit(request, metadata, time_remaining())
    client_id = request.request_id or routed.request_id
    status = "CANCELLED"
    last_token_at: float | None = None
    try:
        while True:
            try:
                piece = await routed.next_piece(
                    None if routed.deadline is None else routed.remaining()
                )
            except TimeoutError:
                status = "DEADLINE_EXCEEDED"
                raise DeadlineExceededError("the deadline passed while generating") from None
            if piece is None:
                status = "OK"
                return
            if piece.token_ids:
                now = time.monotonic()
                if last_token_at is None:
                    metrics.ROUTER_TIME_TO_FIRST_TOKEN.observe(now - routed.arrival)
                else:
                    metrics.ROUTER_INTER_TOKEN_LATENCY.observe(
                        (now - last_token_at) / len(piece.token_ids)
                    )
                last_token_at = now
            yield response_pb(piece, client_id)
            if piece.finish_reason:
                status = "OK"
                metrics.ROUTER_END_TO_END_LATENCY.observe(time.monotonic() - routed.arrival)
                return
    except SluiceError as error:
        status = error.code
        raise
    finally:
        core.release(routed)
        metrics.ROUTER_FINISHED_REQUESTS.labels(status=status).inc()


def list_models(core: RouterCore, metadata: Metadata) -> router_pb2.ListModelsResponse:
    """The served model (context = the smallest engine's) with its known adapters; checks the
    caller's API key first. Empty while no engine is ready."""
    core.auth.check(metadata)
    response = router_pb2.ListModelsResponse()
    connections = core.pool.ready_connections()
    if not connections:
        return response
    info = connections[0].info
    model = response.models.add(
        name=info.model,
        context_length=min(c.info.max_model_len for c in connections),
        vocab_size=info.vocab_size,
    )
    model.adapters.extend(adapter_infos(core))
    return response
