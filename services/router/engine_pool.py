"""The engines the router feeds: one EngineSession stream per engine, its load, its requests.

Each `EngineConnection` keeps one bidirectional `EngineSession` open. Submits and aborts are
buffered and written as ONE `EngineRequest` per event-loop turn; the engine answers with one
`EngineStep` per forward step for all its sequences, handed to `on_step`. The connection keeps
the engine's `EngineCapacity` (from `Info` and every step's load) for the dispatch policy.
When the stream breaks, `on_lost(engine_id)` lets the router fail that engine's requests with
UNAVAILABLE at once, and the connection retries with exponential backoff.
`EnginePool` owns the connections and follows the discovery source's address list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common import errors
from services.common.errors import UnavailableError
from services.common.grpc_channel import open_channel
from services.router.discovery import EngineDiscovery
from services.router.dispatch import EngineCapacity

log = logging.getLogger(__name__)

StepHandler = Callable[[str, engine_pb2.EngineStep], None]
LostHandler = Callable[[str], None]


class EngineConnection:
    """One engine: its session stream, the router's view of its capacity, its outbox."""

    def __init__(
        self,
        address: str,
        on_step: StepHandler,
        on_lost: LostHandler,
        on_ready: Callable[[], None],
        *,
        max_inflight: int = 0,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.engine_id = address
        self.address = address
        self.capacity = EngineCapacity(engine_id=address, max_inflight=max_inflight)
        self.info: engine_pb2.EngineInfo | None = None
        self.last_load: engine_pb2.EngineLoad | None = None  # for router/queue_delay.py
        self._on_step = on_step
        self._on_lost = on_lost
        self._on_ready = on_ready
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._channel = open_channel(address)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        self._submits: list[engine_pb2.SubmitRequest] = []
        self._aborts: list[str] = []
        # The router's pacing the engine should gather held tokens by (tokens per update, max
        # hold ms), and what the current EngineSession was last told (None: nothing yet).
        self._pacing: tuple[int, int] = (1, 0)
        self._sent_pacing: tuple[int, int] | None = None
        self._outbox_ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Submits sent on the EngineSession stream, and those the engine's last step did not
        # count as taken in yet, (number, prompt tokens) in sending order: their tokens are
        # queued at the engine but not in the load it reported (router/queue_delay.py).
        self._sent_submits = 0
        self._untaken: deque[tuple[int, int]] = deque()
        self._untaken_tokens = 0
        # Whether the engine counts them (EngineStep.submits_taken): unknown until a step says
        # so (None), False for an engine before the field (it reports updates, never a count).
        self._engine_counts_submits: bool | None = None

    @property
    def ready(self) -> bool:
        return self.capacity.ready

    @property
    def unreported(self) -> tuple[int, int]:
        """(requests, prompt tokens) sent to the engine and not yet in the load it reported."""
        return len(self._untaken), self._untaken_tokens

    def _count_sent(self, submits: list[engine_pb2.SubmitRequest]) -> None:
        """Number the submits of a message as the engine will count them, in sending order."""
        if self._engine_counts_submits is False:
            return
        for submit in submits:
            self._sent_submits += 1
            tokens = len(submit.prompt_token_ids)
            self._untaken.append((self._sent_submits, tokens))
            self._untaken_tokens += tokens

    def _note_taken(self, taken: int, has_updates: bool = False) -> None:
        """The engine's step counted the first `taken` submits of the stream as taken in
        (`has_updates`: the step carried updates of the stream's requests, so a count of 0
        means an engine that does not count)."""
        if taken:
            self._engine_counts_submits = True
        elif self._engine_counts_submits is None and has_updates:
            self._engine_counts_submits = False  # nothing to go by: the report as it is
        if self._engine_counts_submits is False:
            self._untaken.clear()
            self._untaken_tokens = 0
            return
        untaken = self._untaken
        while untaken and untaken[0][0] <= taken:
            self._untaken_tokens -= untaken.popleft()[1]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"engine-session-{self.address}"
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._channel.close()

    def submit(self, submit: engine_pb2.SubmitRequest) -> None:
        if not self.capacity.ready:
            raise UnavailableError(f"engine {self.address} is not connected")
        self._submits.append(submit)
        self._outbox_ready.set()

    async def inspect_adapter(
        self, name: str, path: str, timeout_s: float
    ) -> common_pb2.AdapterSpec:
        """The engine's check of an adapter directory (its status comes back as a SluiceError)."""
        request = engine_pb2.InspectAdapterRequest(name=name, path=path)
        try:
            return await self._stub.InspectAdapter(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _sluice_error(exc, self.address) from None

    def set_pacing(self, tokens_per_update: int, max_hold_ms: int) -> None:
        """Tell the engine (with the next message) how many tokens an update may gather."""
        pacing = (tokens_per_update, max_hold_ms)
        if pacing != self._pacing:
            self._pacing = pacing
            self._outbox_ready.set()

    def abort(self, request_id: str) -> None:
        if not self.capacity.ready:
            return  # the engine aborts everything of a dropped session itself
        self._aborts.append(request_id)
        self._outbox_ready.set()

    async def _run(self) -> None:
        backoff = self._min_backoff_s
        while True:
            try:
                info = await self._stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)
                call = self._stub.EngineSession()
                self._connected(info)
                backoff = self._min_backoff_s
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
                log.warning("engine %s unavailable: %s", self.address, _describe(exc))
            if self.capacity.ready:
                self.capacity.ready = False
                self._submits.clear()
                self._aborts.clear()
                self._on_lost(self.engine_id)
                self._on_ready()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    def _connected(self, info: engine_pb2.EngineInfo) -> None:
        self.info = info
        capacity = self.capacity
        capacity.max_num_seqs = info.max_num_seqs or 1
        capacity.engine_max_inflight = info.max_inflight  # 0 from an engine before the field
        capacity.max_model_len = info.max_model_len
        capacity.block_size = info.block_size or 16
        capacity.total_blocks = info.num_blocks
        capacity.free_blocks = info.load.free_blocks if info.HasField("load") else info.num_blocks
        capacity.reserved_blocks = 0
        capacity.inflight = 0
        capacity.adapters_inflight = {}
        capacity.note_adapters(
            tuple(info.load.resident_adapters),
            tuple(info.load.loading_adapters),
            info.max_loras or info.load.lora_slots,
            time.monotonic(),
            info.load.lora_adapter_capacity,
        )
        self._submits.clear()
        self._aborts.clear()
        self._sent_submits = self._untaken_tokens = 0
        self._untaken.clear()
        self._engine_counts_submits = None
        self._sent_pacing = None  # a new session: tell it the pacing with its first message
        capacity.ready = True
        lora = ""
        if capacity.lora_slots:
            lora = f" lora_slots={capacity.lora_slots} lora_adapter_capacity={capacity.adapter_cap}"
        log.info(
            "engine %s ready: model=%s max_model_len=%d blocks=%d max_num_seqs=%d in flight %d%s",
            self.address,
            info.model,
            info.max_model_len,
            info.num_blocks,
            info.max_num_seqs,
            capacity.slot_limit,
            lora,
        )
        self._on_ready()

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            pacing = self._pacing if self._pacing != self._sent_pacing else None
            if not self._submits and not self._aborts and pacing is None:
                continue
            message = engine_pb2.EngineRequest(submits=self._submits, aborts=self._aborts)
            if pacing is not None:
                message.pacing.tokens_per_update, message.pacing.max_hold_ms = pacing
                self._sent_pacing = pacing
            self._count_sent(self._submits)
            self._submits = []
            self._aborts = []
            await call.write(message)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        on_step = self._on_step
        capacity = self.capacity
        engine_id = self.engine_id
        while True:
            step = await call.read()
            if step is grpc.aio.EOF:
                raise UnavailableError("engine session closed by the engine")
            load = step.load
            capacity.free_blocks = load.free_blocks
            self.last_load = load
            self._note_taken(step.submits_taken, len(step.updates) > 0)
            if load.total_blocks:
                capacity.total_blocks = load.total_blocks
            capacity.reserved_blocks = 0
            if load.lora_slots or load.resident_adapters:
                capacity.note_adapters(
                    tuple(load.resident_adapters),
                    tuple(load.loading_adapters),
                    load.lora_slots,
                    time.monotonic(),
                    load.lora_adapter_capacity,
                )
            on_step(engine_id, step)


class EnginePool:
    """All engine connections, following the discovery source."""

    def __init__(
        self,
        discovery: EngineDiscovery,
        on_step: StepHandler,
        on_lost: LostHandler,
        on_ready: Callable[[], None],
        *,
        max_inflight: int = 0,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 1.0,
    ) -> None:
        self._discovery = discovery
        self._on_step = on_step
        self._on_lost = on_lost
        self._on_ready = on_ready
        self._max_inflight = max_inflight
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self.connections: dict[str, EngineConnection] = {}
        self.pacing: tuple[int, int] = (1, 0)  # (tokens per update, max hold ms) for engines

    def set_pacing(self, tokens_per_update: int, max_hold_ms: int) -> None:
        """The router's pacing, for every engine session (SubmitRequest.hold_tokens)."""
        self.pacing = (tokens_per_update, max_hold_ms)
        for connection in self.connections.values():
            connection.set_pacing(tokens_per_update, max_hold_ms)

    async def refresh(self) -> None:
        """Connect to new addresses and drop vanished ones."""
        wanted = set(await self._discovery.addresses())
        for address in list(self.connections):
            if address not in wanted:
                connection = self.connections.pop(address)
                if connection.ready:
                    connection.capacity.ready = False
                    self._on_lost(address)
                    self._on_ready()
                await connection.close()
        for address in wanted:
            if address not in self.connections:
                connection = EngineConnection(
                    address,
                    self._on_step,
                    self._on_lost,
                    self._on_ready,
                    max_inflight=self._max_inflight,
                    min_backoff_s=self._min_backoff_s,
                    max_backoff_s=self._max_backoff_s,
                )
                self.connections[address] = connection
                connection.set_pacing(*self.pacing)
                connection.start()

    def capacities(self) -> list[EngineCapacity]:
        return [c.capacity for c in self.connections.values() if c.capacity.ready]

    def ready_connections(self) -> list[EngineConnection]:
        return [c for c in self.connections.values() if c.ready]

    def get(self, engine_id: str | None) -> EngineConnection | None:
        return self.connections.get(engine_id) if engine_id else None

    async def close(self) -> None:
        for connection in list(self.connections.values()):
            await connection.close()
        self.connections.clear()


_STATUS_ERRORS = {
    "INVALID_ARGUMENT": errors.InvalidArgumentError,
    "NOT_FOUND": errors.NotFoundError,
    "FAILED_PRECONDITION": errors.FailedPreconditionError,
    "ALREADY_EXISTS": errors.AlreadyExistsError,
    "RESOURCE_EXHAUSTED": errors.ResourceExhaustedError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceededError,
}


def _sluice_error(exc: grpc.aio.AioRpcError, address: str) -> errors.SluiceError:
    """An engine's answer as the error the router gives its own caller."""
    code = exc.code().name
    error_type = _STATUS_ERRORS.get(code)
    if error_type is not None:
        return error_type(exc.details() or code)
    if code == "UNIMPLEMENTED":
        return errors.FailedPreconditionError(f"engine {address} cannot check adapters")
    return UnavailableError(f"engine {address} could not check the adapter: {code}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
