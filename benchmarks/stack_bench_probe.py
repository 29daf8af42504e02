"""A latency probe for the stack benchmark: time to first token under load, from an idle process.

The 64 load streams share one client process whose own event loop, busy with every stream's
messages, delays the first tokens it reports. This probe runs as a separate process next to
that load and sends one single-token request at a time (through the router, or straight to
the engine over its own EngineSession), so what it measures is the stack's latency under the
load, not the load generator's. Both sides are probed the same way; stack_bench starts it with
absolute start and end times (wall clock) inside the counting window and reads its JSON.

    python -m benchmarks.stack_bench_probe router 127.0.0.1:50051 START END
    python -m benchmarks.stack_bench_probe engine 127.0.0.1:50061 START END '[[1, 2, 3]]'
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time

import grpc

from benchmarks.stack_bench_clients import PROMPTS, params
from protos.sluice.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from services.common import tracing

USAGE = "python -m benchmarks.stack_bench_probe router|engine ADDRESS START END [IDS_JSON]"
PAUSE_S = 0.02  # between probes: a light extra load, about one request per step or two


async def probe_router(address: str, start_at: float, end_at: float) -> list[float]:
    ttfts: list[float] = []
    # With tracing switched on (stack_bench --hop-trace), each probe is a traced call: its CLIENT
    # span (send, first token) carries its trace context to the router, which then traces the
    # request (benchmarks/hop_report.py joins the spans).
    async with tracing.traced_channel(grpc.aio.insecure_channel(address)) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        index = 0
        while time.time() < end_at:
            request = router_pb2.GenerateRequest(
                prompt=PROMPTS[index % len(PROMPTS)], params=params(1)
            )
            index += 1
            began = time.perf_counter()
            async for response in stub.Generate(request):
                if response.token_ids:
                    ttfts.append(time.perf_counter() - began)
            await asyncio.sleep(PAUSE_S)
    return ttfts


async def probe_engine(
    address: str, start_at: float, end_at: float, prompt_ids: list[list[int]]
) -> list[float]:
    ttfts: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).EngineSession()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        index = 0
        while time.time() < end_at:
            request_id = f"probe{index}"
            submit = engine_pb2.SubmitRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids[index % len(prompt_ids)],
                params=params(1),
            )
            index += 1
            began = time.perf_counter()
            await call.write(engine_pb2.EngineRequest(submits=[submit]))
            done = False
            while not done:
                step = await call.read()
                if step is grpc.aio.EOF:
                    raise RuntimeError("the engine closed the session")
                for update in step.updates:
                    if update.request_id == request_id and update.token_ids:
                        ttfts.append(time.perf_counter() - began)
                        done = True
            await asyncio.sleep(PAUSE_S)
        call.cancel()
    return ttfts


def main(argv: list[str]) -> int:
    needed = 5 if argv[:1] == ["engine"] else 4  # the router side ignores IDS_JSON
    if argv[:1] not in (["router"], ["engine"]) or len(argv) not in (needed, 5):
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    target, address, start_at, end_at = argv[0], argv[1], float(argv[2]), float(argv[3])
    if target == "router":
        # Every probe is traced, whatever share of the load's calls the stack traces.
        config = tracing.TracingConfig.from_environment()
        tracing.configure(dataclasses.replace(config, trace_sample_ratio=1.0), "sluice-probe")
        ttfts = asyncio.run(probe_router(address, start_at, end_at))
        tracing.shutdown()
    else:
        ttfts = asyncio.run(probe_engine(address, start_at, end_at, json.loads(argv[4])))
    print(json.dumps(ttfts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
