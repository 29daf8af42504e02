"""Several load-generator processes for one run, when one event loop can't keep up.

Each process (multiprocessing "spawn") gets its share of the schedule, dealt round-robin, and
builds its own event loop and client. All of them report ready, then the parent sets one start
time (wall clock, shared by processes) and releases them together. Messages back to the parent
are JSON text on a local multiprocessing queue: a line per finished request (for progress and
lag warnings) and each worker's full records at the end, merged in request order. With
``--max-concurrency`` each worker enforces its share (cap // workers, at least 1).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue
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
from services.common.errors import UnavailableError


def run_processes(
    specs: Sequence[RequestSpec],
    times_s: Sequence[float],
    options: ClientOptions,
    max_concurrency: int | None,
    workers: int,
    done: Callable[[RequestRecord], None],
    monitor: LagMonitor,
    on_start: Callable[[float], None] | None,
) -> RunResult:
    """Run the schedule over `workers` processes; raise UnavailableError if one dies."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    go = context.Event()
    start_value = context.Value("d", 0.0)
    # Each worker enforces its share of the concurrency cap.
    share = None if max_concurrency is None else max(1, max_concurrency // workers)
    processes = []
    for worker in range(workers):
        part = [
            (spec, at)
            for i, (spec, at) in enumerate(zip(specs, times_s, strict=True))
            if i % workers == worker
        ]
        payload = json.dumps(
            {"specs": [_spec_to_json(s) for s, _ in part], "times": [t for _, t in part]}
        )
        process = context.Process(
            target=_worker_main,
            args=(worker, payload, options, share, monitor.threshold_ms, messages, go, start_value),
            daemon=True,
        )
        process.start()
        processes.append(process)
    ready = 0
    records: list[RequestRecord] = []
    finished: set[int] = set()  # workers that sent their records (and may have exited)
    try:
        while ready < workers:
            kind, _, body = _next_message(messages, processes, finished)
            if kind == "ready":
                ready += 1
            elif kind == "failed":
                raise UnavailableError(f"load generator failed to start: {body}")
        start_value.value = time.time() + START_MARGIN_S
        if on_start is not None:
            on_start(start_value.value)
        go.set()
        while len(finished) < workers:
            kind, worker, body = _next_message(messages, processes, finished)
            if kind == "done":
                done(RequestRecord.from_json(json.loads(body)))
            elif kind == "warn":
                monitor.relay(f"worker {worker}: {body}")
            elif kind == "records":
                records.extend(RequestRecord.from_json(r) for r in json.loads(body))
                finished.add(worker)
            elif kind == "failed":
                raise UnavailableError(f"load generator {worker} failed: {body}")
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
    records.sort(key=lambda r: r.index)
    return RunResult(records, start_value.value, monitor.warnings)


def _next_message(
    messages: multiprocessing.Queue, processes: list, finished: set[int]
) -> tuple[str, int, str]:
    """The next message; UnavailableError once a worker that has not sent its records is gone
    (one that has may exit while the others still run)."""
    while True:
        try:
            return messages.get(timeout=1.0)
        except queue.Empty:
            running = [p for index, p in enumerate(processes) if index not in finished]
            if not all(p.is_alive() for p in running) and messages.empty():
                raise UnavailableError("a load-generator process died") from None


def _spec_to_json(spec: RequestSpec) -> dict:
    return {
        "index": spec.index,
        "input_tokens": spec.input_tokens,
        "output_tokens": spec.output_tokens,
        "prompt_token_ids": list(spec.prompt_token_ids) if spec.prompt_token_ids else None,
        "prompt_text": spec.prompt_text,
        "adapter": spec.adapter,
        "cancel_after_tokens": spec.cancel_after_tokens,
    }


def _spec_from_json(data: dict) -> RequestSpec:
    ids = data.pop("prompt_token_ids")
    return RequestSpec(prompt_token_ids=tuple(ids) if ids is not None else None, **data)


def _worker_main(
    worker: int,
    payload: str,
    options: ClientOptions,
    max_concurrency: int | None,
    lag_warning_ms: float,
    messages: multiprocessing.Queue,
    go: object,
    start_value: object,
) -> None:
    """A load-generator process: its own event loop, client and share of the schedule."""
    try:
        data = json.loads(payload)
        specs = [_spec_from_json(s) for s in data["specs"]]

        def ready() -> float:
            messages.put(("ready", worker, ""))
            go.wait()  # type: ignore[attr-defined]
            return start_value.value  # type: ignore[attr-defined]

        def done(record: RequestRecord) -> None:
            body = record.to_json() | {"finished_s": record.finished_s}
            messages.put(("done", worker, json.dumps(body)))

        # Warnings are raised here, at dispatch, and shown by the parent.
        local = LagMonitor(lag_warning_ms, lambda message: messages.put(("warn", worker, message)))

        def dispatched(record: RequestRecord) -> None:
            local.observe(record.index, dispatch_lag_s(record))

        records = asyncio.run(
            run_in_loop(
                specs,
                data["times"],
                options,
                max_concurrency,
                worker,
                done,
                dispatched,
                ready=ready,
            )
        )
        body = json.dumps([r.to_json(with_chunks=True) for r in records])
        messages.put(("records", worker, body))
    except Exception as error:  # noqa: BLE001 - reported to the parent, which raises
        messages.put(("failed", worker, f"{type(error).__name__}: {error}"))
