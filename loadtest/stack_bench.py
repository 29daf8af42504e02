"""The serving-stack benchmark of issue 3: streamed tokens/s through the router vs the engine alone.

With a `dummy:tiny` model the model is cheap, so the numbers measure the stack (gRPC hops,
detokenization, per-request streaming), not the forward pass. It
1. starts a tokenizer, one engine and the router as separate processes on free loopback ports
   (services/launcher.py; or uses `--router/--engine/--tokenizer` of a running stack),
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
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

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


async def _router_idle_ttft(address: str, samples: int) -> float:
    """Median time to first token of one request at a time (no queueing anywhere), ms."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await _one_warmup(stub)
        ttfts = []
        for index in range(samples):
            request = router_pb2.GenerateRequest(
                prompt=PROMPTS[index % len(PROMPTS)], params=_params(1)
            )
            start = time.perf_counter()
            async for response in stub.Generate(request):
                if response.token_ids:
                    ttfts.append(time.perf_counter() - start)
                    break
    return _percentile(ttfts, 0.5) * 1e3


async def _engine_idle_ttft(address: str, prompt_ids: list[list[int]], samples: int) -> float:
    """The same straight over an EngineSession, ms."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).EngineSession()
        ttfts = []
        for index in range(samples + 1):
            request_id = f"idle{index}"
            start = time.perf_counter()
            await call.write(
                engine_pb2.EngineRequest(
                    submits=[
                        engine_pb2.SubmitRequest(
                            request_id=request_id,
                            prompt_token_ids=prompt_ids[index % len(prompt_ids)],
                            params=_params(1),
                        )
                    ]
                )
            )
            done = False
            while not done:
                step = await call.read()
                if step is grpc.aio.EOF:
                    raise RuntimeError("engine closed the session")
                for update in step.updates:
                    if update.request_id == request_id and update.token_ids:
                        if index:  # the first one warms up
                            ttfts.append(time.perf_counter() - start)
                        done = True
        call.cancel()
    return _percentile(ttfts, 0.5) * 1e3


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _router_ttft_totals(port: int | None) -> tuple[float, float] | None:
    """(sum, count) of the router's TTFT histogram from its /metrics, or None."""
    if port is None:
        return None
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        for name in ("sum", "count"):
            if line.startswith(f"sluice_router_time_to_first_token_seconds_{name} "):
                values[name] = float(line.split()[1])
    return (values["sum"], values["count"]) if len(values) == 2 else None


