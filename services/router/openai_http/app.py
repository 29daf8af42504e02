"""The HTTP routes of the OpenAI-compatible front and the server that runs them.

`HttpFront(core).start(host, port)` serves, on the router's own event loop:
- `POST /v1/completions`, `POST /v1/chat/completions`: `stream: true` answers with server-sent
  events ending in `data: [DONE]`; an error after the stream began is one `data: {"error": ...}`
  event before it;
- `GET /v1/models`: the served model and each registered LoRA adapter, as models (an adapter's
  `parent` is the served model and its `root` its path, as vLLM lists them); a body's `model`
  is the served model's name or `base` (no adapter) or an adapter's name (that adapter),
  anything else 404;
- `GET /health` (200 while the router serves, else 503) and `GET /metrics` (Prometheus).
Credentials come as `Authorization: Bearer <key>` (or `x-api-key`); `Idempotency-Key` is the
request id of the gRPC path; `Sluice-Timeout-S` sets the request's deadline in seconds (the
gRPC deadline's counterpart; past it -> 504). A client that disconnects cancels its request
(the handler is cancelled, which releases it: its engine frees its KV blocks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from multidict import CIMultiDictProxy
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from protos.sluice.v1 import router_pb2
from services.common.errors import SluiceError, UnavailableError
from services.router import generation
from services.router.adapter_admin import BASE_MODEL_ALIAS
from services.router.core import RouterCore
from services.router.openai_http.errors import (
    ModelNotFoundError,
    RequestError,
    error_body,
    error_response,
)
from services.router.openai_http.requests import OpenAIRequest, parse_chat, parse_completion
from services.router.openai_http.responses import ResponseBuilder, dumps

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024  # a 128k-token prompt is well under 1 MiB of text
TIMEOUT_HEADER = "Sluice-Timeout-S"
IDEMPOTENCY_HEADER = "Idempotency-Key"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"


class HttpFront:
    """The OpenAI-compatible HTTP server over one RouterCore (module docstring)."""

    def __init__(self, core: RouterCore, *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.core = core
        self.port: int | None = None
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=[_json_errors])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self._runner: web.AppRunner | None = None
        self._base_model: str | None = None
        self._created = int(time.time())

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port); returns the port."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- routes ------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        try:
            listed = generation.list_models(self.core, _credentials(request.headers))
        except SluiceError as error:
            return error_response(error)
        data = []
        for model in listed.models:
            data.append(self._model_card(model.name, model.name, None, model.context_length))
            for adapter in model.adapters:
                data.append(
                    self._model_card(adapter.name, adapter.path, model.name, model.context_length)
                )
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        if self.core.serving:
            return _json({"status": "ok"})
        return error_response(UnavailableError("the router is not serving (starting or draining)"))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    # ---- generation --------------------------------------------------------------------------
    async def _generate(
        self, request: web.Request, parse: Callable[[object], OpenAIRequest]
    ) -> web.StreamResponse:
        metadata = _credentials(request.headers)
        try:
            self.core.auth.check(metadata)  # before anything else is read or revealed
            parsed = parse(await _read_json(request))
            parsed.generate.adapter = await self._adapter_for(parsed.model)
            parsed.generate.request_id = request.headers.get(IDEMPOTENCY_HEADER, "")
            time_remaining = _time_remaining(request.headers)
        except SluiceError as error:
            return error_response(error)
        responses = generation.generate(self.core, parsed.generate, metadata, time_remaining)
        async with contextlib.aclosing(responses):
            try:
                first = await anext(responses)  # admission: its refusal is still an HTTP status
            except SluiceError as error:
                return error_response(error)
            builder = ResponseBuilder(parsed, first.request_id)
            if parsed.stream:
                return await _stream(request, builder, first, responses)
            collected = [first]
            try:
                async for response in responses:
                    collected.append(response)
            except SluiceError as error:
                return error_response(error)
            return _json(builder.whole(collected))

    async def _adapter_for(self, model: str) -> str:
        """The adapter a body's `model` names ("" for the served model or `base`); 404 when it
        is none of them. Looked up like the gRPC path's `adapter` (the registry's view, else its
        store), so both fronts know the same adapters."""
        connections = self.core.pool.ready_connections()
        if connections:
            self._base_model = connections[0].info.model
        if model in (BASE_MODEL_ALIAS, self._base_model):
            return ""
        if await self.core.adapters.lookup(model) is not None:
            return model
        if self._base_model is None:
            raise UnavailableError("no engine is ready")
        raise ModelNotFoundError(model)

    def _model_card(self, name: str, root: str, parent: str | None, max_model_len: int) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "sluice",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
        }


async def _stream(
    request: web.Request,
    builder: ResponseBuilder,
    first: router_pb2.GenerateResponse,
    responses: AsyncIterator[router_pb2.GenerateResponse],
) -> web.StreamResponse:
    stream = web.StreamResponse(headers=SSE_HEADERS)
    await stream.prepare(request)
    last = first
    with contextlib.suppress(ConnectionError):  # the client left: closing the iterator cancels
        try:
            head = _event(builder.role_chunk()) if builder.chat else b""
            await stream.write(head + _event(builder.chunk(first)))
            async for response in responses:
                last = response
                await stream.write(_event(builder.chunk(response)))
            if builder.request.include_usage:
                await stream.write(_event(builder.usage_chunk(last)))
        except SluiceError as error:
            await stream.write(_event(error_body(error)))
        await stream.write(DONE)
        await stream.write_eof()
    return stream


def _event(body: dict) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=dumps(body), status=status, content_type="application/json")


def _credentials(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The headers the router's authenticators read, as gRPC-style metadata."""
    return [(name, headers[name]) for name in ("authorization", "x-api-key") if name in headers]


async def _read_json(request: web.Request) -> object:
    raw = await request.read()  # over the body limit: 413 (the middleware answers it)
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        raise RequestError(f"the body is not valid JSON: {error}") from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _time_remaining(headers: CIMultiDictProxy[str]) -> Callable[[], float | None]:
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return lambda: None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise RequestError(f"{TIMEOUT_HEADER} must be a number of seconds > 0, got {raw!r:.40}")
    deadline = time.monotonic() + seconds
    return lambda: deadline - time.monotonic()


@web.middleware
async def _json_errors(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Unknown paths, wrong methods, bodies over the limit and bugs answer in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(RequestError(exc.reason, http_status=exc.status))
    except SluiceError as error:
        return error_response(error)
    except Exception:
        log.exception("OpenAI front: %s %s failed", request.method, request.path)
        return error_response(SluiceError("internal error"))
