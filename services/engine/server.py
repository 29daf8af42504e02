"""The engine worker's gRPC service: EngineSession (bidirectional, batched), Info, InspectAdapter.

A thin servicer: it converts protobuf to domain objects, hands them to the `EngineLoop` (the
thread that owns the LLMEngine) and fans the loop's outputs back out to sessions. The asyncio
loop never waits on a forward step.

- One EngineSession stream per router. Request ids are namespaced per session internally
  (`<session>/<id>`), so two routers can use the same ids. A submit whose parameters are bad is
  answered with a SequenceUpdate carrying an ItemError for that request only.
- Every loop output becomes at most one EngineStep per session (only that session's updates,
  plus the load). Requests submitted with `hold_tokens` get their tokens of several steps in one
  update, as the session's `pacing` says (coalesce.py). A session with no updates still gets a
  load-only EngineStep when the engine is idle, at most every `load_report_interval_s`.
- When a session ends (router gone, or it half-closes and its requests are done), all its live
  requests are aborted, so their KV blocks are freed.
- LoRA: a submit naming an adapter carries its registration (`adapter_spec`, from the router's
  registry), which the engine registers before it holds the request; a load that fails ends
  that request with the error's status. `InspectAdapter` validates an adapter directory under
  --adapter-root on a worker thread (the router calls it when an adapter is added).
- Health is NOT_SERVING until the model is loaded and warmed (LLMEngine.warm_up: kernels
  compiled, graphs replayed, sampler paths run), so first requests pay none of that.

Run standalone: `sluice serve engine --model ... --port ...` or `python -m services.engine.server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common import event_loop, metrics, tracing
from services.common.config import describe
from services.common.errors import SluiceError, UnavailableError
from services.common.grpc_server import start_server
from services.common.heap import freeze_startup_heap
from services.common.protocol.adapter_record import AdapterRecord
from services.common.protocol.codec import sampling_params_from_pb
from services.engine.coalesce import TokenCoalescer
from services.engine.engine_loop import EngineLoop, LoopOutput, Rejection, Submit
from services.engine.outputs import EngineLoad
from services.engine.server_convert import (
    fill_update,
    load_to_pb,
    rejection_to_pb,
)
from services.engine.server_metrics import MetricsRecorder
from services.engine.worker_config import WorkerConfig

ACCEPTED_REQUESTS_TRAILER = "sluice-engine-accepted-requests"

log = logging.getLogger(__name__)

SERVICE_NAME = "sluice.v1.Engine"
_SEPARATOR = "/"


@dataclass
class _Session:
    """One router's stream: its live request ids and its outbound queue."""

    key: str
    outbox: asyncio.Queue[engine_pb2.EngineStep | None] = field(default_factory=asyncio.Queue)
    live: set[str] = field(default_factory=set)  # ids as the router sent them
    input_closed: bool = False
    input_error: str = ""  # why reading the router's stream failed (the session then ends)
    last_sent: float = 0.0
    # Tokens of requests submitted with hold_tokens, gathered as the router's pacing says.
    coalescer: TokenCoalescer = field(default_factory=TokenCoalescer)
    # Submits counted in the order the router sent them; those handed to the engine loop and not
    # yet taken in by a turn, (number, request id) in that order (the loop takes them in order).
    received: int = 0
    untaken: deque[tuple[int, str]] = field(default_factory=deque)

    def internal_id(self, request_id: str) -> str:
        return f"{self.key}{_SEPARATOR}{request_id}"

    @property
    def submits_taken(self) -> int:
        """How many of the stream's submits, in order, are in the engine's load now (those
        refused here count as taken: they never queue)."""
        return self.untaken[0][0] - 1 if self.untaken else self.received

    def note_taken(self, request_ids: set[str]) -> None:
        """A loop turn took in these of the session's submits."""
        untaken = self.untaken
        while untaken and untaken[0][1] in request_ids:
            untaken.popleft()


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Engine gRPC service over an EngineLoop (see the module docstring)."""

    def __init__(self, *, load_report_interval_s: float = 1.0) -> None:
        self.engine_id = uuid.uuid4().hex[:12]
        self._load_report_interval_s = load_report_interval_s
        self._loop_thread: EngineLoop | None = None
        self._engine: Any = None
        self._info: Any = None
        self._sessions: dict[str, _Session] = {}
        self._session_numbers = itertools.count(1)
        self._load: EngineLoad | None = None
        self._step_index = 0
        self._asyncio_loop: asyncio.AbstractEventLoop | None = None
        self._metrics: MetricsRecorder | None = None

    # ---- wiring ---------------------------------------------------------------------------
    def attach(self, engine: Any, asyncio_loop: asyncio.AbstractEventLoop) -> EngineLoop:
        """Start serving `engine` (an LLMEngine); outputs come back on `asyncio_loop`."""
        self._asyncio_loop = asyncio_loop
        self._engine = engine
        self._info = engine.info
        self._metrics = MetricsRecorder(engine)
        config = getattr(engine, "config", None)  # tests drive fakes without one
        engine_loop = EngineLoop(
            engine,
            self._from_engine_thread,
            load_report_interval_s=self._load_report_interval_s,
            thread_policy=config.forward_thread_policy if config else "normal",
            step_hook=tracing.step_hook(),
        )
        self._load = engine_loop.initial_load
        self._loop_thread = engine_loop
        engine_loop.start()
        return engine_loop

    def _from_engine_thread(self, output: LoopOutput) -> None:
        if self._metrics is not None:
            self._metrics.record(output)
        loop = self._asyncio_loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._dispatch, output)

    def _ready(self) -> EngineLoop:
        if self._loop_thread is None:
            raise UnavailableError("the engine is still loading its model")
        return self._loop_thread

    # ---- RPCs -----------------------------------------------------------------------------
    async def Info(
        self, request: engine_pb2.EngineInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineInfo:
        engine_loop = self._ready()
        # Not in the proto: how many requests this engine accepted (each is one generation).
        context.set_trailing_metadata(
            ((ACCEPTED_REQUESTS_TRAILER, str(engine_loop.accepted_requests)),)
        )
        info = self._info
        return engine_pb2.EngineInfo(
            model=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_blocks=info.num_blocks,
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            target_step_ms=getattr(info, "target_step_ms", 0.0),
            eos_token_ids=list(info.eos_token_ids),
            engine_id=self.engine_id,
            backend=info.backend,
            device=str(info.device),
            dtype=str(info.dtype),
            execution_path=info.execution_path,
            max_loras=getattr(info, "max_loras", 0),
            max_lora_rank=getattr(info, "max_lora_rank", 0),
            max_inflight=getattr(info, "max_inflight", 0),
            load=load_to_pb(self._load) if self._load else None,
        )

    async def InspectAdapter(
        self, request: engine_pb2.InspectAdapterRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AdapterSpec:
        """Check an adapter under --adapter-root against the model (reads files on a worker
        thread, never the step thread); INVALID_ARGUMENT / NOT_FOUND with the reason."""
        self._ready()
        record = await asyncio.to_thread(self._engine.inspect_adapter, request.name, request.path)
        return record.to_pb()

    async def EngineSession(
        self,
        request_iterator: AsyncIterator[engine_pb2.EngineRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.EngineStep]:
        engine_loop = self._ready()
        session = _Session(key=f"s{next(self._session_numbers)}")
        self._sessions[session.key] = session
        reader = asyncio.create_task(self._read(request_iterator, session, engine_loop))
        try:
            if self._load is not None:  # capacity right away, before any step
                yield self._step_message([], self._load)
            while True:
                message = await session.outbox.get()
                if message is None:
                    if session.input_error:  # the router sees it and opens a new session
                        raise UnavailableError(session.input_error)
                    return
                yield message
        finally:
            reader.cancel()
            self._close(session, engine_loop)

    # ---- inbound --------------------------------------------------------------------------
    async def _read(
        self,
        request_iterator: AsyncIterator[engine_pb2.EngineRequest],
        session: _Session,
        engine_loop: EngineLoop,
    ) -> None:
        try:
            async for request in request_iterator:
                self._handle(request, session, engine_loop)
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        except Exception as exc:  # noqa: BLE001 - never a session that silently stops reading
            log.exception("session %s: reading the router's stream failed", session.key)
            session.input_error = f"the engine could not read this session: {type(exc).__name__}"
            session.outbox.put_nowait(None)  # ends the session now; its requests are aborted
            return
        session.input_closed = True
        if not session.live:
            session.outbox.put_nowait(None)

    def _handle(
        self, request: engine_pb2.EngineRequest, session: _Session, engine_loop: EngineLoop
    ) -> None:
        submits: list[Submit] = []
        refused: list[engine_pb2.SequenceUpdate] = []
        if request.HasField("pacing"):
            session.coalescer.set_pacing(
                request.pacing.tokens_per_update, request.pacing.max_hold_ms
            )
        for item in request.submits:
            session.received += 1
            request_id = item.request_id
            if not request_id:
                refused.append(_refusal("", "INVALID_ARGUMENT", "request_id must be non-empty"))
                continue
            if request_id in session.live:
                refused.append(
                    _refusal(request_id, "ALREADY_EXISTS", f"request {request_id!r} is live")
                )
                continue
            try:
                params = sampling_params_from_pb(item.params)
                spec = (
                    AdapterRecord.from_pb(item.adapter_spec)
                    if item.adapter and item.HasField("adapter_spec")
                    else None
                )
            except SluiceError as exc:
                refused.append(_refusal(request_id, exc.code, exc.message))
                continue
            session.live.add(request_id)
            session.untaken.append((session.received, request_id))
            if item.hold_tokens:
                session.coalescer.allow(request_id)
            submits.append(
                Submit(
                    session.internal_id(request_id),
                    list(item.prompt_token_ids),
                    params,
                    adapter=item.adapter or None,
                    priority=item.priority,
                    adapter_spec=spec,
                )
            )
        if submits:
            engine_loop.submit(submits)
        aborts = [session.internal_id(rid) for rid in request.aborts if rid in session.live]
        for request_id in request.aborts:
            session.coalescer.forget(request_id)
        if aborts:
            engine_loop.abort(aborts)
        if refused and self._load is not None:
            message = self._step_message(refused, self._load)
            message.submits_taken = session.submits_taken
            session.outbox.put_nowait(message)

    # ---- outbound -------------------------------------------------------------------------
    def _dispatch(self, output: LoopOutput) -> None:
        """On the asyncio loop: split one loop output into one EngineStep per session.

        Each session's EngineStep is built in place (updates added to it, the load converted
        once per step), never as separate messages copied in afterwards.
        """
        self._load = output.load
        self._step_index = output.step_index
        load = load_to_pb(output.load)
        sessions = self._sessions
        steps: dict[str, engine_pb2.EngineStep] = {}
        now = time.monotonic()

        def step_of(key: str) -> engine_pb2.EngineStep:
            step = steps.get(key)
            if step is None:
                step = steps[key] = self._new_step(load, output)
            return step

        taken: dict[str, set[str]] = {}  # by session: its submits this turn took in
        for internal_id in output.taken:
            key, _, request_id = internal_id.partition(_SEPARATOR)
            taken.setdefault(key, set()).add(request_id)
        for key, request_ids in taken.items():
            session = sessions.get(key)
            if session is not None:
                session.note_taken(request_ids)

        for items in (output.rejections, output.deltas):
            for item in items:
                key, _, request_id = item.request_id.partition(_SEPARATOR)
                session = sessions.get(key)
                if session is None or request_id not in session.live:
                    continue  # the session is gone (its requests were aborted)
                if isinstance(item, Rejection):
                    session.coalescer.forget(request_id)
                    step_of(key).updates.append(rejection_to_pb(request_id, item))
                    session.live.discard(request_id)
                    continue
                delta = session.coalescer.take(request_id, item, now)
                if delta is None:
                    continue  # held: a later update carries it
                fill_update(step_of(key).updates.add(), request_id, delta)
                if delta.finished:
                    session.live.discard(request_id)
        for key, session in sessions.items():
            if session.coalescer.holding:
                for request_id, delta in session.coalescer.overdue(now):
                    fill_update(step_of(key).updates.add(), request_id, delta)
        for key, session in list(sessions.items()):
            step = steps.get(key)
            if step is None:
                if now - session.last_sent < self._load_report_interval_s and key not in taken:
                    continue  # (a session whose submits were taken in hears of it at once)
                step = self._new_step(load, output)
            step.submits_taken = session.submits_taken
            session.last_sent = now
            session.outbox.put_nowait(step)
            if session.input_closed and not session.live:
                session.outbox.put_nowait(None)

    def _new_step(self, load: engine_pb2.EngineLoad, output: LoopOutput) -> engine_pb2.EngineStep:
        return engine_pb2.EngineStep(
            load=load,
            step_index=self._step_index,
            step_time_ms=output.step_time_s * 1000.0,
            num_batched_tokens=output.num_batched_tokens,
        )

    def _step_message(
        self,
        updates: Sequence[engine_pb2.SequenceUpdate],
        load: EngineLoad,
        output: LoopOutput | None = None,
    ) -> engine_pb2.EngineStep:
        return engine_pb2.EngineStep(
            updates=updates,
            load=load_to_pb(load),
            step_index=self._step_index,
            step_time_ms=output.step_time_s * 1000.0 if output else 0.0,
            num_batched_tokens=output.num_batched_tokens if output else 0,
        )

    def _close(self, session: _Session, engine_loop: EngineLoop) -> None:
        self._sessions.pop(session.key, None)
        if session.live:
            engine_loop.abort([session.internal_id(rid) for rid in session.live])
            log.info("session %s closed: aborted %d requests", session.key, len(session.live))
            session.live.clear()


def _refusal(request_id: str, code: str, message: str) -> engine_pb2.SequenceUpdate:
    return rejection_to_pb(request_id, Rejection(request_id, code, message))


async def serve(
    config: WorkerConfig, *, stop_event: asyncio.Event | None = None, freeze_heap: bool = False
) -> None:
    """Run the worker until `stop_event` is set (or SIGINT/SIGTERM when none is given)."""
    from services.engine.llm_engine import LLMEngine

    log.info("%s\n%s", describe(config.network), describe(config.engine))
    # The forward thread and the gRPC thread share the GIL: a small model's whole step could
    # otherwise wait out Python's default 5 ms interval.
    sys.setswitchinterval(event_loop.GIL_SWITCH_INTERVAL_S)
    metrics.start_metrics_server(config.network.metrics_port)
    tracing.configure(config.tracing, "sluice-engine")
    servicer = EngineServicer(load_report_interval_s=config.network.load_report_interval_s)
    running = await start_server(
        config.network.address,
        lambda server: engine_pb2_grpc.add_EngineServicer_to_server(servicer, server),
        [SERVICE_NAME],
    )
    if stop_event is None:
        stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop_event.set)
    engine_loop: EngineLoop | None = None
    try:
        engine = await asyncio.to_thread(LLMEngine, config.engine)
        if config.engine.warm_up:  # every step shape once before SERVING (engine/warmup.py)
            report = await asyncio.to_thread(engine.warm_up)
            log.info(
                "engine %s on %s: %s", engine.info.model_name, engine.info.device, report.summary()
            )
        engine_loop = servicer.attach(engine, asyncio.get_running_loop())
        if freeze_heap:  # the model and imports: never walked by a collection again
            await asyncio.to_thread(freeze_startup_heap)
        await running.set_serving(True)
        log.info("engine %s serving on port %d", servicer.engine_id, running.port)
        await stop_event.wait()
    finally:
        await running.stop(config.network.shutdown_grace_s)
        if engine_loop is not None:
            await asyncio.to_thread(engine_loop.stop)
            served = servicer._engine
            if served is not None:
                served.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """`sluice serve engine`: parse flags, serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = WorkerConfig.from_argv(argv)
    except SluiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    try:
        event_loop.run(serve(config, freeze_heap=True))  # this process serves until it ends
    except SluiceError as exc:  # e.g. the model cannot be found or loaded
        log.error("engine worker failed: %s: %s", exc.code, exc.message)
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