def _mean_ms(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1e3


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


class SyntheticEngine(engine_pb2_grpc.EngineServicer):
    """An engine without a model: every `step_s` each live request gets one token.

    With it the engine is never the limit, so the run measures what the router and tokenizer
    can stream (`--synthetic-step-ms`). It speaks the real EngineSession protocol.
    """

    def __init__(self, step_s: float, vocab_size: int = 49152, max_model_len: int = 4096) -> None:
        self.step_s = step_s
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    async def Info(self, request, context):  # noqa: N802 - gRPC method name
        return engine_pb2.EngineInfo(
            model="synthetic",
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_size=16,
            num_blocks=1 << 20,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            engine_id="synthetic",
            load=engine_pb2.EngineLoad(free_blocks=1 << 20),
        )

    async def EngineSession(self, request_iterator, context):  # noqa: N802 - gRPC method name
        live: dict[str, list[int]] = {}  # id -> [generated, max_tokens, prompt_tokens]
        aborted: list[str] = []

        async def read() -> None:
            async for message in request_iterator:
                for submit in message.submits:
                    max_tokens = submit.params.max_tokens or 16
                    live[submit.request_id] = [0, max_tokens, len(submit.prompt_token_ids)]
                for request_id in message.aborts:
                    if live.pop(request_id, None) is not None:
                        aborted.append(request_id)

        reader = asyncio.get_running_loop().create_task(read())
        index = 0
        try:
            while not reader.done():
                await asyncio.sleep(self.step_s)
                index += 1
                step = engine_pb2.EngineStep(step_index=index)
                for request_id in aborted:
                    step.updates.add(request_id=request_id, finish_reason=4)
                aborted.clear()
                for request_id, state in list(live.items()):
                    state[0] += 1
                    update = step.updates.add(
                        request_id=request_id, token_ids=[1000 + (index * 7 + state[0]) % 4000]
                    )
                    if state[0] >= state[1]:
                        update.finish_reason = common_pb2.FINISH_REASON_LENGTH
                        update.usage.prompt_tokens = state[2]
                        update.usage.completion_tokens = state[0]
                        del live[request_id]
                step.load.free_blocks = 1 << 20
                step.load.running = len(live)
                yield step
        finally:
            reader.cancel()


async def _serve_synthetic_engine(port: int, step_s: float) -> None:
    from services.common.grpc_server import start_server

    engine = SyntheticEngine(step_s)
    server = await start_server(
        f"127.0.0.1:{port}",
        lambda s: engine_pb2_grpc.add_EngineServicer_to_server(engine, s),
        ["sluice.v1.Engine"],
    )
    await server.set_serving(True)
    await server.server.wait_for_termination()


def _synthetic_engine_starter(step_ms: float):
    from services.launcher import ChildProcess, free_port

    def start(config, model) -> list:
        port = free_port(config.host)
        command = [
            sys.executable,
            "-m",
            "loadtest.stack_bench",
            "--serve-synthetic-engine",
            str(port),
            "--synthetic-step-ms",
            str(step_ms),
        ]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        return [ChildProcess("synthetic-engine", f"{config.host}:{port}", process)]

    return start


def _find_pid(port: int) -> int | None:
    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN":
            return connection.pid
    return None


async def run(args: argparse.Namespace) -> dict:
    stack = None
    metrics_port = None
    if args.router:
        router, engine, tokenizer = args.router, args.engine, args.tokenizer
        pid = args.router_pid or _find_pid(int(router.rpartition(":")[2]))
    else:
        from services.launcher import Stack, StackConfig

        log_dir = Path(tempfile.mkdtemp(prefix="stack-bench-"))
        metrics_port = _free_port()
        config = StackConfig(
            model=args.model,
            port=0,
            router_args=("--log-level", "WARNING", "--metrics-port", str(metrics_port)),
            engine_args=("--dtype", args.engine_dtype) if args.engine_dtype else (),
            log_dir=log_dir,
        )
        if args.synthetic_step_ms:
            starter = _synthetic_engine_starter(args.synthetic_step_ms)
            stack = Stack(config, engine_starter=starter).start()
        else:
            stack = Stack(config).start()
        router, tokenizer = stack.router_address, stack.tokenizer_address
        engine = stack.engine_addresses[0]
        pid = stack.router.process.pid
    try:
        prompt_ids = await _tokenize(tokenizer)
        engine_result = (
            await _engine_run(engine, prompt_ids, args) if args.only != "router" else None
        )
        ttft_before = _router_ttft_totals(metrics_port)
        router_result = await _router_run(router, args, pid) if args.only != "engine" else None
        ttft_after = _router_ttft_totals(metrics_port)
        if args.only is None:
            engine_idle_ttft = await _engine_idle_ttft(engine, prompt_ids, args.idle_samples)
            router_idle_ttft = await _router_idle_ttft(router, args.idle_samples)
    finally:
        if stack is not None:
            stack.stop()
    if engine_result is None or router_result is None:
        result = engine_result or router_result
        return {"only": {**asdict(result), "tokens_per_s": result.tokens_per_s}}
    report = {
        "model": f"synthetic ({args.synthetic_step_ms} ms steps)"
        if args.synthetic_step_ms
        else args.model,
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
        "router_side_ttft_mean_ms": _mean_ms(ttft_before, ttft_after),
        "idle_ttft_median_ms": {"engine_alone": engine_idle_ttft, "router": router_idle_ttft},
        "added_idle_ttft_median_ms": router_idle_ttft - engine_idle_ttft,
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
    print(f"added median TTFT under load: {report['added_ttft_median_ms']:.1f} ms")
    if report["router_side_ttft_mean_ms"] is not None:
        print(
            "router-side mean TTFT under load (arrival at the router to first token, from its "
            f"metrics): {report['router_side_ttft_mean_ms']:.1f} ms"
        )
    idle = report["idle_ttft_median_ms"]
    print(
        f"idle median TTFT (one request at a time): engine alone {idle['engine_alone']:.2f} ms, "
        f"router {idle['router']:.2f} ms, added {report['added_idle_ttft_median_ms']:.2f} ms"
    )
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
    parser.add_argument(
        "--idle-samples", type=int, default=30, help="requests for the idle TTFT comparison"
    )
    parser.add_argument(
        "--only", choices=("router", "engine"), help="run one side only (for profiling)"
    )
    parser.add_argument(
        "--synthetic-step-ms",
        type=float,
        help="replace the engine by a model-free one stepping every this many ms",
    )
    parser.add_argument(
        "--serve-synthetic-engine", type=int, metavar="PORT", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--engine-dtype", help="the started engine's --dtype (e.g. bfloat16; default: its own)"
    )
    parser.add_argument("--json", help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.serve_synthetic_engine:
        asyncio.run(
            _serve_synthetic_engine(args.serve_synthetic_engine, args.synthetic_step_ms / 1000)
        )
        return 0
    if args.router and not (args.engine and args.tokenizer):
        parser.error("--router needs --engine and --tokenizer")
    if args.concurrency < 1 or args.max_tokens < 1 or args.duration <= 0:
        parser.error("concurrency, max-tokens and duration must be positive")
    report = asyncio.run(run(args))
    if "only" in report:
        print(json.dumps(report["only"], indent=2))
        return 0
    _print(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
