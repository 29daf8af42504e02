"""The open-loop run: each request leaves at its scheduled time, never waiting on answers.

All arrival times are fixed before the run. With one process, this process's event loop sends
them (`schedule.py`); when one process cannot keep up, ``--workers N`` starts N load-generator
processes (`workers.py`), each sending its share the same way. Every request records when it
was scheduled, when it was dispatched and when its call actually left; with
``--max-concurrency`` a dispatched request waits for a slot and that wait is recorded too.
A warning is printed when dispatch lag grows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from loadtest.datasets import RequestSpec
from loadtest.records import RequestRecord
from loadtest.schedule import (
    START_MARGIN_S,
    ClientOptions,
    LagMonitor,
    RunResult,
    dispatch_lag_s,
    run_in_loop,
)
from loadtest.workers import run_processes
from services.common.errors import InvalidArgumentError


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
    return run_processes(specs, times_s, options, max_concurrency, workers, done, monitor, on_start)
