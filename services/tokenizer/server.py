"""The tokenizer service: a thin grpc.aio servicer over tokenize.py and session.py.

`Tokenize` encodes a batch (each item text or chat) on a small thread pool so a long prompt does
not stall the streams; a batch of short texts (the common case: tens of microseconds to encode)
is encoded inline, which saves two thread hand-offs on every request's time to first token.
Each item fails on its own with an ItemError. `TokenizeSession` does the same over one
long-lived stream (the router's way: one message each way per batch instead of a call's setup,
headers and trailers), answering each batch by its sequence number. `DetokenizeSession` keeps one
`session.DetokenizeSession` per stream and answers every inbound message (one engine step, many
requests) with one outbound message carrying the same sequence_number; its work is done inline
because it is small (a few microseconds per update). `Info` describes the tokenizer.

Entry points: `serve(config)` (async; runs until SIGTERM/SIGINT or `stop`), `start(config)` for
in-process use, and `main(argv)` for `python -m services.tokenizer.server` and
`sluice serve tokenizer`. The server speaks grpc.health.v1 and reflection (common/grpc_server.py)
and prints `tokenizer listening on HOST:PORT` to stdout once it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from protos.sluice.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.common import event_loop, tracing
from services.common.config import describe
from services.common.errors import InvalidArgumentError, SluiceError
from services.common.grpc_server import RunningServer, start_server
from services.common.heap import freeze_startup_heap
from services.tokenizer.config import TokenizerConfig, settings_from_argv
from services.tokenizer.session import (
    DecodeOptions,
    Delta,
    DetokenizeSession,
    SessionLimits,
    Update,
)
from services.tokenizer.tokenize import EncodeItem, TokenizerModel

log = logging.getLogger(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
# A batch of text items (no chat template to render) with at most this many characters in all
# is encoded on the event loop: cheaper and faster than a round trip through the thread pool.
INLINE_ENCODE_MAX_CHARS = 2048
# Batches of one TokenizeSession being encoded on the pool at once; past it the session stops
# reading until one is done.
MAX_SESSION_BATCHES_OFF_LOOP = 64


def encode_item_from_pb(item: tokenizer_pb2.TokenizeItem) -> EncodeItem:
    """The domain form of one TokenizeItem."""
    kind = item.WhichOneof("input")
    common = {
        "add_generation_prompt": (
            item.add_generation_prompt if item.HasField("add_generation_prompt") else True
        ),
        "add_special_tokens": (
            item.add_special_tokens if item.HasField("add_special_tokens") else True
        ),
        "max_prompt_tokens": item.max_prompt_tokens,
    }
    if kind == "text":
        return EncodeItem(text=item.text, **common)
    if kind == "chat":
        chat = [{"role": m.role, "content": m.content} for m in item.chat.messages]
        return EncodeItem(chat=chat, **common)
    return EncodeItem(**common)


def _short_texts(items: Sequence[EncodeItem]) -> bool:
    """True when every item is plain text and all of it is short enough to encode inline."""
    total = 0
    for item in items:
        if item.chat is not None or item.text is None:
            return False
        total += len(item.text)
    return total <= INLINE_ENCODE_MAX_CHARS


def _forget(pending: set[asyncio.Task], task: asyncio.Task) -> None:
    """A pool batch of a TokenizeSession is done: drop it, and say if answering it failed."""
    pending.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("a TokenizeSession answer failed: %r", task.exception())


def update_from_pb(update: tokenizer_pb2.DetokenizeUpdate) -> Update:
    """The domain form of one DetokenizeUpdate."""
    options = None
    if update.HasField("options"):
        pb = update.options
        options = DecodeOptions(
            stop=tuple(pb.stop),
            include_stop_str_in_output=pb.include_stop_str_in_output,
            skip_special_tokens=(
                pb.skip_special_tokens if pb.HasField("skip_special_tokens") else True
            ),
            prompt_tail_ids=tuple(pb.prompt_tail_ids),
        )
    return Update(
        update.request_id,
        update.token_ids,
        options,
        finished=update.finished,
        cancel=update.cancel,
    )


def delta_to_pb(delta: Delta) -> tokenizer_pb2.TextDelta:
    """The wire form of one Delta."""
    message = tokenizer_pb2.TextDelta(
        request_id=delta.request_id,
        text=delta.text,
        stop_hit=delta.stop_hit,
        matched_stop=delta.matched_stop,
        closed=delta.closed,
    )
    if delta.error_code:
        message.error.code = delta.error_code
        message.error.message = delta.error_message
    return message


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Converts protobuf to domain calls and back (see the module docstring)."""

    def __init__(self, model: TokenizerModel, config: TokenizerConfig) -> None:
        self._model = model
        self._config = config
        self._limits = SessionLimits(
            max_requests=config.max_requests_per_session,
            max_stop_strings=config.max_stop_strings,
            max_stop_length=config.max_stop_length,
        )
        self._executor = ThreadPoolExecutor(
            max_workers=config.tokenize_threads, thread_name_prefix="tokenize"
        )

    def shutdown(self) -> None:
        """Stop the encoding threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def Tokenize(  # noqa: N802 - gRPC method name
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        refused = self._refusal(request)
        if refused is not None:
            raise InvalidArgumentError(refused)
        items = [encode_item_from_pb(item) for item in request.items]
        if _short_texts(items):
            return tokenizer_pb2.TokenizeResponse(results=self._encode_all(items))
        return tokenizer_pb2.TokenizeResponse(results=await self._encode_off_loop(items))

    async def TokenizeSession(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.TokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Tokenize over one stream: every batch answered once, by its sequence number.

        Short text batches are answered inline, in order, as soon as they are read (written
        from this handler, not handed to another task: no extra loop turn on the way to the
        first token); the others are encoded on the pool and answered when done (at most
        MAX_SESSION_BATCHES_OFF_LOOP at once per session: the reader waits, so a flood backs up
        into gRPC flow control instead of memory). A refused batch gets an answer with `error`
        set; the stream goes on.
        """
        writing = asyncio.Lock()  # one write at a time: inline answers and pool answers

        async def answer(response: tokenizer_pb2.TokenizeResponse) -> None:
            async with writing:
                await context.write(response)

        async def encode(sequence_number: int, items: list[EncodeItem]) -> None:
            results = await self._encode_off_loop(items)
            await answer(
                tokenizer_pb2.TokenizeResponse(results=results, sequence_number=sequence_number)
            )

        pending: set[asyncio.Task] = set()
        try:
            async for request in request_iterator:
                number = request.sequence_number
                refused = self._refusal(request)
                if refused is not None:
                    error = common_pb2.ItemError(code="INVALID_ARGUMENT", message=refused)
                    await answer(
                        tokenizer_pb2.TokenizeResponse(sequence_number=number, error=error)
                    )
                    continue
                items = [encode_item_from_pb(item) for item in request.items]
                if _short_texts(items):
                    results = self._encode_all(items)
                    await answer(
                        tokenizer_pb2.TokenizeResponse(results=results, sequence_number=number)
                    )
                    continue
                if len(pending) >= MAX_SESSION_BATCHES_OFF_LOOP:
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                task = asyncio.ensure_future(encode(number, items))
                pending.add(task)
                task.add_done_callback(lambda done: _forget(pending, done))
            # The router closed its side: answer what it already sent (errors surface here).
            await asyncio.gather(*pending)
        finally:
            for task in pending:
                task.cancel()

    def _refusal(self, request: tokenizer_pb2.TokenizeRequest) -> str | None:
        """Why a whole batch is refused, or None."""
        if len(request.items) > self._config.max_batch_items:
            return (
                f"a Tokenize call may carry at most {self._config.max_batch_items} items, "
                f"got {len(request.items)}"
            )
        return None

    async def _encode_off_loop(
        self, items: Sequence[EncodeItem]
    ) -> list[tokenizer_pb2.TokenizeResult]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._encode_all, items)

    def _encode_all(self, items: Sequence[EncodeItem]) -> list[tokenizer_pb2.TokenizeResult]:
        results = []
        for item in items:
            try:
                ids = self._model.encode_item(item)
                results.append(tokenizer_pb2.TokenizeResult(token_ids=ids))
            except SluiceError as exc:
                error = common_pb2.ItemError(code=exc.code, message=exc.message)
                results.append(tokenizer_pb2.TokenizeResult(error=error))
        return results

    async def DetokenizeSession(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeResponse]:
        session = DetokenizeSession(self._model.decode, self._model.vocab_size, self._limits)
        try:
            async for request in request_iterator:
                deltas = session.handle(update_from_pb(u) for u in request.updates)
                yield tokenizer_pb2.DetokenizeResponse(
                    deltas=[delta_to_pb(d) for d in deltas],
                    sequence_number=request.sequence_number,
                )
        finally:
            session.close()

    async def Info(  # noqa: N802 - gRPC method name
        self, request: tokenizer_pb2.TokenizerInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        return tokenizer_pb2.TokenizerInfo(
            model=self._model.name,
            vocab_size=self._model.vocab_size,
            eos_token_ids=list(self._model.eos_token_ids),
            has_chat_template=self._model.chat_template is not None,
            tokenize_session=True,
        )


@dataclass
class TokenizerServer:
    """A started tokenizer service."""

    running: RunningServer
    servicer: TokenizerServicer

    @property
    def port(self) -> int:
        return self.running.port

    async def stop(self, grace_s: float | None = None) -> None:
        await self.running.stop(grace_s)
        self.servicer.shutdown()


async def start(config: TokenizerConfig, model: TokenizerModel | None = None) -> TokenizerServer:
    """Load the tokenizer (unless given), bind, and mark the service SERVING."""
    if model is None:
        model = await asyncio.to_thread(
            TokenizerModel.load, config.model, max_text_chars=config.max_text_chars
        )
    servicer = TokenizerServicer(model, config)
    running = await start_server(
        config.address,
        lambda server: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server),
        (SERVICE_NAME,),
    )
    await running.set_serving(True)
    return TokenizerServer(running, servicer)


