"""When a new request's first token comes, in the engine alone, beside requests that decode.

A warmed LLMEngine runs `--background` requests that decode for the whole run; then, in each of
`--trials` rounds, requests of `--prompt-len` random tokens arrive the way they do at low load:

- `alone`: one request among the decoding ones;
- `second_after`: one request, then another `--gap-ms` later (as Poisson arrivals bring now and
  then); the first one's figure shows whether its first token waits for the second's prefill;
- `together`: two requests in the same step.

A request's figure is the time from `add_request` to the `step()` that returns its first token;
arrivals happen between `step()` calls, as in the engine's loop. The report also gives each step
with prompt rows: its tokens and its time on the device (the launched step's CUDA-event span),
which shows whether such a step is bound by its launches (the same time whatever its tokens).

    python -m benchmarks.first_token_bench --out first-token.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "dummy:llama-3-8b"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.first_token_bench",
        description="First-token latency of requests arriving beside decoding ones (engine only).",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda", help="cuda; cpu for a smoke run")
    parser.add_argument("--background", type=int, default=5, help="requests decoding throughout")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gap-ms", type=float, default=25.0, help="second arrival after the first")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="JSON report")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device))
    warm = engine.warm_up()
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size

    def prompt() -> list[int]:
        return rng.integers(min(100, vocab - 1), min(vocab, 30000), args.prompt_len).tolist()

    room = engine.info.max_model_len - args.prompt_len - 1
    decode = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    for index in range(args.background):
        engine.add_request(f"background-{index}", prompt(), decode)
    for _ in range(20):
        engine.step()
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    prompt_steps: list[tuple[int, float]] = []

    def add(request_id: str) -> None:
        added[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt(), short)

    def step() -> None:
        output = engine.step()
        now = time.perf_counter()
        for delta in output.deltas:
            if delta.new_token_ids and delta.num_output_tokens == len(delta.new_token_ids):
                first.setdefault(delta.request_id, now)
        if output.num_batched_tokens > args.background + 2:  # prompt rows in it
            prompt_steps.append((output.num_batched_tokens, output.step_time_s * 1e3))

    def until(*request_ids: str) -> None:
        while not all(r in first for r in request_ids):
            step()
        for _ in range(15):  # back to decode only
            step()

    gap_s = args.gap_ms / 1e3
    for trial in range(args.trials):
        add(f"alone-{trial}")
        until(f"alone-{trial}")
        one, two = f"first-{trial}", f"second-{trial}"
        add(one)
        while one not in first or two not in first:
            if two not in added and time.perf_counter() - added[one] >= gap_s:
                add(two)
            step()
        until(one, two)
        add(f"together-a-{trial}")
        add(f"together-b-{trial}")
        until(f"together-a-{trial}", f"together-b-{trial}")
    engine.shutdown()
    latency = {r: (first[r] - added[r]) * 1e3 for r in added}

    def median(prefix: str) -> float:
        return round(statistics.median(v for r, v in latency.items() if r.startswith(prefix)), 2)

    on_gpu = args.device.startswith("cuda")
    return {
        "first_token_ms": {
            "alone": median("alone-"),
            "second_after": {"first": median("first-"), "second": median("second-")},
            "together": median("together-"),
        },
        "prompt_steps": [
            {"tokens": tokens, "device_ms": round(ms, 2)} for tokens, ms in prompt_steps
        ],
        "latency_ms": {r: round(v, 2) for r, v in latency.items()},
        "device": torch.cuda.get_device_name(0) if on_gpu else args.device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "settings": {
            "background": args.background,
            "prompt_len": args.prompt_len,
            "gap_ms": args.gap_ms,
            "trials": args.trials,
        },
        "warm_up": warm.summary(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    report["command"] = "python -m benchmarks.first_token_bench " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(json.dumps(report["first_token_ms"]))
    print(json.dumps(report["prompt_steps"][:8]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
