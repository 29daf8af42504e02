"""The open-loop runner: sends each request at its scheduled time, never waiting on answers.

All arrival times are fixed before the run. A dispatcher sleeps until each absolute time and
starts that request as its own task, so a slow server can only show up as latency. Every
request records when it was scheduled, when it was dispatched and when its call actually left;
with ``--max-concurrency`` a dispatched request waits for a slot and that wait is recorded too.
When one process cannot keep up, ``--workers N`` starts N load-generator processes
(`workers.py`). A warning is printed when dispatch lag grows.
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
) -> list[RequestRecord]:
    """Send `specs[i]` at `times_s[i]` seconds after `start_epoch_s`; return their records."""
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

    async def send(spec: RequestSpec, record: RequestRecord) -> None:
        try:
            await client.send(spec, record, clock)  # type: ignore[attr-defined]
        except Exception as error:  # noqa: BLE001 - one broken request must not end the run
            record.status = "UNKNOWN"
            record.error = f"{type(error).__name__}: {error}"
            if record.sent_s is None:
                record.sent_s = clock()
            record.finished_s = clock()

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
        )
    finally:
        await client.close()  # type: ignore[attr-defined]


def run(
    specs: Sequence[RequestSpec],
    times_s: Sequence[float],
    options: ClientOptions,
    *,
    max_concurrency: int | None = None,
    workers: int = 1,
    lag_warning_ms: float = 50.0,
    progress: Callable[[RequestRecord], None] | None = None,
    emit: Callable[[str], None] = print,
    on_start: Callable[[float], None] | None = None,
) -> RunResult:
    """Run the whole schedule in this process (workers=1) or in `workers` processes."""
    if workers < 1:
        raise InvalidArgumentError(f"workers must be >= 1, got {workers}")
    if max_concurrency is not None and max_concurrency < 1:
        raise InvalidArgumentError(f"max-concurrency must be >= 1, got {max_concurrency}")
    monitor = LagMonitor(lag_warning_ms, emit)

    def done(record: RequestRecord) -> None:
        if progress is not None:
            progress(record)

    def dispatched(record: RequestRecord) -> None:
        monitor.observe(record.index, dispatch_lag_s(record))

    if workers == 1:
        start = 0.0

        def ready() -> float:
            # Set once the client is connected, so start-up never counts as send lag.
            nonlocal start
            start = time.time() + START_MARGIN_S
            if on_start is not None:
                on_start(start)
            return start

        records = asyncio.run(
            run_in_loop(specs, times_s, options, max_concurrency, 0, done, dispatched, ready=ready)
        )
        return RunResult(sorted(records, key=lambda r: r.index), start, monitor.warnings)
    from loadtest.workers import run_processes

    return run_processes(specs, times_s, options, max_concurrency, workers, done, monitor, on_start)
