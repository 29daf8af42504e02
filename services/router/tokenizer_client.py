"""The router's side of the tokenizer: prompts to encode and one multiplexed DetokenizeSession.

Prompts are micro-batched: those that arrive in the same event-loop turn share one batch (a
burst of arrivals costs one round trip, not one each), sent on one long-lived `TokenizeSession`
stream (answers paired by sequence number; no call setup per request), or as a `Tokenize` call
while the stream is down or when the tokenizer's Info says it has none. Detokenization is the
per-token path, so it is batched too: the router sends ONE `DetokenizeRequest` per engine step
with every request's new token ids and gets one `DetokenizeResponse` back, paired by
`sequence_number`. Writer tasks drain outboxes so a step never waits for the network. When the
sessions drop, `on_lost` is told (the router fails the requests whose text state lived there),
prompts waiting on the tokenize stream fail with UNAVAILABLE, and the sessions are reopened
with exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from protos.sluice.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    SluiceError,
    UnavailableError,
)
from services.common.grpc_channel import open_channel

log = logging.getLogger(__name__)

MAX_TOKENIZE_BATCH = 256  # items per Tokenize call (the tokenizer's own cap is larger)

_ERRORS_BY_CODE: dict[str, type[SluiceError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "UNAVAILABLE": UnavailableError,
}


def error_from_item(code: str, message: str) -> SluiceError:
    """An ItemError (code name + message) as the matching SluiceError (UNAVAILABLE if odd)."""
    cls = _ERRORS_BY_CODE.get(code, UnavailableError)
    return cls(message or code)


class _Outbox:
    """Messages for one stream, written in order by one writer task (writes never overlap), so
    a sender never waits for the network. `collect`, if given, runs each time the writer wakes,
    before it takes the messages: work gathered during a loop turn becomes messages then,
    without a callback of its own (one loop turn less on the way out)."""

    def __init__(self, collect: Callable[[], None] | None = None) -> None:
        self._messages: list = []
        self._ready = asyncio.Event()
        self._collect = collect

    def put(self, message) -> None:
        self._messages.append(message)
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    def clear(self) -> None:
        self._messages.clear()

    async def write_to(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await self._ready.wait()
            if self._collect is not None:
                self._collect()
            self._ready.clear()
            batch, self._messages = self._messages, []
            for message in batch:
                await call.write(message)


class TokenizerClient:
    """Tokenize batches plus the shared detokenize session to one tokenizer address."""

    def __init__(
        self,
        address: str,
        on_response: Callable[[tokenizer_pb2.DetokenizeResponse], None],
        on_lost: Callable[[], None],
        *,
        tokenize_timeout_s: float = 10.0,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.address = address
        self._on_response = on_response
        self._on_lost = on_lost
        self._tokenize_timeout_s = tokenize_timeout_s
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._channel = open_channel(address)
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._detokenize_outbox = _Outbox()
        self._task: asyncio.Task | None = None
        self._sequence_number = 0
        self._tokenize_pending: list[tuple[tokenizer_pb2.TokenizeItem, asyncio.Future]] = []
        self._tokenize_tasks: set[asyncio.Task] = set()
        # The TokenizeSession stream: open while `_tokenize_outbox` is not None; batches sent
        # on it wait in `_tokenize_waiting` (by sequence number) for their answer.
        self._tokenize_outbox: _Outbox | None = None
        self._tokenize_waiting: dict[int, list[tuple]] = {}
        self._tokenize_sequence = 0
        self.ready = False
        self.ready_changed: Callable[[], None] | None = None
        self.info: tokenizer_pb2.TokenizerInfo | None = None

    @property
    def tokenize_session_supported(self) -> bool:
        """Whether the tokenizer's Info offers TokenizeSession. Asked, not tried: opening a
        stream the tokenizer lacks races the first writes against its UNIMPLEMENTED answer,
        and a write that loses turns the call's status into INTERNAL."""
        return bool(self.info and self.info.tokenize_session)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="detokenize")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._channel.close()

    async def tokenize(
        self,
        item: tokenizer_pb2.TokenizeItem,
        timeout_s: float | None = None,
    ) -> list[int]:
        """Encode one prompt; errors come back as SluiceError (the tokenizer's own code).

        Prompts arriving in the same event-loop turn share one batch (a burst of requests
        costs one round trip, not one each), sent on the TokenizeSession stream while it is
        open, else as a Tokenize call.
        """
        timeout = self._tokenize_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        # The future is this prompt's own, awaited directly: the answer resumes the caller in
        # the next loop turn (wait_for + shield would take three), and a timer fails it.
        timer = loop.call_later(max(timeout, 0.001), _expire, future)
        self._tokenize_pending.append((item, future))
        if len(self._tokenize_pending) == 1:
            if self._tokenize_outbox is not None:
                self._tokenize_outbox.wake()  # its writer takes the batch when it runs
            else:
                loop.call_soon(self._flush_tokenize)
        try:
            result = await future
        finally:
            timer.cancel()
        if result.HasField("error") and result.error.code:
            raise error_from_item(result.error.code, result.error.message)
        return list(result.token_ids)

    def _flush_tokenize(self) -> None:
        batch, self._tokenize_pending = self._tokenize_pending, []
        for start in range(0, len(batch), MAX_TOKENIZE_BATCH):
            self._send_tokenize(batch[start : start + MAX_TOKENIZE_BATCH])

    def _send_tokenize(self, batch: list[tuple]) -> None:
        if self._tokenize_outbox is not None:
            self._tokenize_sequence += 1
            self._tokenize_waiting[self._tokenize_sequence] = batch
            self._tokenize_outbox.put(
                tokenizer_pb2.TokenizeRequest(
                    items=[item for item, _ in batch], sequence_number=self._tokenize_sequence
                )
            )
            return
        task = asyncio.get_running_loop().create_task(self._tokenize_call(batch))
        self._tokenize_tasks.add(task)
        task.add_done_callback(self._tokenize_tasks.discard)

    async def _tokenize_call(self, batch: list[tuple]) -> None:
        try:
            response = await self._stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(items=[item for item, _ in batch]),
                timeout=self._tokenize_timeout_s,
            )
            _settle(batch, response)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and len(batch) > 1:
                self._resend_one_by_one(batch)
                return
            _fail_all(batch, _error_from_status(exc))

    def _resend_one_by_one(self, batch: list[tuple]) -> None:
        """A refused batch: ask again item by item, so one bad item fails alone."""
        for single in batch:
            self._send_tokenize([single])

    def _on_tokenized(self, response: tokenizer_pb2.TokenizeResponse) -> None:
        batch = self._tokenize_waiting.pop(response.sequence_number, None)
        if batch is None:
            return
        if response.HasField("error") and response.error.code:
            if response.error.code == "INVALID_ARGUMENT" and len(batch) > 1:
                self._resend_one_by_one(batch)
            else:
                _fail_all(batch, error_from_item(response.error.code, response.error.message))
            return
        _settle(batch, response)

    def next_sequence_number(self) -> int:
        self._sequence_number += 1
        return self._sequence_number

    def send(self, request: tokenizer_pb2.DetokenizeRequest) -> None:
        """Queue one batched detokenize message (never blocks)."""
        self._detokenize_outbox.put(request)

    async def _run(self) -> None:
        backoff = self._min_backoff_s
        while True:
            try:
                self.info = await self._stub.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=5)
                await self._serve_sessions()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means reconnect
                log.warning("tokenizer %s unavailable: %s", self.address, _describe(exc))
            if self.ready:  # it served, then failed: the backoff starts over
                backoff = self._min_backoff_s
                self._set_ready(False)
                self._on_lost()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _serve_sessions(self) -> None:
        """Open the detokenize (and tokenize) streams and serve them until one fails."""
        detokenize = self._stub.DetokenizeSession()
        self._detokenize_outbox.clear()
        tasks = [asyncio.ensure_future(self._detokenize_outbox.write_to(detokenize))]
        readers = [asyncio.ensure_future(self._read(detokenize))]
        tokenize = None
        if self.tokenize_session_supported:
            tokenize = self._stub.TokenizeSession()
            self._tokenize_outbox = _Outbox(collect=self._flush_tokenize)
            tasks.append(asyncio.ensure_future(self._tokenize_outbox.write_to(tokenize)))
            readers.append(asyncio.ensure_future(self._read_tokenize(tokenize)))
        self._set_ready(True)
        log.info("detokenize session open to %s", self.address)
        try:
            done, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
        finally:
            self._close_tokenize_session(UnavailableError("the tokenizer session dropped"))
            for task in tasks + readers:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.gather(*tasks, *readers, return_exceptions=True)
            detokenize.cancel()
            if tokenize is not None:
                tokenize.cancel()

    def _close_tokenize_session(self, error: SluiceError) -> None:
        """Stop using the TokenizeSession stream; its unanswered batches fail with `error`."""
        self._tokenize_outbox = None
        waiting, self._tokenize_waiting = self._tokenize_waiting, {}
        for batch in waiting.values():
            _fail_all(batch, error)
        if self._tokenize_pending:  # gathered for the stream's writer, never taken
            self._flush_tokenize()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        on_response = self._on_response
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise UnavailableError("detokenize session closed by the tokenizer")
            on_response(response)

    async def _read_tokenize(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise UnavailableError("tokenize session closed by the tokenizer")
            self._on_tokenized(response)

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        if self.ready_changed is not None:
            self.ready_changed()


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(DeadlineExceededError("tokenizing the prompt took too long"))


def _settle(batch: list[tuple], response: tokenizer_pb2.TokenizeResponse) -> None:
    """Hand each waiting prompt its result."""
    if len(response.results) != len(batch):
        _fail_all(batch, UnavailableError("tokenizer answered with the wrong number of results"))
        return
    for (_, future), result in zip(batch, response.results, strict=True):
        if not future.done():
            future.set_result(result)


def _fail_all(batch: list[tuple], error: SluiceError) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(error)


def _error_from_status(exc: grpc.aio.AioRpcError) -> SluiceError:
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgumentError(exc.details() or "invalid prompt")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError("tokenizing the prompt took too long")
    return UnavailableError(f"tokenizer unavailable: {code.name}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
