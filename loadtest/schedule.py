"""One event loop's part of a run: a client sends its requests at their scheduled times.

`run_schedule` sleeps until each absolute time and starts that request as its own task, never
waiting on answers, so a slow server can only show up as latency. `run_in_loop` makes and
starts the client first. Both the single-process run (`runner.py`) and each load-generator
process (`workers.py`) use this module, which is why it stands on its own: neither of those
two imports the other's internals.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loadtest.datasets import RequestSpec
from loadtest.records import RequestRecord
from services.common.errors import InvalidArgumentError

START_MARGIN_S = 0.05
_LAG_WARNING_EVERY_S = 5.0
# Retries of refused requests: the wait without a server hint, and the longest wait taken.
DEFAULT_RETRY_AFTER_S = 1.0
MAX_RETRY_WAIT_S = 30.0


@dataclass(frozen=True)
class ClientOptions:
    """Which target to load and how (picklable: it travels to worker processes)."""

    target: str | None = None
    openai_url: str | None = None
    model: str | None = None
    grpc_channels: int = 4
    timeout_s: float | None = 600.0
    temperature: float = 0.0
    api_key: str | None = None
    # A request refused with RESOURCE_EXHAUSTED before any token is sent again after the
    # server's retry-after, up to this many times; its TTFT counts from the first send.
    retries: int = 0

    def make_client(self) -> object:
        """A GrpcClient or OpenAIClient (not started)."""
        if (self.target is None) == (self.openai_url is None):
            raise InvalidArgumentError("give exactly one of --target HOST:PORT and --openai-url")
        if self.target is not None:
            from loadtest.grpc_client import GrpcClient

            return GrpcClient(
                self.target,
                channels=self.grpc_channels,
                timeout_s=self.timeout_s,
                temperature=self.temperature,
                api_key=self.api_key,
            )
        from loadtest.openai_client import OpenAIClient

        return OpenAIClient(
            self.openai_url or "",
            model=self.model,
            timeout_s=self.timeout_s,
            temperature=self.temperature,
            api_key=self.api_key,
        )


@dataclass
class RunResult:
    """Records (by index) of a finished run and its wall-clock start."""

    records: list[RequestRecord]
    start_epoch_s: float
    warnings: list[str] = field(default_factory=list)


def run_clock(start_epoch_s: float) -> Callable[[], float]:
    """Seconds since `start_epoch_s` (a wall time shared by processes), perf_counter-precise."""
    offset = time.time() - time.perf_counter()
    return lambda: time.perf_counter() + offset - start_epoch_s


def dispatch_lag_s(record: RequestRecord) -> float | None:
    """How late the scheduler released a request (before any concurrency-slot wait)."""
    return None if record.dispatched_s is None else record.dispatched_s - record.scheduled_s


class LagMonitor:
    """Warns (at most every few seconds) when requests leave later than scheduled."""

    def __init__(self, threshold_ms: float, emit: Callable[[str], None]) -> None:
        self.threshold_ms = threshold_ms
        self._threshold_s = threshold_ms / 1000.0
        self._emit = emit
        self._last_warning = -float("inf")
        self.warnings: list[str] = []

    def observe(self, index: int, dispatch_lag_s: float | None) -> None:
        """Called as each request is dispatched, with how late that was."""
        if dispatch_lag_s is None or dispatch_lag_s <= self._threshold_s:
            return
        now = time.monotonic()
        if now - self._last_warning < _LAG_WARNING_EVERY_S:
            return
        self._last_warning = now
        message = (
            f"warning: request {index} left {dispatch_lag_s * 1000:.1f} ms after its scheduled "
            "time; the load generator is falling behind (try --workers N)"
        )
        self.relay(message)

    def relay(self, message: str) -> None:
        """Keep and show a warning (also one raised in a worker process)."""
        self.warnings.append(message)
        self._emit(message)


async def run_schedule(
    specs: Sequence[RequestSpec],
    times_s: Sequence[float],
    client: object,
    *,
    start_epoch_s: float,
    max_concurrency: int | None = None,
    worker: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
    on_dispatch: Callable[[RequestRecord], None] | None = None,
    retries: int = 0,
) -> list[RequestRecord]:
    """Send `specs[i]` at `times_s[i]` seconds after `start_epoch_s`; return their records.
    A request refused with RESOURCE_EXHAUSTED (no token yet) goes again after the server's
    retry-after (DEFAULT_RETRY_AFTER_S without one, at most MAX_RETRY_WAIT_S), up to `retries`
    times; its send time stays the first one, so its TTFT includes the waits."""
    if len(specs) != len(times_s):
        raise InvalidArgumentError("one scheduled time per request is needed")
    clock = run_clock(start_epoch_s)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [
        RequestRecord(
            index=spec.index,
            scheduled_s=float(at),
            adapter=spec.adapter,
            input_tokens=spec.input_tokens,
            expected_output_tokens=spec.output_tokens,
            worker=worker,
        )
        for spec, at in zip(specs, times_s, strict=True)
    ]

    async def attempt(spec: RequestSpec, record: RequestRecord) -> None:
        try:
            await client.send(spec, record, clock)  # type: ignore[attr-defined]
        except Exception as error:  # noqa: BLE001 - one broken request must not end the run
            record.status = "UNKNOWN"
            record.error = f"{type(error).__name__}: {error}"
            if record.sent_s is None:
                record.sent_s = clock()
            record.finished_s = clock()

    async def send(spec: RequestSpec, record: RequestRecord) -> None:
        await attempt(spec, record)
        first_sent = record.sent_s
        while record.status == "RESOURCE_EXHAUSTED" and not record.output_tokens:
            if record.retries >= retries:
                break
            wait = record.retry_after_s
            wait = DEFAULT_RETRY_AFTER_S if wait is None else wait
            await asyncio.sleep(min(max(wait, 0.0), MAX_RETRY_WAIT_S))
            record.retries += 1
            record.status, record.error, record.retry_after_s = "UNKNOWN", "", None
            await attempt(spec, record)
        record.sent_s = first_sent if first_sent is not None else record.sent_s

    async def one(spec: RequestSpec, record: RequestRecord) -> None:
        if slots is None:
            await send(spec, record)
        else:
            async with slots:
                await send(spec, record)
        if on_done is not None:
            on_done(record)

    tasks = []
    for spec, record in zip(specs, records, strict=True):
        delay = record.scheduled_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        record.dispatched_s = clock()
        tasks.append(asyncio.create_task(one(spec, record)))
        if on_dispatch is not None:
            on_dispatch(record)
    await asyncio.gather(*tasks)
    return records


async def run_in_loop(
    specs: Sequence[RequestSpec],
    times_s: Sequence[float],
    options: ClientOptions,
    max_concurrency: int | None,
    worker: int,
    on_done: Callable[[RequestRecord], None] | None,
    on_dispatch: Callable[[RequestRecord], None] | None = None,
    start_epoch_s: float | None = None,
    ready: Callable[[], float] | None = None,
) -> list[RequestRecord]:
    """Start a client in the running loop, wait for the start signal, run the schedule."""
    client = options.make_client()
    await client.start()  # type: ignore[attr-defined]
    try:
        start = ready() if ready is not None else start_epoch_s
        return await run_schedule(
            specs,
            times_s,
            client,
            start_epoch_s=float(start if start is not None else time.time() + START_MARGIN_S),
            max_concurrency=max_concurrency,
            worker=worker,
            on_done=on_done,
            on_dispatch=on_dispatch,
            retries=options.retries,
        )
    finally:
        await client.close()  # type: ignore[attr-defined]
