"""Engine-only decode throughput: what one LLMEngine streams by itself, no gRPC.

The stack benchmark (stack_bench.py) needs the engine step of `dummy:tiny` well under ~4 ms at 64
sequences, so this drives an LLMEngine in-process with `--concurrency` closed-loop greedy
requests (`ignore_eos`, `--max-tokens` each, refilled as they finish) for `--duration-s` seconds
and prints tokens/s, the mean step time and its host share: the mean time per step outside the
runner's forward (scheduling, the runner's `prepare_inputs`, stop checks, deltas), which this
machine's noise in the forward does not swamp. `--profile FILE` writes a cProfile of the run.

    python -m benchmarks.engine_step_bench --model dummy:tiny --concurrency 64 --duration-s 10
"""

from __future__ import annotations

import argparse
import cProfile
import json
import random
import time
from collections.abc import Callable
from typing import Any

from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_step_bench", description=__doc__
    )
    parser.add_argument(
        "--model", default="dummy:tiny", help='model (default: dummy:tiny; "" = the default model)'
    )
    parser.add_argument("--concurrency", type=int, default=64, help="live requests")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds to run")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt length, tokens")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the engine's choice)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="engine dtype (auto = bfloat16 on CUDA and on CPUs with native bf16, else float32)",
    )
    parser.add_argument("--profile", default=None, help="write a cProfile here")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Drive the engine for `args.duration_s` seconds; tokens/s and mean step time."""
    import torch

    config = EngineConfig(model=args.model or None, dtype=args.dtype)
    config, runner = LLMEngine._build_runner(config)
    forward_s = _time_forward(runner)
    engine = LLMEngine(config, model_runner=runner)
    if args.threads is not None:  # after the runner, which picks 1 thread for tiny models
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    vocab = engine.info.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    counter = 0

    def submit() -> None:
        nonlocal counter
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        engine.add_request(f"r{counter}", prompt, params)
        counter += 1

    for _ in range(args.concurrency):
        submit()
    for _ in range(5):  # warm up
        engine.step()
    tokens = steps = 0
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    forward_s[0] = 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < args.duration_s:
        out = engine.step()
        steps += 1
        for item in out.deltas:
            tokens += len(item.new_token_ids)
            if item.finished:
                submit()
    elapsed = time.perf_counter() - start
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    return {
        "model": args.model,
        "concurrency": args.concurrency,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "tokens_per_s": round(tokens / elapsed, 1),
        "mean_step_ms": round(1000 * elapsed / max(steps, 1), 3),
        "host_ms_per_step": round(1000 * (elapsed - forward_s[0]) / max(steps, 1), 3),
        "steps": steps,
    }


def _time_forward(runner: Any) -> list[float]:
    """Wrap the runner so that a one-item list accumulates the seconds of its forward passes
    (`execute` / `execute_greedy`), less the host work of `prepare_inputs` inside them."""
    total = [0.0]

    def timed(method: Callable[..., Any], sign: float) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                total[0] += sign * (time.perf_counter() - started)

        return wrapper

    for name in ("execute", "execute_greedy"):
        if hasattr(runner, name):
            setattr(runner, name, timed(getattr(runner, name), 1.0))
    if hasattr(runner, "prepare_inputs"):
        runner.prepare_inputs = timed(runner.prepare_inputs, -1.0)
    return total


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    print(json.dumps(run(build_parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