async def serve(
    config: TokenizerConfig,
    stop: asyncio.Event | None = None,
    *,
    tracing_config: tracing.TracingConfig | None = None,
) -> None:
    """Run the service until SIGTERM/SIGINT (or `stop` is set), then drain open calls.

    `tracing_config`: this process's tracing (default: from the `SLUICE_*` environment).
    """
    stop = stop or asyncio.Event()
    sys.setswitchinterval(event_loop.GIL_SWITCH_INTERVAL_S)  # encoding threads hand off too
    tracing.configure(
        tracing_config or tracing.TracingConfig.from_environment(), "sluice-tokenizer"
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(signum, stop.set)
    server = await start(config)
    print(f"tokenizer listening on {config.host}:{server.port}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("tokenizer stopping (grace %.1f s)", config.shutdown_grace_s)
        await server.stop(config.shutdown_grace_s)


def main(argv: list[str] | None = None) -> None:
    """`sluice serve tokenizer` / `python -m services.tokenizer.server`."""
    try:
        config, tracing_config = settings_from_argv(argv)
    except SluiceError as exc:
        raise SystemExit(f"error: {exc.code}: {exc.message}") from None
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("%s", describe(config))
    freeze_startup_heap()  # the imports: never walked by a collection again
    try:
        event_loop.run(serve(config, tracing_config=tracing_config))
    except SluiceError as exc:
        raise SystemExit(f"error: {exc.code}: {exc.message}") from None


if __name__ == "__main__":
    main()
