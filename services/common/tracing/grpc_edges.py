"""Tracing at the gRPC edges: one server interceptor and its client-side counterpart.

Imported only when tracing is on. Two kinds of span:

- Call spans (tracer `calls`): a SERVER span around each call of a Sluice method that is not a
  session stream (Router Generate, Info, Tokenize, ...), whose parent is the W3C trace context
  the client sent in the call's metadata; the client side (`TracedChannel`) opens the CLIENT
  span and injects that context. A streamed answer adds the event `first_token` (the first
  response carrying token ids) and, from the response, the `sluice.request_id`.
- Hop spans (tracer `hops`, only with a trace directory): the session streams (EngineSession,
  TokenizeSession, DetokenizeSession) carry one message per engine step for many requests, so a
  span per call would last as long as the router. Instead both ends record, per message, a
  zero-length span named `<MessageType> sent|received` when it carries a request's first-token
  hop: a submit and the step with that request's first update (EngineSession), a detokenize
  message with a request's first tokens (the update that opens its state) and its answer, and
  every tokenize batch. The attributes (`_HOP_ATTRIBUTES`, one extractor per message type) name
  the requests (`sluice.request_ids`), the batch's `sluice.sequence_number` and the engine's
  `sluice.step_index`.

The OpenTelemetry gRPC instrumentation was not used: its aio interceptors make one span per
call, which for these sessions is one span per router lifetime, and its client interceptor
routes every `write` of a stream through an extra queue and task, which would change the very
latencies being measured. This one wraps the call object instead (a function call per message).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.common.tracing.runtime import Runtime

SLUICE_METHODS = "/sluice.v1."
REQUEST_IDS = "sluice.request_ids"
SEQUENCE_NUMBER = "sluice.sequence_number"
STEP_INDEX = "sluice.step_index"
FIRST_TOKEN_EVENT = "first_token"
CALL_REQUEST_ID = "sluice.request_id"


class _StreamState:
    """What one end of a session stream remembers between its messages."""

    __slots__ = ("awaiting_first", "first_by_sequence")

    def __init__(self) -> None:
        self.awaiting_first: set[str] = set()  # submitted, no update seen yet
        self.first_by_sequence: dict[int, list[str]] = {}  # detokenize: first updates by number


def _engine_request(message: Any, state: _StreamState) -> dict[str, Any] | None:
    if message.aborts:
        state.awaiting_first.difference_update(message.aborts)
    if not message.submits:
        return None
    ids = [submit.request_id for submit in message.submits]
    state.awaiting_first.update(ids)
    return {REQUEST_IDS: ids}


def _engine_step(message: Any, state: _StreamState) -> dict[str, Any] | None:
    awaiting = state.awaiting_first
    if not awaiting:
        return None
    ids = [update.request_id for update in message.updates if update.request_id in awaiting]
    if not ids:
        return None
    awaiting.difference_update(ids)
    return {REQUEST_IDS: ids, STEP_INDEX: message.step_index}


def _detokenize_request(message: Any, state: _StreamState) -> dict[str, Any] | None:
    # A request's first update carries its decode options (they open its state).
    ids = [update.request_id for update in message.updates if update.HasField("options")]
    if not ids:
        return None
    state.first_by_sequence[message.sequence_number] = ids
    return {REQUEST_IDS: ids, SEQUENCE_NUMBER: message.sequence_number}


def _detokenize_response(message: Any, state: _StreamState) -> dict[str, Any] | None:
    ids = state.first_by_sequence.pop(message.sequence_number, None)
    if ids is None:
        return None
    return {REQUEST_IDS: ids, SEQUENCE_NUMBER: message.sequence_number}


def _tokenize_batch(message: Any, state: _StreamState) -> dict[str, Any] | None:
    return {SEQUENCE_NUMBER: message.sequence_number}


# Message type -> the attributes of its hop span, or None when it carries no first-token hop.
_HOP_ATTRIBUTES: dict[str, Callable[[Any, _StreamState], dict[str, Any] | None]] = {
    "EngineRequest": _engine_request,
    "EngineStep": _engine_step,
    "DetokenizeRequest": _detokenize_request,
    "DetokenizeResponse": _detokenize_response,
    "TokenizeRequest": _tokenize_batch,
    "TokenizeResponse": _tokenize_batch,
}


class _Hops:
    """Records the hop spans of one end of one session stream."""

    __slots__ = ("_tracer", "_method", "_state")

    def __init__(self, tracer: trace.Tracer, method: str) -> None:
        self._tracer = tracer
        self._method = method
        self._state = _StreamState()

    def record(self, message: Any, direction: str) -> None:
        name = type(message).__name__
        extract = _HOP_ATTRIBUTES.get(name)
        if extract is None:
            return
        attributes = extract(message, self._state)
        if attributes is None:
            return
        attributes["rpc.method"] = self._method
        now = time.time_ns()
        span = self._tracer.start_span(f"{name} {direction}", start_time=now, attributes=attributes)
        span.end(end_time=now)

    async def received(self, messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in messages:
            self.record(message, "received")
            yield message

    async def sent(self, messages: Any) -> AsyncIterator[Any]:
        if hasattr(messages, "__aiter__"):
            async for message in messages:
                self.record(message, "sent")
                yield message
        else:
            for message in messages:
                self.record(message, "sent")
                yield message


def _call_attributes(method: str, request: Any) -> dict[str, Any]:
    service, _, name = method.lstrip("/").partition("/")
    attributes: dict[str, Any] = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
    if type(request).__name__ == "GenerateRequest":
        attributes["sluice.input"] = request.WhichOneof("input") or ""
    return attributes


def _note_response(span: trace.Span, response: Any) -> bool:
    """Add the first-token event when `response` carries tokens; True once it did."""
    if not getattr(response, "token_ids", None):
        return False
    span.add_event(FIRST_TOKEN_EVENT)
    request_id = getattr(response, "request_id", "")
    if request_id:
        span.set_attribute(CALL_REQUEST_ID, request_id)
    return True


def _fail(span: trace.Span, exc: BaseException) -> None:
    if not isinstance(exc, GeneratorExit):  # the reader stopped early: not a failure
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


class _WritingContext:
    """A servicer context whose `write` records the message's hop first."""

    def __init__(self, context: grpc.aio.ServicerContext, hops: _Hops) -> None:
        self._context = context
        self._hops = hops

    async def write(self, message: Any) -> None:
        self._hops.record(message, "sent")
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Call spans and hop spans on the server side (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SLUICE_METHODS):
            return handler  # health checks and reflection are not traced
        codecs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.stream_stream:
            if self._runtime.hops is None:
                return handler
            behavior = self._session(handler.stream_stream, method)
            return grpc.stream_stream_rpc_method_handler(behavior, **codecs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._call(handler.unary_stream, method), **codecs
            )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._call(handler.unary_unary, method), **codecs
            )
        return handler

    def _start(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> trace.Span:
        runtime = self._runtime
        carrier = dict(context.invocation_metadata() or ())
        parent = runtime.propagator.extract(carrier, getter=runtime.getter)
        return runtime.calls.start_span(
            method.lstrip("/"),
            context=parent,
            kind=SpanKind.SERVER,
            attributes=_call_attributes(method, request),
        )

    def _call(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def streamed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                span = self._start(method, request, context)
                if not span.is_recording():
                    async for response in behavior(request, context):
                        yield response
                    return
                first = True
                try:
                    async for response in behavior(request, context):
                        if first and _note_response(span, response):
                            first = False
                        yield response
                except BaseException as exc:
                    _fail(span, exc)
                    raise
                finally:
                    span.end()

            return streamed

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = self._start(method, request, context)
            try:
                return await behavior(request, context)
            except BaseException as exc:
                _fail(span, exc)
                raise
            finally:
                span.end()

        return answered

    def _session(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        tracer = self._runtime.hops
        if inspect.isasyncgenfunction(behavior):

            async def yielding(requests: AsyncIterator[Any], context: Any) -> Any:
                hops = _Hops(tracer, method)
                async for response in behavior(hops.received(requests), context):
                    hops.record(response, "sent")
                    yield response

            return yielding

        async def writing(requests: AsyncIterator[Any], context: Any) -> Any:
            hops = _Hops(tracer, method)
            return await behavior(hops.received(requests), _WritingContext(context, hops))

        return writing


class _TracedSessionCall:
    """A client's session stream call whose writes and reads record their hops."""

    def __init__(self, call: Any, hops: _Hops) -> None:
        self._call = call
        self._hops = hops

    async def write(self, message: Any) -> None:
        self._hops.record(message, "sent")
        await self._call.write(message)

    async def read(self) -> Any:
        message = await self._call.read()
        if message is not grpc.aio.EOF:
            self._hops.record(message, "received")
        return message

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._hops.received(self._call)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _TracedSession:
    """A stream-stream method of a traced channel."""

    def __init__(self, callable_: Any, method: str, tracer: trace.Tracer) -> None:
        self._callable = callable_
        self._method = method
        self._tracer = tracer

    def __call__(self, request_iterator: Any = None, **kwargs: Any) -> _TracedSessionCall:
        hops = _Hops(self._tracer, self._method)
        if request_iterator is not None:
            request_iterator = hops.sent(request_iterator)
        return _TracedSessionCall(self._callable(request_iterator, **kwargs), hops)


class _TracedResponses:
    """A client's streamed answer: the first token is an event, the stream's end the span's."""

    def __init__(self, call: Any, span: trace.Span) -> None:
        self._call = call
        self._span = span
        self._first = True
        self._ended = False

    def _note(self, response: Any) -> None:
        if self._first and _note_response(self._span, response):
            self._first = False

    def _end(self, exc: BaseException | None = None) -> None:
        if not self._ended:
            self._ended = True
            if exc is not None:
                _fail(self._span, exc)
            self._span.end()

    async def _responses(self) -> AsyncIterator[Any]:
        try:
            async for response in self._call:
                self._note(response)
                yield response
        except BaseException as exc:
            self._end(exc)
            raise
        finally:
            self._end()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def read(self) -> Any:
        try:
            response = await self._call.read()
        except BaseException as exc:
            self._end(exc)
            raise
        if response is grpc.aio.EOF:
            self._end()
        else:
            self._note(response)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _TracedUnaryStream:
    """A unary-stream method of a traced channel: a CLIENT span whose context the call carries."""

    def __init__(self, callable_: Any, method: str, runtime: Runtime) -> None:
        self._callable = callable_
        self._method = method
        self._runtime = runtime

    def __call__(self, request: Any, *, metadata: Any = None, **kwargs: Any) -> _TracedResponses:
        runtime = self._runtime
        span = runtime.calls.start_span(
            self._method.lstrip("/"),
            kind=SpanKind.CLIENT,
            attributes=_call_attributes(self._method, request),
        )
        carrier: dict[str, str] = {}
        runtime.propagator.inject(carrier, context=trace.set_span_in_context(span))
        metadata = (*(metadata or ()), *carrier.items())
        try:
            call = self._callable(request, metadata=metadata, **kwargs)
        except BaseException as exc:
            _fail(span, exc)
            span.end()
            raise
        return _TracedResponses(call, span)


class TracedChannel:
    """A grpc.aio channel whose Sluice calls are traced on the client side; the rest passes."""

    def __init__(self, channel: Any, runtime: Runtime) -> None:
        self._channel = channel
        self._runtime = runtime

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        callable_ = self._channel.stream_stream(method, *args, **kwargs)
        tracer = self._runtime.hops
        if tracer is None or not method.startswith(SLUICE_METHODS):
            return callable_
        return _TracedSession(callable_, method, tracer)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        callable_ = self._channel.unary_stream(method, *args, **kwargs)
        if not method.startswith(SLUICE_METHODS):
            return callable_
        return _TracedUnaryStream(callable_, method, self._runtime)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    async def __aenter__(self) -> TracedChannel:
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> Any:
        return await self._channel.__aexit__(*exc_info)
