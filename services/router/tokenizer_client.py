"""The router's side of the tokenizer: Tokenize calls and one multiplexed DetokenizeSession.

`Tokenize` is a plain unary call per request (not on the per-token path). Detokenization is the
per-token path, so it is batched: the router sends ONE `DetokenizeRequest` per engine step with
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
        """Encode one prompt; errors come back as SluiceError (the tokenizer's own code)."""
        timeout = self._tokenize_timeout_s if timeout_s is None else timeout_s
        try:
            response = await self._stub.Tokenize(
                tokenizer_pb2.TokenizeRequest(items=[item]), timeout=max(timeout, 0.001)
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgumentError(exc.details() or "invalid prompt") from exc
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceededError("tokenizing the prompt took too long") from exc
            raise UnavailableError(f"tokenizer unavailable: {code.name}") from exc
        if len(response.results) != 1:
            raise UnavailableError("tokenizer answered with the wrong number of results")
        result = response.results[0]
        if result.HasField("error") and result.error.code:
            raise error_from_item(result.error.code, result.error.message)
        return list(result.token_ids)

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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
