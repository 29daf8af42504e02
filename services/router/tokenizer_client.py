"""The router's side of the tokenizer: Tokenize calls and one multiplexed DetokenizeSession.

`Tokenize` calls are micro-batched: prompts that arrive in the same event-loop turn share one
call (a burst of arrivals costs one round trip, not one each). Detokenization is the
per-token path, so it is batched too: the router sends ONE `DetokenizeRequest` per engine step with
every request's new token ids and gets one `DetokenizeResponse` back, paired by
`sequence_number`. A writer task drains an outbox so a step never waits for the network.
When the session drops, `on_lost` is told (the router fails the requests whose text state lived
there) and the session is reopened with exponential backoff.
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


class TokenizerClient:
    """Tokenize calls plus the shared detokenize session to one tokenizer address."""

    def __init__(
        self,
        address: str,
        on_response: Callable[[tokenizer_pb2.DetokenizeResponse], None],
        on_lost: Callable[[], None],
        *,
        tokenize_timeout_s: float = 10.0,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.address = address
        self._on_response = on_response
        self._on_lost = on_lost
        self._tokenize_timeout_s = tokenize_timeout_s
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ],
        )
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._outbox: list[tokenizer_pb2.DetokenizeRequest] = []
        self._outbox_ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._sequence_number = 0
        self._tokenize_pending: list[tuple[tokenizer_pb2.TokenizeItem, asyncio.Future]] = []
        self._tokenize_tasks: set[asyncio.Task] = set()
        self.ready = False
        self.ready_changed: Callable[[], None] | None = None
        self.info: tokenizer_pb2.TokenizerInfo | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="detokenize")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._channel.close()

    async def tokenize(
        self, item: tokenizer_pb2.TokenizeItem, timeout_s: float | None = None
    ) -> list[int]:
        """Encode one prompt; errors come back as SluiceError (the tokenizer's own code).

        Prompts arriving in the same event-loop turn share one Tokenize call (a burst of
        requests costs one round trip, not one each).
        """
        timeout = self._tokenize_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._tokenize_pending.append((item, future))
        if len(self._tokenize_pending) == 1:
            loop.call_soon(self._flush_tokenize)
        try:
            result = await asyncio.wait_for(asyncio.shield(future), max(timeout, 0.001))
        except TimeoutError:
            raise DeadlineExceededError("tokenizing the prompt took too long") from None
        if result.HasField("error") and result.error.code:
            raise error_from_item(result.error.code, result.error.message)
        return list(result.token_ids)

    def _flush_tokenize(self) -> None:
        batch, self._tokenize_pending = self._tokenize_pending, []
        for start in range(0, len(batch), MAX_TOKENIZE_BATCH):
            task = asyncio.get_running_loop().create_task(
                self._tokenize_batch(batch[start : start + MAX_TOKENIZE_BATCH])
            )
            self._tokenize_tasks.add(task)
            task.add_done_callback(self._tokenize_tasks.discard)

    async def _tokenize_batch(self, batch: list[tuple]) -> None:
        try:
            response = await self._stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(items=[item for item, _ in batch]),
                timeout=self._tokenize_timeout_s,
            )
            if len(response.results) != len(batch):
                raise UnavailableError("tokenizer answered with the wrong number of results")
            for (_, future), result in zip(batch, response.results, strict=True):
                if not future.done():
                    future.set_result(result)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and len(batch) > 1:
                # One bad item must not fail the others: ask again one by one.
                for single in batch:
                    await self._tokenize_batch([single])
                return
            _fail_all(batch, _error_from_status(exc))
        except SluiceError as error:
            _fail_all(batch, error)

    def next_sequence_number(self) -> int:
        self._sequence_number += 1
        return self._sequence_number

    def send(self, request: tokenizer_pb2.DetokenizeRequest) -> None:
        """Queue one batched detokenize message (never blocks)."""
        self._outbox.append(request)
        self._outbox_ready.set()

    async def _run(self) -> None:
        backoff = self._min_backoff_s
        while True:
            try:
                self.info = await self._stub.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=5)
                call = self._stub.DetokenizeSession()
                self._outbox.clear()
                self._set_ready(True)
                backoff = self._min_backoff_s
                log.info("detokenize session open to %s", self.address)
                writer = asyncio.get_running_loop().create_task(self._write(call))
                try:
                    await self._read(call)
                finally:
                    writer.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await writer
                    call.cancel()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure means reconnect
                log.warning("tokenizer %s unavailable: %s", self.address, _describe(exc))
            if self.ready:
                self._set_ready(False)
                self._on_lost()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            batch, self._outbox = self._outbox, []
            for message in batch:
                await call.write(message)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        on_response = self._on_response
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise UnavailableError("detokenize session closed by the tokenizer")
            on_response(response)

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        if self.ready_changed is not None:
            self.ready_changed()


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
