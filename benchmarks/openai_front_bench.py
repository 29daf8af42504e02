"""What the OpenAI-compatible HTTP front adds to the time to first token, over gRPC Generate.

At low load (one request at a time), on one stack and in one run, it sends the same streamed
text prompt alternately through the router's gRPC Generate and through its HTTP front
(`POST /v1/completions`, `stream: true`), and measures each request's time from sending to the
first text: a gRPC response, or an SSE event with text. Both clients are lean (grpc.aio and
aiohttp, each with one kept-alive connection, on the same uvloop), so the difference is the
server side's HTTP parsing, JSON and SSE framing against protobuf and HTTP/2 framing. It prints
the median and p90 of each, the median of the paired differences (HTTP minus the gRPC request
just before it) and the ratio of the medians.

With the default `dummy:tiny` model the forward pass is cheap, so the time to first token is
mostly the stack's own. It starts tokenizer, engine and router (services/launcher.py) unless
`--router HOST:PORT --http-url URL` name a running stack.

    python -m benchmarks.openai_front_bench --requests 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.stack_bench_clients import PROMPTS, percentile
from services.client import AsyncSluiceClient
from services.common import event_loop
from services.common.ports import free_port


async def grpc_ttft_s(client: AsyncSluiceClient, prompt: str, max_tokens: int) -> float:
    began = time.perf_counter()
    first = None
    async for response in client.generate(
        prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    ):
        if first is None and response.text:
            first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("the gRPC stream carried no text")
    return first


async def http_ttft_s(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
) -> float:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    began = time.perf_counter()
    first = None
    async with session.post(url + "/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            has_text = line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]
            if first is None and has_text:
                first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("the SSE stream carried no text")
    return first


async def measure(router: str, http_url: str, args: argparse.Namespace) -> dict:
    connector = aiohttp.TCPConnector(limit=1)
    async with (
        AsyncSluiceClient(router, timeout_s=60.0) as client,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        async with session.get(http_url + "/models") as response:
            model = (await response.json())["data"][0]["id"]
        over_grpc: list[float] = []
        over_http: list[float] = []
        for index in range(args.warmup + args.requests):
            prompt = PROMPTS[index % len(PROMPTS)]
            grpc_s = await grpc_ttft_s(client, prompt, args.max_tokens)
            http_s = await http_ttft_s(session, http_url, model, prompt, args.max_tokens)
            if index >= args.warmup:
                over_grpc.append(grpc_s)
                over_http.append(http_s)
    pairs = [h - g for g, h in zip(over_grpc, over_http, strict=True)]
    grpc_ms = statistics.median(over_grpc) * 1e3
    http_ms = statistics.median(over_http) * 1e3
    return {
        "model": model,
        "requests_each_way": args.requests,
        "max_tokens": args.max_tokens,
        "grpc_ttft_ms": {"p50": grpc_ms, "p90": percentile(over_grpc, 0.9) * 1e3},
        "http_ttft_ms": {"p50": http_ms, "p90": percentile(over_http, 0.9) * 1e3},
        "added_ttft_ms_p50": http_ms - grpc_ms,
        "added_ttft_ms_paired_p50": statistics.median(pairs) * 1e3,
        "ttft_ratio_p50": http_ms / grpc_ms,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="dummy:tiny",
        help="model of the stack it starts ('default': the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--router", help="gRPC address of a running router (with --http-url)")
    parser.add_argument("--http-url", help="its OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--requests", type=int, default=200, help="measured requests each way")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured requests each way")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens each request streams")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if (args.router is None) != (args.http_url is None):
        parser.error("give both --router and --http-url, or neither")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.router is not None:
        result = event_loop.run(measure(args.router, args.http_url.rstrip("/"), args))
    else:
        from services.launcher import Stack, StackConfig

        port = free_port()
        config = StackConfig(
            model=None if args.model == "default" else args.model,
            port=0,
            router_args=("--http-port", str(port)),
            log_dir=Path(tempfile.mkdtemp(prefix="openai-front-bench-")),
        )
        with Stack(config) as stack:
            url = f"http://127.0.0.1:{port}/v1"
            result = event_loop.run(measure(stack.router_address, url, args))
    result["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
