"""The load of the stack benchmark: closed-loop streams through the router or straight to an engine.

Both sides get the same load, so their ratio is the stack's cost:
- `concurrency` streams, each sending one greedy `ignore_eos` request at a time and the next as
  soon as its last one finished;
- staggered: stream i's first request asks for max_tokens * (i + 1) / concurrency tokens, so
  requests end (and new ones arrive) spread evenly over steps, as in a steady state, rather
  than all at once every max_tokens steps;
- counted in a window: tokens, requests and first tokens count only between `warmup` and
  `warmup + duration` seconds, and whatever is still running at the end is cancelled, so
  start-up and the tail of the last requests weigh on neither side.

Through the router each stream is one `Generate` call and each response one gRPC message. Straight
to the engine (`engine_run`) all streams share one EngineSession, as the router's do, but every
stream submits its own request in its own EngineRequest message when it is ready (not all
refills of a step in one message); the engine answers with one EngineStep per forward step.
Time to first token: from the stream's submit to the first response with tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos.sluice.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

PROMPTS = (
    "The quick brown fox jumps over the lazy dog because",
    "Write a short poem about the sea and the wind:",
    "Explain how a paged KV cache works in three sentences.",
    "List five cities in Europe and one fact about each:",
)


@dataclass(frozen=True)
class LoadShape:
    """The closed loop both sides run."""

    concurrency: int
    max_tokens: int
    duration_s: float
    warmup_s: float

    def first_max_tokens(self, stream: int) -> int:
        return max(1, round(self.max_tokens * (stream + 1) / self.concurrency))


@dataclass
class RunResult:
    """What one side streamed inside the counting window."""

    name: str
    tokens: int = 0
    requests: int = 0
    responses: int = 0  # messages carrying tokens (router: GenerateResponse; engine: updates)
    seconds: float = 0.0
    ttfts_s: list[float] = field(default_factory=list, repr=False)
    probe_ttfts_s: list[float] = field(default_factory=list, repr=False)  # stack_bench_probe
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # process name -> CPU seconds
    engine_tokens_per_step: float | None = None  # the engine's mean batch in the window

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        tokens = max(self.tokens, 1)
        return {
            "tokens": self.tokens,
            "requests": self.requests,
            "responses": self.responses,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_response": self.tokens / self.responses if self.responses else None,
            "ttft_median_ms": percentile(self.ttfts_s, 0.5) * 1e3,
            "ttft_p90_ms": percentile(self.ttfts_s, 0.9) * 1e3,
            "ttft_samples": len(self.ttfts_s),
            "probe_ttft_median_ms": percentile(self.probe_ttfts_s, 0.5) * 1e3,
            "probe_ttft_p90_ms": percentile(self.probe_ttfts_s, 0.9) * 1e3,
            "probe_samples": len(self.probe_ttfts_s),
            "engine_tokens_per_step": self.engine_tokens_per_step,
            "cpu_us_per_token": {
                name: seconds / tokens * 1e6 for name, seconds in self.cpu_seconds.items()
            },
            "cpu_cores": {
                name: seconds / self.seconds if self.seconds else 0.0
                for name, seconds in self.cpu_seconds.items()
            },
        }


class _Window:
    """The counting window, in time.monotonic() seconds (one clock for every process here)."""

    def __init__(self, shape: LoadShape) -> None:
        now = time.monotonic()
        self.start = now + shape.warmup_s
        self.end = self.start + shape.duration_s

    def inside(self, now: float) -> bool:
        return self.start <= now < self.end


# Told the counting window's (start, end) as the load starts, so that whoever runs this load
# (benchmarks/stack_bench_load.py) can sample CPU at its edges and start the probe inside it.
WindowStarted = Callable[[float, float], None]


async def _measure(window: _Window, result: RunResult, started: WindowStarted | None) -> None:
    if started is not None:
        started(window.start, window.end)
    await asyncio.sleep(max(0.0, window.end - time.monotonic()))
    result.seconds = window.end - window.start


def params(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def router_run(
    address: str, shape: LoadShape, started: WindowStarted | None = None
) -> RunResult:
    """Closed-loop Generate streams through the router."""
    result = RunResult("router")
    window = _Window(shape)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def stream(index: int) -> None:
            max_tokens = shape.first_max_tokens(index)
            for number in itertools.count():
                start = time.monotonic()
                if start >= window.end:
                    return
                request = router_pb2.GenerateRequest(
                    prompt=PROMPTS[(index + number) % len(PROMPTS)], params=params(max_tokens)
                )
                max_tokens = shape.max_tokens
                first = True
                call = stub.Generate(request)
                read = call.read  # cheaper per message than `async for` (no generator layer)
                while (response := await read()) is not grpc.aio.EOF:
                    now = time.monotonic()
                    if window.start <= now < window.end:
                        result.tokens += len(response.token_ids)
                        result.responses += 1
                        if first and response.token_ids and start >= window.start:
                            result.ttfts_s.append(now - start)
                        if response.finish_reason:
                            result.requests += 1
                    first = False

        streams = [asyncio.ensure_future(stream(i)) for i in range(shape.concurrency)]
        await _measure(window, result, started)
        failed = [task for task in streams if task.done() and task.exception() is not None]
        for task in streams:
            task.cancel()  # cancels the calls still running
        await asyncio.gather(*streams, return_exceptions=True)
    if failed:  # a stream that died would silently lower the figure
        raise RuntimeError(
            f"{len(failed)} of {len(streams)} streams failed during the run, e.g. "
            f"{failed[0].exception()!r}"
        )
    return result


async def engine_run(
    address: str,
    prompt_ids: list[list[int]],
    shape: LoadShape,
    started: WindowStarted | None = None,
) -> RunResult:
    """The same closed loop straight over one EngineSession: the engine by itself."""
    result = RunResult("engine alone")
    window = _Window(shape)
    waiting: dict[str, tuple[float, asyncio.Future]] = {}  # request id -> (submitted, done)
    first_seen: set[str] = set()
    ids = itertools.count(1)
    outbox: asyncio.Queue[engine_pb2.EngineRequest] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).EngineSession()

        async def write() -> None:
            while True:
                await call.write(await outbox.get())

        async def read() -> None:
            while True:
                step = await call.read()
                if step is grpc.aio.EOF:
                    raise RuntimeError("the engine closed the session")
                now = time.monotonic()
                inside = window.start <= now < window.end
                for update in step.updates:
                    entry = waiting.get(update.request_id)
                    if entry is None:
                        continue
                    if inside:
                        result.tokens += len(update.token_ids)
                        result.responses += 1
                    if update.request_id not in first_seen and update.token_ids:
                        first_seen.add(update.request_id)
                        if inside and entry[0] >= window.start:
                            result.ttfts_s.append(now - entry[0])
                    if update.finish_reason or update.HasField("error"):
                        del waiting[update.request_id]
                        first_seen.discard(update.request_id)
                        if inside and not update.HasField("error"):
                            result.requests += 1
                        entry[1].set_result(None)

        async def stream(index: int) -> None:
            max_tokens = shape.first_max_tokens(index)
            for number in itertools.count():
                start = time.monotonic()
                if start >= window.end:
                    return
                request_id = f"bench{next(ids)}"
                done = loop.create_future()
                waiting[request_id] = (start, done)
                submit = engine_pb2.SubmitRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_ids[(index + number) % len(prompt_ids)],
                    params=params(max_tokens),
                )
                max_tokens = shape.max_tokens
                outbox.put_nowait(engine_pb2.EngineRequest(submits=[submit]))
                await done

        session = [asyncio.ensure_future(write()), asyncio.ensure_future(read())]
        tasks = session + [asyncio.ensure_future(stream(i)) for i in range(shape.concurrency)]
        await _measure(window, result, started)
        for task in tasks:
            task.cancel()
        # The tasks end first: a write still in flight when the call is cancelled fails with
        # INTERNAL ("Failed execute_batch"), which would read as a broken session below.
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        # A broken session must fail the run, not report zero tokens. Why the call ended (its
        # status) says more than the task that noticed first (a write after the end fails with
        # INTERNAL "Failed execute_batch" whatever the cause).
        failures = [
            f"{name}: {outcome!r}"
            for name, outcome in zip(("write", "read"), outcomes, strict=False)
            if isinstance(outcome, Exception)
        ]
        if failures and call.done():
            failures.insert(0, f"call ended {await call.code()}: {await call.details()!r}")
        call.cancel()  # the engine aborts the session's requests and frees their blocks
    if failures:
        raise RuntimeError("the engine session failed during the run: " + "; ".join(failures))
    return result


async def router_idle_ttft(address: str, samples: int) -> list[float]:
    """Times to first token of one request at a time through the router (nothing queued), s."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        ttfts = []
        for index in range(samples + 1):
            request = router_pb2.GenerateRequest(
                prompt=PROMPTS[index % len(PROMPTS)], params=params(1)
            )
            start = time.perf_counter()
            async for response in stub.Generate(request):
                if response.token_ids and index:  # the first one warms up
                    ttfts.append(time.perf_counter() - start)
    return ttfts


async def engine_idle_ttft(address: str, prompt_ids: list[list[int]], samples: int) -> list[float]:
    """The same straight over an EngineSession (prompts tokenized beforehand), s."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).EngineSession()
        ttfts = []
        for index in range(samples + 1):
            request_id = f"idle{index}"
            start = time.perf_counter()
            submit = engine_pb2.SubmitRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids[index % len(prompt_ids)],
                params=params(1),
            )
            await call.write(engine_pb2.EngineRequest(submits=[submit]))
            done = False
            while not done:
                step = await call.read()
                if step is grpc.aio.EOF:
                    raise RuntimeError("the engine closed the session")
                for update in step.updates:
                    if update.request_id == request_id and update.token_ids:
                        if index:
                            ttfts.append(time.perf_counter() - start)
                        done = True
        call.cancel()
    return ttfts
