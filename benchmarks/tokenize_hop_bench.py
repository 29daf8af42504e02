"""The router's tokenize hop two ways against one tokenizer service: a `Tokenize` call per
prompt (the router's former hop) and a message on one long-lived `TokenizeSession` stream
(the router now), in alternating rounds so both see the same machine.

    python -m benchmarks.tokenize_hop_bench [--requests 300] [--rounds 3] [--pause-ms 2]

Starts `sluice serve tokenizer` (the default model's tokenizer) as its own process on a free
loopback port and sends one short prompt at a time, `--pause-ms` apart (so each request finds
the service idle, as a new request does between others). Prints, per way and round, the median
round trip and the tokenizer process's CPU per request (user + system from /proc through
psutil), then the session / call ratios of the medians over all rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import psutil

from protos.sluice.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import event_loop
from services.launcher import (
    ChildProcess,
    StackConfig,
    free_port,
    spawn_service,
    terminate,
    wait_until_serving,
)

PROMPT = "Explain how a paged KV cache works in three sentences."
WARMUP = 20


def start_tokenizer(prefix: str = "tokenize-hop-bench-") -> ChildProcess:
    """`sluice serve tokenizer` (the default model's) as its own process, once SERVING."""
    config = StackConfig(log_dir=Path(tempfile.mkdtemp(prefix=prefix)))
    child = spawn_service(config, "tokenizer", "tokenizer", free_port(), [])
    try:
        wait_until_serving(child, time.monotonic() + config.startup_timeout_s)
    except Exception:
        terminate([child], config.stop_grace_s)
        raise
    return child


async def _measure(
    one: Callable[[int], Awaitable[None]], requests: int, pause_s: float, cpu: psutil.Process
) -> tuple[float, float]:
    """(median round trip s, tokenizer CPU s per request) of `requests` calls of `one`."""
    for index in range(WARMUP):
        await one(index)
    times = []
    before = cpu.cpu_times()
    for index in range(requests):
        await asyncio.sleep(pause_s)
        started = time.perf_counter()
        await one(index)
        times.append(time.perf_counter() - started)
    after = cpu.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    return statistics.median(times), used / requests


async def run(requests: int, rounds: int, pause_s: float, address: str, pid: int) -> dict:
    cpu = psutil.Process(pid)
    request = tokenizer_pb2.TokenizeRequest(items=[tokenizer_pb2.TokenizeItem(text=PROMPT)])
    results: dict[str, list[tuple[float, float]]] = {"call": [], "session": []}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        expected = list((await stub.Tokenize(request)).results[0].token_ids)
        session = stub.TokenizeSession()

        async def by_call(index: int) -> None:
            response = await stub.Tokenize(request)
            assert list(response.results[0].token_ids) == expected

        async def by_session(index: int) -> None:
            await session.write(
                tokenizer_pb2.TokenizeRequest(items=request.items, sequence_number=index + 1)
            )
            response = await session.read()
            assert response.sequence_number == index + 1
            assert list(response.results[0].token_ids) == expected

        for _ in range(rounds):
            results["call"].append(await _measure(by_call, requests, pause_s, cpu))
            results["session"].append(await _measure(by_session, requests, pause_s, cpu))
        session.cancel()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tokenize_hop_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=300, help="timed requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each way")
    parser.add_argument("--pause-ms", type=float, default=2.0, help="pause between requests")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.pause_ms < 0:
        parser.error("--requests and --rounds must be >= 1, --pause-ms >= 0")
    child = start_tokenizer()
    try:
        results = event_loop.run(
            run(args.requests, args.rounds, args.pause_ms / 1e3, child.address, child.process.pid)
        )
    finally:
        terminate([child], 10.0)
        child.close_log()
    for way, rounds in results.items():
        for number, (trip, cpu) in enumerate(rounds, 1):
            print(
                f"{way:>7} round {number}: round trip median {trip * 1e3:.3f} ms, "
                f"tokenizer CPU {cpu * 1e6:.0f} us/request"
            )
    trips = {way: statistics.median(t for t, _ in rounds) for way, rounds in results.items()}
    cpus = {way: statistics.median(c for _, c in rounds) for way, rounds in results.items()}
    # /proc counts CPU in 10 ms ticks: a short run can show none for a way.
    cpu_ratio = (
        f"{cpus['session'] / cpus['call']:.2f}"
        if cpus["call"] > 0
        else "n/a (under the 10 ms CPU clock tick: run more --requests)"
    )
    trip_ratio = trips["session"] / trips["call"]
    print(f"session / call: round trip {trip_ratio:.2f}, tokenizer CPU {cpu_ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
