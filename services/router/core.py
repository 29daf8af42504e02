"""The router's domain core: validate, admit, dispatch, and release requests.

`RouterCore` ties the parts together without owning their logic: the `AdmissionQueue` bounds
what waits, the `DispatchPolicy` places it on engines, the `EnginePool` streams it there, the
`OutputStreamer` brings text back, the `AdapterRegistry` says which LoRA adapters requests may
name (and what engines load for them), and every request's resources (queue entry, engine slot,
engine sequence, detokenizer state) are released exactly once in `end_request`. It runs on
one asyncio loop; nothing here blocks. The servicer (server.py) only converts and awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from protos.sluice.v1 import router_pb2, tokenizer_pb2
from services.common.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    SluiceError,
    UnavailableError,
)
from services.common.protocol.codec import sampling_params_from_pb
from services.common.protocol.sampling_params import SamplingParams, validate_prompt_token_ids
from services.router import metrics
from services.router.adapter_registry import AdapterRegistry
from services.router.admission import AdmissionQueue
from services.router.auth import ApiKeyAuthenticator
from services.router.config import RouterConfig
from services.router.convert import submit_pb, tokenize_item
from services.router.discovery import EngineDiscovery, StaticDiscovery
from services.router.dispatch import DispatchPolicy
from services.router.engine_pool import EnginePool
from services.router.idempotency import IdempotencyCache
from services.router.lora_batcher import LoraAwarePolicy
from services.router.pacing import StreamPacing
from services.router.queue_delay import QueueDelayGate
from services.router.rate_limit import RateLimiter
from services.router.request import RequestState, RouterRequest
from services.router.streaming import OutputStreamer
from services.router.tokenizer_pool import TokenizerPool

log = logging.getLogger(__name__)

EXPIRY_SWEEP_INTERVAL_S = 0.005
MAX_REQUEST_ID_CHARS = 256  # echoed in every response, so kept short


class RouterCore:
    """See the module docstring."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        discovery: EngineDiscovery | None = None,
        policy: DispatchPolicy | None = None,
        authenticator: Any = None,
        rate_limiter: RateLimiter | None = None,
        idempotency: IdempotencyCache | None = None,
        adapters: AdapterRegistry | None = None,
    ) -> None:
        self.config = config
        self.queue = AdmissionQueue(
            config.max_queued_requests,
            config.max_queued_tokens,
            min_retry_after_s=config.retry_after_s,
        )
        self.delay_gate = QueueDelayGate(
            config.max_queue_delay_s, min_retry_after_s=config.retry_after_s
        )
        self.policy = policy or LoraAwarePolicy(
            max_wait_s=config.lora_max_wait_s, swap_cost_s=config.lora_swap_cost_s
        )
        self.adapters = adapters if adapters is not None else AdapterRegistry()
        metrics.ADAPTER_GAUGES.bind(self._adapter_report)
        # `check(metadata)` raises UNAUTHENTICATED or returns the caller (key_id, limits) or None.
        self.auth = authenticator or ApiKeyAuthenticator.from_file(config.api_keys_file)
        self.rate_limiter = rate_limiter
        self.idempotency = idempotency
        self.running: dict[str, RouterRequest] = {}
        self.active: set[RouterRequest] = set()
        self.tokenizer = TokenizerPool(
            config.tokenizer_addresses,
            self._on_detokenized,
            self._tokenizer_lost,
            tokenize_timeout_s=config.tokenize_timeout_s,
            min_backoff_s=config.reconnect_min_backoff_s,
            max_backoff_s=config.reconnect_max_backoff_s,
        )
        self.tokenizer.ready_changed = self._readiness_changed
        self.pacing = StreamPacing(
            config.stream_interval,
            message_budget=config.stream_message_budget,
            max_interval=config.stream_max_interval,
            max_hold_s=config.stream_max_hold_ms / 1e3,
        )
        self.streamer = OutputStreamer(self.running, self.tokenizer, self, self.pacing)
        self.pool = EnginePool(
            discovery or StaticDiscovery(config.engines),
            self.streamer.on_step,
            self._engine_lost,
            self._readiness_changed,
            max_inflight=config.max_inflight_per_engine,
            min_backoff_s=config.reconnect_min_backoff_s,
            max_backoff_s=config.reconnect_max_backoff_s,
        )
        self.draining = False
        self.on_readiness: Callable[[bool], None] | None = None
        self._serving = False
        self._opened = asyncio.Event()  # set while serving: admission waits on it
        self._ids = itertools.count(1)
        self._id_prefix = f"{int(time.time() * 1000) % 10**8:x}-"
        self._dispatch_scheduled = False
        self._last_expiry_sweep = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._pacer: asyncio.Task | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.tokenizer.start()
        self._tell_engines_the_pacing()
        if self.pacing.adaptive:
            self._pacer = asyncio.create_task(self._sweep_held())
        await self.pool.refresh()

    def _tell_engines_the_pacing(self) -> None:
        """Engines gather held tokens by the router's interval and hold limit
        (engine/coalesce.py); an update of several tokens is then due here at once."""
        pacing = self.pacing
        self.pool.set_pacing(pacing.interval, max(1, round(pacing.max_hold_s * 1e3)))

    async def _sweep_held(self) -> None:
        """Adaptive pacing: flush tokens held back longer than the hold limit; decay the rate."""
        pacing = self.pacing
        while True:
            await asyncio.sleep(pacing.max_hold_s / 2)
            now = time.monotonic()
            pacing.idle(now)
            self._tell_engines_the_pacing()
            metrics.ROUTER_STREAM_INTERVAL.set(pacing.interval)
            metrics.ROUTER_STREAMED_TOKENS_PER_SECOND.set(pacing.tokens_per_s)
            held_before = now - pacing.max_hold_s
            self.streamer.flush_undecoded(held_before)
            for request in self.running.values():
                request.flush_held(held_before)

    async def close(self) -> None:
        metrics.ADAPTER_GAUGES.unbind(self._adapter_report)
        if self._pacer is not None:
            self._pacer.cancel()
        for request in list(self.active):
            self.end_request(request, UnavailableError("the router is shutting down"))
        await self.pool.close()
        await self.tokenizer.close()

    @property
    def serving(self) -> bool:
        return not self.draining and self.tokenizer.ready and bool(self.pool.ready_connections())

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting; wait up to `grace_s` for admitted requests. True when all finished."""
        self.draining = True
        self._readiness_changed()
        log.info("draining: %d requests in flight, grace %.1fs", len(self.active), grace_s)
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return True
        except TimeoutError:
            return False

    # ---- admission ---------------------------------------------------------------------------
    async def admit(
        self,
        message: router_pb2.GenerateRequest,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        time_remaining: float | None,
    ) -> RouterRequest:
        """Validate, tokenize and queue one request, or raise the SluiceError for the caller."""
        try:
            return await self._admit(message, metadata, time_remaining)
        except SluiceError as error:
            metrics.ROUTER_REJECTED_REQUESTS.labels(reason=_reject_reason(error)).inc()
            raise

    async def _admit(
        self,
        message: router_pb2.GenerateRequest,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        time_remaining: float | None,
    ) -> RouterRequest:
        arrival = time.monotonic()
        request_id = f"{self._id_prefix}{next(self._ids)}"
        caller = self.auth.check(metadata)
        await self._wait_until_open(None if time_remaining is None else arrival + time_remaining)
        params = (
            sampling_params_from_pb(message.params)
            if message.HasField("params")
            else SamplingParams()
        )
        if len(message.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgumentError(
                f"request_id may have at most {MAX_REQUEST_ID_CHARS} characters"
            )
        adapter_record = None
        if message.adapter:
            adapter_record = await self.adapters.lookup(message.adapter)
            if adapter_record is None:
                raise NotFoundError(
                    f"unknown adapter {message.adapter[:MAX_REQUEST_ID_CHARS]!r} (see "
                    "`sluice adapters list`)"
                )
        self.queue.check_room(0)  # reject at once, before the tokenizer round trip
        self.delay_gate.check(self.pool.ready_connections(), *self.queue.ahead_of(message.priority))
        deadline = None if time_remaining is None else arrival + time_remaining
        engines = self.pool.capacities()
        max_model_len = min(e.max_model_len for e in engines)
        vocab_size = min(c.info.vocab_size for c in self.pool.ready_connections() if c.info)
        tokenized_at = 0.0
        if message.WhichOneof("input") == "prompt_token_ids":
            prompt_ids = list(message.prompt_token_ids.ids)
            validate_prompt_token_ids(prompt_ids, vocab_size)
        else:
            item = tokenize_item(message, max_model_len)
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise DeadlineExceededError("the deadline passed before tokenizing")
            prompt_ids = await self.tokenizer.tokenize(item, timeout)
            tokenized_at = time.monotonic()
        params.validate_for_model(len(prompt_ids), max_model_len, vocab_size)
        if self.rate_limiter is not None and caller is not None:
            await self.rate_limiter.acquire(
                caller.key_id, tokens=len(prompt_ids) + params.max_tokens, limits=caller.limits
            )
        self._check_open()
        request = RouterRequest(
            request_id=request_id,
            client_request_id=message.request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            adapter=message.adapter,
            adapter_record=adapter_record,
            priority=message.priority,
            deadline=deadline,
            arrival=arrival,
            tokenized_at=tokenized_at,
            pacing=self.pacing,
        )
        if request.expired():
            raise DeadlineExceededError("the deadline passed before the request was queued")
        self.queue.admit(request)
        self.active.add(request)
        self._idle.clear()
        metrics.ROUTER_ADMITTED_REQUESTS.inc()
        self._update_queue_gauges()
        self.schedule_dispatch()
        return request

    async def _wait_until_open(self, deadline: float | None) -> None:
        """Wait (up to `ready_wait_s` and the deadline) for a ready tokenizer and engine.

        A restarting tokenizer or engine is back within seconds: a request that arrives
        meanwhile waits for it instead of failing, so only the requests that were on the lost
        process fail. Draining, or no peer within the wait: UNAVAILABLE."""
        if self.serving or self.draining:
            self._check_open()
            return
        limit = time.monotonic() + self.config.ready_wait_s
        if deadline is not None:
            limit = min(limit, deadline)
        while not self.serving and not self.draining:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._opened.wait(), remaining)
        self._check_open()

    def _check_open(self) -> None:
        if self.draining:
            raise UnavailableError("the router is draining (shutting down); retry elsewhere")
        if not self.tokenizer.ready:
            raise UnavailableError("no tokenizer is ready")
        if not self.pool.ready_connections():
            raise UnavailableError("no engine is ready")

    # ---- dispatch ----------------------------------------------------------------------------
    def schedule_dispatch(self) -> None:
        if not self._dispatch_scheduled:
            self._dispatch_scheduled = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._dispatch_scheduled = False
        if not len(self.queue):
            return
        now = time.monotonic()
        if now - self._last_expiry_sweep >= EXPIRY_SWEEP_INTERVAL_S:
            self._last_expiry_sweep = now
            for request in self.queue.drop_expired(now):
                request.fail(DeadlineExceededError("the deadline passed while queued"))
        for placement in self.policy.schedule(self.queue, self.pool.capacities()):
            request = placement.request
            connection = self.pool.get(placement.engine_id)
            request.mark_running(placement.engine_id)
            request.holds_engine_slot = True
            request.placed_at = now
            self.running[request.request_id] = request
            connection.submit(submit_pb(request))
        self._update_queue_gauges()
        metrics.ROUTER_RUNNING_REQUESTS.set(len(self.running))

    def capacity_changed(self) -> None:
        if len(self.queue):
            self.schedule_dispatch()

    # ---- release -----------------------------------------------------------------------------
    def engine_finished(self, request: RouterRequest) -> None:
        """The engine no longer holds the request: its slot is free."""
        if request.holds_engine_slot:
            request.holds_engine_slot = False
            connection = self.pool.get(request.engine_id)
            if connection is not None and connection.capacity.inflight > 0:
                connection.capacity.inflight -= 1
            if connection is not None and request.adapter:
                connection.capacity.release_adapter(request.adapter)

    def end_request(self, request: RouterRequest, error: SluiceError | None) -> None:
        """Release everything the request holds; fail it with `error` if it is still open."""
        if request.state is RequestState.QUEUED:
            self.queue.remove(request)
        self.running.pop(request.request_id, None)
        if not request.engine_done and request.engine_id is not None:
            request.engine_done = True
            connection = self.pool.get(request.engine_id)
            if connection is not None:
                connection.abort(request.request_id)
        self.engine_finished(request)
        if request.detokenizer_open:
            request.detokenizer_open = False
            if self.tokenizer.ready:
                self.tokenizer.send(
                    tokenizer_pb2.DetokenizeRequest(
                        updates=[
                            tokenizer_pb2.DetokenizeUpdate(
                                request_id=request.request_id, cancel=True
                            )
                        ],
                        sequence_number=self.tokenizer.next_sequence_number(),
                    )
                )
        if error is not None:
            request.fail(error)
        else:
            request.close()
        self.capacity_changed()

    def release(self, request: RouterRequest) -> None:
        """The servicer is done with the request (finished, failed, or the client left)."""
        self.end_request(request, None)
        self.active.discard(request)
        if not self.active:
            self._idle.set()
        self._update_queue_gauges()
        metrics.ROUTER_RUNNING_REQUESTS.set(len(self.running))

    # ---- events from the connections ---------------------------------------------------------
    def _on_detokenized(self, response: tokenizer_pb2.DetokenizeResponse) -> None:
        self.streamer.on_detokenized(response)

    def _engine_lost(self, engine_id: str) -> None:
        # Requests the engine already finished only wait for their last text: let them end.
        lost = [r for r in self.running.values() if r.engine_id == engine_id and not r.engine_done]
        log.warning("engine %s lost with %d requests in flight", engine_id, len(lost))
        for request in lost:
            request.engine_done = True
            request.holds_engine_slot = False
            self.end_request(request, UnavailableError(f"engine {engine_id} went away"))

    def _tokenizer_lost(self, request_ids: set[str], sequence_numbers: set[int]) -> None:
        """A tokenizer replica went away: the requests whose text state it held fail."""
        lost = {rid: self.running[rid] for rid in request_ids if rid in self.running}
        for request in self.streamer.forget_pending(sequence_numbers):
            if request.request_id in self.running:  # its last text was on the way there
                lost.setdefault(request.request_id, request)
        log.warning("tokenizer lost with %d requests in flight on it", len(lost))
        for request in lost.values():
            request.detokenizer_open = False
            self.end_request(request, UnavailableError("the tokenizer went away"))

    def _readiness_changed(self) -> None:
        serving = self.serving
        if serving:
            self._opened.set()
        else:
            self._opened.clear()
        if serving != self._serving:
            self._serving = serving
            log.info("router %s", "SERVING" if serving else "NOT_SERVING")
            if self.on_readiness is not None:
                self.on_readiness(serving)
        self.capacity_changed()

    def _adapter_report(self) -> metrics.AdapterReport:
        """Per-adapter queue depth and residency for a Prometheus scrape (another thread)."""
        resident: dict[str, int] = {}
        for connection in list(self.pool.connections.values()):
            if connection.ready:
                for name in connection.capacity.resident_adapters:
                    resident[name] = resident.get(name, 0) + 1
        return metrics.AdapterReport(
            sorted(self.adapters.names()), dict(self.queue.depth_by_adapter()), resident
        )

    def _update_queue_gauges(self) -> None:
        metrics.ROUTER_QUEUE_DEPTH_REQUESTS.set(len(self.queue))
        metrics.ROUTER_QUEUE_DEPTH_TOKENS.set(self.queue.queued_tokens)


def _reject_reason(error: SluiceError) -> str:
    return {
        "RESOURCE_EXHAUSTED": "queue_full",
        "INVALID_ARGUMENT": "invalid",
        "UNAUTHENTICATED": "unauthenticated",
        "DEADLINE_EXCEEDED": "deadline",
        "UNAVAILABLE": "unavailable",
        "NOT_FOUND": "not_found",
    }.get(error.code, "other")
