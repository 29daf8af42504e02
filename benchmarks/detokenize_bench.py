"""How many streamed tokens/s one tokenizer process detokenizes, and so how many a host needs.

    python -m benchmarks.detokenize_bench [--streams 256] [--tokens-per-update 1] \
        [--in-flight 4] [--duration-s 10] [--host-tokens-per-s 160000]

Starts `sluice serve tokenizer` (the default model's tokenizer) as its own process and drives
its `DetokenizeSession` the way the router does: one `DetokenizeRequest` per engine step
carrying a token for each of `--streams` running requests (new requests open with their
options and prompt tail; each finishes after `--request-tokens` tokens and a new one takes its
place), with up to `--in-flight` messages unanswered, as fast as the tokenizer answers. Token
ids are real words of the tokenizer's vocabulary. Prints the tokens/s the process sustained,
its CPU use (it is CPU-bound at saturation: about one core), and the replicas (`sluice up
--tokenizers N`) needed for `--host-tokens-per-s` (default: 8 GPUs at 20k tokens/s each) with
the stack's headroom rule: one replica per 70% of its ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import grpc
import psutil

from benchmarks.tokenize_hop_bench import start_tokenizer
from protos.sluice.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common import event_loop
from services.launcher import terminate

HEADROOM = 0.7  # plan each replica at this fraction of its measured ceiling


def word_ids() -> list[int]:
    """Token ids of ordinary words, so the decode does the work real text costs."""
    from services.tokenizer.tokenize import TokenizerModel

    model = TokenizerModel.load(None)
    text = "the quick brown fox jumps over the lazy dog while a paged cache keeps every token "
    return list(model.hf_tokenizer.encode(text * 8, add_special_tokens=False))


def step_messages(
    args: argparse.Namespace, ids: list[int]
) -> list[tokenizer_pb2.DetokenizeRequest]:
    """One full cycle of steps, built up front so the driver stays cheap: stream i opens at
    step i mod the request length (options with a prompt tail) and finishes a request length
    later, so every step carries opens, ordinary tokens and finishes in steady proportion."""
    per_update = args.tokens_per_update
    steps = max(args.request_tokens // per_update, 1)
    messages = [tokenizer_pb2.DetokenizeRequest() for _ in range(steps)]
    for stream in range(args.streams):
        offset = stream % steps
        for age in range(steps):
            update = messages[(offset + age) % steps].updates.add(request_id=f"s{stream}")
            start = (stream * 7 + age * per_update) % (len(ids) - per_update)
            update.token_ids.extend(ids[start : start + per_update])
            if age == 0:
                update.options.prompt_tail_ids.extend(ids[:4])
            if age == steps - 1:
                update.finished = True
    return messages


async def drive(address: str, args: argparse.Namespace, ids: list[int]) -> dict[str, float]:
    cycle = step_messages(args, ids)
    sequence_number = 0

    def step() -> tokenizer_pb2.DetokenizeRequest:
        nonlocal sequence_number
        message = cycle[sequence_number % len(cycle)]
        sequence_number += 1
        message.sequence_number = sequence_number
        return message

    tokens_per_message = args.streams * args.tokens_per_update
    async with grpc.aio.insecure_channel(address) as channel:
        call = tokenizer_pb2_grpc.TokenizerStub(channel).DetokenizeSession()
        window = asyncio.Semaphore(args.in_flight)
        answered = 0
        done = asyncio.Event()

        async def reader() -> None:
            nonlocal answered
            while not done.is_set():
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                answered += 1
                window.release()

        reading = asyncio.create_task(reader())
        warmup_until = time.monotonic() + args.warmup_s
        while time.monotonic() < warmup_until:
            await window.acquire()
            await call.write(step())
        start, start_answered = time.monotonic(), answered
        end = start + args.duration_s
        while time.monotonic() < end:
            await window.acquire()
            await call.write(step())
        elapsed = time.monotonic() - start
        messages = answered - start_answered
        done.set()
        await call.done_writing()
        reading.cancel()
    return {
        "messages_per_s": messages / elapsed,
        "tokens_per_s": messages * tokens_per_message / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.detokenize_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--streams", type=int, default=256, help="requests per message")
    parser.add_argument("--tokens-per-update", type=int, default=1, help="tokens per request")
    parser.add_argument("--request-tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--in-flight", type=int, default=4, help="messages unanswered at most")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument(
        "--host-tokens-per-s",
        type=float,
        default=160_000.0,
        help="streamed tokens/s a host's engines produce (default: 8 GPUs x 20k)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    ids = word_ids()
    child = start_tokenizer("detokenize-bench-")
    try:
        process = psutil.Process(child.process.pid)
        cpu_before, wall_before = process.cpu_times(), time.monotonic()
        figures = event_loop.run(drive(child.address, args, ids))
        cpu_after, wall = process.cpu_times(), time.monotonic() - wall_before
    finally:
        terminate([child], 10.0)
    cpu_s = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    figures["tokenizer_cores"] = cpu_s / wall
    # Below a full core the driver, not the tokenizer, set the pace; the decode is CPU-bound,
    # so the process's ceiling is its rate per core it used (planning needs the ceiling).
    figures["tokens_per_s_per_core"] = figures["tokens_per_s"] / max(
        figures["tokenizer_cores"], 1e-9
    )
    ceiling = figures["tokens_per_s"] / min(max(figures["tokenizer_cores"], 1e-9), 1.0)
    figures["ceiling_tokens_per_s"] = ceiling
    figures["replicas_needed"] = math.ceil(args.host_tokens_per_s / (ceiling * HEADROOM))
    figures |= {
        "streams": args.streams,
        "tokens_per_update": args.tokens_per_update,
        "host_tokens_per_s": args.host_tokens_per_s,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": "python -m benchmarks.detokenize_bench " + " ".join(argv or sys.argv[1:]),
    }
    print(
        f"one tokenizer process: {figures['tokens_per_s']:,.0f} streamed tokens/s "
        f"({figures['messages_per_s']:,.0f} messages/s of {args.streams} streams) on "
        f"{figures['tokenizer_cores']:.2f} cores = {figures['tokens_per_s_per_core']:,.0f} "
        f"tokens/s per core; ceiling {ceiling:,.0f} tokens/s; a host streaming "
        f"{args.host_tokens_per_s:,.0f} tokens/s needs --tokenizers {figures['replicas_needed']}"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
