"""The serving-stack benchmark of issue 3: streamed tokens/s through the router vs the engine alone.

With a `dummy:tiny` model the model is cheap, so the numbers measure the stack (gRPC hops,
detokenization, per-request streaming), not the forward pass. It
1. starts a tokenizer, one engine and the router as separate processes on free loopback ports
   (or uses `--router/--engine/--tokenizer` addresses of a running stack),
2. runs `--concurrency` closed-loop streams for `--duration` seconds straight to the engine over
   one EngineSession (the engine alone), then the same through the router's public Generate,
3. reports streamed tokens/s for both and their ratio, median and p90 time to first token and
   the router's added TTFT, and the router process's CPU microseconds per streamed token
   (from /proc through psutil).

    python -m loadtest.stack_bench --model dummy:tiny --concurrency 64 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import grpc
import psutil

from protos.sluice.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

PROMPTS = (
    "The quick brown fox jumps over the lazy dog because",
    "Write a short poem about the sea and the wind:",
    "Explain how a paged KV cache works in three sentences.",
    "List five cities in Europe and one fact about each:",
)


@dataclass
class RunResult:
    """One closed-loop run: tokens, time, latency."""

    name: str
    tokens: int
    requests: int
    seconds: float
    ttft_median_ms: float
    ttft_p90_ms: float
    cpu_us_per_token: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _params(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _router_run(address: str, args: argparse.Namespace, pid: int | None) -> RunResult:
    channel = grpc.aio.insecure_channel(address)
    stub = router_pb2_grpc.RouterStub(channel)
    ttfts: list[float] = []
    counts = {"tokens": 0, "requests": 0}
    stop_at = time.monotonic() + args.duration

    async def stream(index: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            prompt = PROMPTS[(index + n) % len(PROMPTS)]
            n += 1
            start = time.perf_counter()
            first = True
            call = stub.Generate(
                router_pb2.GenerateRequest(prompt=prompt, params=_params(args.max_tokens))
            )
            async for response in call:
                if first and response.token_ids:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                counts["tokens"] += len(response.token_ids)
            counts["requests"] += 1

    await _one_warmup(stub)
    cpu_before = _cpu_seconds(pid)
    began = time.monotonic()
    await asyncio.gather(*(stream(i) for i in range(args.concurrency)))
    seconds = time.monotonic() - began
    cpu_after = _cpu_seconds(pid)
    await channel.close()
    cpu_per_token = None
    if cpu_before is not None and cpu_after is not None and counts["tokens"]:
        cpu_per_token = (cpu_after - cpu_before) / counts["tokens"] * 1e6
    return RunResult(
        "router",
        counts["tokens"],
        counts["requests"],
        seconds,
        _percentile(ttfts, 0.5) * 1e3,
        _percentile(ttfts, 0.9) * 1e3,
        cpu_per_token,
    )


async def _one_warmup(stub: router_pb2_grpc.RouterStub) -> None:
    async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="warm up", params=_params(4))):
        pass


async def _engine_run(
    address: str, prompt_ids: list[list[int]], args: argparse.Namespace
) -> RunResult:
    """Closed loop straight over one EngineSession: what the engine can stream by itself."""
    channel = grpc.aio.insecure_channel(address)
    stub = engine_pb2_grpc.EngineStub(channel)
    call = stub.EngineSession()
    ttfts: list[float] = []
    starts: dict[str, float] = {}
    counts = {"tokens": 0, "requests": 0}
    ids = iter(range(1, 1 << 62))
    stop_at = time.monotonic() + args.duration
    live = 0

    def submit(slot: int) -> engine_pb2.SubmitRequest:
        request_id = f"b{next(ids)}"
        starts[request_id] = time.perf_counter()
        return engine_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids[slot % len(prompt_ids)],
            params=_params(args.max_tokens),
        )

    began = time.monotonic()
    await call.write(engine_pb2.EngineRequest(submits=[submit(i) for i in range(args.concurrency)]))
    live = args.concurrency
    while live:
        step = await call.read()
        if step is grpc.aio.EOF:
            raise RuntimeError("engine closed the session")
        refill: list[engine_pb2.SubmitRequest] = []
        for update in step.updates:
            counts["tokens"] += len(update.token_ids)
            start = starts.get(update.request_id)
            if start is not None and update.token_ids:
                ttfts.append(time.perf_counter() - start)
                del starts[update.request_id]
            if update.finish_reason or update.HasField("error"):
                counts["requests"] += 1
                live -= 1
                if time.monotonic() < stop_at:
                    refill.append(submit(counts["requests"]))
                    live += 1
        if refill:
            await call.write(engine_pb2.EngineRequest(submits=refill))
    seconds = time.monotonic() - began
    await call.done_writing()
    call.cancel()
    await channel.close()
    return RunResult(
        "engine alone",
        counts["tokens"],
        counts["requests"],
        seconds,
        _percentile(ttfts, 0.5) * 1e3,
        _percentile(ttfts, 0.9) * 1e3,
    )


async def _tokenize(address: str) -> list[list[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        response = await stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(
                items=[tokenizer_pb2.TokenizeItem(text=p) for p in PROMPTS]
            )
        )
    return [list(result.token_ids) for result in response.results]


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


class Stack:
    """Tokenizer, engine and router processes on free loopback ports."""

    def __init__(self, model: str, python: str = sys.executable) -> None:
        self.model = model
        self.python = python
        self.ports = {name: _free_port() for name in ("tokenizer", "engine", "router")}
        self.processes: dict[str, subprocess.Popen] = {}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start(self, timeout_s: float = 180.0) -> None:
        ports = self.ports
        commands = {
            "tokenizer": ["services.tokenizer.server", "--port", str(ports["tokenizer"])],
            "engine": [
                "services.engine.server",
                "--port",
                str(ports["engine"]),
                "--model",
                self.model,
            ],
            "router": [
                "services.router.server",
                "--port",
                str(ports["router"]),
                "--engines",
                self.address("engine"),
                "--tokenizer",
                self.address("tokenizer"),
                "--log-level",
                "WARNING",
            ],
        }
        for name, command in commands.items():
            self.processes[name] = subprocess.Popen(
                [self.python, "-m", *command],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        _wait_serving(self.address("router"), timeout_s)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_serving(address: str, timeout_s: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not become SERVING within {timeout_s}s")


def _find_pid(port: int) -> int | None:
    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN":
            return connection.pid
    return None


async def run(args: argparse.Namespace) -> dict:
    stack = None
    if args.router:
        router, engine, tokenizer = args.router, args.engine, args.tokenizer
        pid = args.router_pid or _find_pid(int(router.rpartition(":")[2]))
    else:
        stack = Stack(args.model)
        stack.start()
        router, engine, tokenizer = (stack.address(n) for n in ("router", "engine", "tokenizer"))
        pid = stack.processes["router"].pid
    try:
        prompt_ids = await _tokenize(tokenizer)
        engine_result = await _engine_run(engine, prompt_ids, args)
        router_result = await _router_run(router, args, pid)
    finally:
        if stack is not None:
            stack.stop()
    report = {
        "model": args.model,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "duration_s": args.duration,
        "cpu_count": os.cpu_count(),
        "engine_alone": {**asdict(engine_result), "tokens_per_s": engine_result.tokens_per_s},
        "router": {**asdict(router_result), "tokens_per_s": router_result.tokens_per_s},
        "ratio_router_to_engine": (
            router_result.tokens_per_s / engine_result.tokens_per_s
            if engine_result.tokens_per_s
            else None
        ),
        "added_ttft_median_ms": router_result.ttft_median_ms - engine_result.ttft_median_ms,
    }
    return report


def _print(report: dict) -> None:
    engine, router = report["engine_alone"], report["router"]
    print(
        f"model {report['model']}, {report['concurrency']} streams, max_tokens "
        f"{report['max_tokens']}, {report['duration_s']} s per run"
    )
    for name, result in (("engine alone", engine), ("router", router)):
        print(
            f"{name:>13}: {result['tokens_per_s']:9.0f} tokens/s  ({result['tokens']} tokens, "
            f"{result['requests']} requests)  TTFT median {result['ttft_median_ms']:.1f} ms, "
            f"p90 {result['ttft_p90_ms']:.1f} ms"
        )
    print(f"ratio router / engine alone: {report['ratio_router_to_engine']:.3f}")
    print(f"added median TTFT: {report['added_ttft_median_ms']:.1f} ms")
    if router["cpu_us_per_token"] is not None:
        print(f"router CPU per streamed token: {router['cpu_us_per_token']:.1f} us")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.stack_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="dummy:tiny", help="engine model (default dummy:tiny)")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent streams")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--router", help="router address of a running stack (else start one)")
    parser.add_argument("--engine", help="engine address of that stack")
    parser.add_argument("--tokenizer", help="tokenizer address of that stack")
    parser.add_argument("--router-pid", type=int, help="router process id (for CPU accounting)")
    parser.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.router and not (args.engine and args.tokenizer):
        parser.error("--router needs --engine and --tokenizer")
    if args.concurrency < 1 or args.max_tokens < 1 or args.duration <= 0:
        parser.error("concurrency, max-tokens and duration must be positive")
    report = asyncio.run(run(args))
    _print(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
