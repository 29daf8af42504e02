"""Offline engine benchmark: tokens/s of the engine next to transformers' generate, same prompts.

For each batch size (default 1, 8, 32) it builds that many prompts of mixed lengths, then times
(a) end-to-end generation of `--max-tokens` tokens per prompt (EOS ignored, so both sides make
the same number of tokens) and (b) prefill alone (one generated token), once with Sluice's
engine and once with transformers' batched greedy `generate` (left padding), in the same process.
It prints a table with the ratios and can write JSON (`--out`).

Fair to both sides: both run in the same dtype (`--dtype`; auto = the engine's own choice, e.g.
bfloat16 on a CPU with native bf16, and transformers is loaded in that torch dtype), and before
every timed run each side makes `--warmup-runs` untimed runs of the very same work (oneDNN builds
a kernel per new matmul shape on first use, ~1-2 ms each: a cold run measures that, not the
steady state). With `--repeats N` each side's figure is its best of N timed runs.

`--device cuda` hands over to `benchmarks.gpu_bench.main` (the GPU benchmark).

    python -m benchmarks.engine_bench [--batch-sizes 1,8,32] [--max-tokens 32] [--dtype auto]
        [--warmup-runs 1] [--repeats 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Row:
    batch_size: int
    phase: str  # "generate" (prefill + decode) or "prefill"
    prompt_tokens: int
    generated_tokens: int
    sluice_s: float
    transformers_s: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens if self.phase == "prefill" else self.generated_tokens

    @property
    def sluice_tokens_per_s(self) -> float:
        return self.tokens / self.sluice_s

    @property
    def transformers_tokens_per_s(self) -> float:
        return self.tokens / self.transformers_s

    @property
    def ratio(self) -> float:
        return self.transformers_s / self.sluice_s


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_bench", description=__doc__)
    parser.add_argument("--device", default="cpu", help="cpu (here) or cuda (gpu_bench)")
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--min-prompt", type=int, default=16, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=192, help="longest prompt, tokens")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="dtype of BOTH sides (auto = the engine's choice: bfloat16 on CPUs with native "
        "bf16 matmul, else float32; transformers is loaded in the same dtype)",
    )
    parser.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs of the same prompts by each side before each timed run",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs per side; the best (fastest) counts"
    )
    parser.add_argument("--skip-transformers", action="store_true", help="time only Sluice")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths/tokens")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


def make_prompts(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    """Mixed lengths spread evenly over [low, high], random ordinary tokens."""
    rng = random.Random(seed)
    lengths = [low + (high - low) * i // max(1, count - 1) for i in range(count)]
    rng.shuffle(lengths)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for length in lengths]


def time_sluice(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from services.common.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(output.token_ids) for output in outputs)


def time_transformers(model: Any, prompts: list[list[int]], max_tokens: int, pad: int) -> float:
    import torch
    from transformers import GenerationConfig

    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as generate expects
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=pad
    )
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, generation_config=config)
    return time.perf_counter() - started


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor() or "unknown"
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run(args: argparse.Namespace) -> dict:
    import torch

    from services.engine.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(item) for item in args.batch_sizes.split(",") if item.strip()]
    if args.warmup_runs < 0 or args.repeats < 1:
        raise SystemExit("error: --warmup-runs must be >= 0 and --repeats >= 1")
    llm = LLM(
        model=args.model,
        device="cpu",
        dtype=args.dtype,
        max_num_seqs=max(256, max(batch_sizes)),
    )
    dtype_name = llm.engine.info.dtype  # what "auto" resolved to
    vocab = llm.engine.info.vocab_size
    model = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        files = llm.engine.model_files
        model = AutoModelForCausalLM.from_pretrained(
            str(files.weights_dir), dtype=getattr(torch, dtype_name)
        )
        model.eval()
    pad = llm.engine.info.eos_token_ids[0] if llm.engine.info.eos_token_ids else 0
    print(
        f"dtype: {dtype_name} (both sides); warmup: {args.warmup_runs} untimed run(s) of the "
        f"same work per side before each timed one; best of {args.repeats} timed run(s)",
        flush=True,
    )

    def sluice_once(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        # A fresh prefix cache each time, so Sluice computes every prompt token.
        llm.engine.block_manager.reset_prefix_cache()
        return time_sluice(llm, prompts, max_tokens)

    rows: list[Row] = []
    for batch_size in batch_sizes:
        prompts = make_prompts(batch_size, args.min_prompt, args.max_prompt, vocab, args.seed)
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        for phase, max_tokens in (("generate", args.max_tokens), ("prefill", 1)):
            for _ in range(args.warmup_runs):
                sluice_once(prompts, max_tokens)
            timed = [sluice_once(prompts, max_tokens) for _ in range(args.repeats)]
            sluice_s, generated = min(timed)
            reference_s = 0.0
            if model is not None:
                for _ in range(args.warmup_runs):
                    time_transformers(model, prompts, max_tokens, pad)
                reference_s = min(
                    time_transformers(model, prompts, max_tokens, pad) for _ in range(args.repeats)
                )
            rows.append(Row(batch_size, phase, prompt_tokens, generated, sluice_s, reference_s))
            print(format_row(rows[-1]), flush=True)
    return {
        "device": f"cpu: {cpu_name()} ({torch.get_num_threads()} threads)",
        "dtype": dtype_name,
        "warmup_runs": args.warmup_runs,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.engine_bench " + " ".join(sys.argv[1:]),
        "model": llm.engine.info.model_name,
        "max_tokens": args.max_tokens,
        "prompt_lengths": [args.min_prompt, args.max_prompt],
        "rows": [
            {
                **asdict(row),
                "sluice_tokens_per_s": row.sluice_tokens_per_s,
                "transformers_tokens_per_s": (
                    row.transformers_tokens_per_s if row.transformers_s else None
                ),
                "ratio": row.ratio if row.transformers_s else None,
            }
            for row in rows
        ],
    }


HEADER = (
    f"{'batch':>5} {'phase':>9} {'prompt tok':>10} {'gen tok':>7} "
    f"{'sluice tok/s':>12} {'hf tok/s':>9} {'ratio':>6}"
)


def format_row(row: Row) -> str:
    hf = f"{row.transformers_tokens_per_s:9.1f}" if row.transformers_s else f"{'-':>9}"
    ratio = f"{row.ratio:6.2f}" if row.transformers_s else f"{'-':>6}"
    return (
        f"{row.batch_size:>5} {row.phase:>9} {row.prompt_tokens:>10} {row.generated_tokens:>7} "
        f"{row.sluice_tokens_per_s:12.1f} {hf} {ratio}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.device.startswith("cuda"):
        from benchmarks import gpu_bench

        return gpu_bench.main(argv)
    if args.device != "cpu":
        print(f"error: --device must be cpu or cuda, got {args.device!r}", file=sys.stderr)
        return 2
    print(HEADER, flush=True)
    result = run(args)
    print(
        f"device: {result['device']}; tokens/s: generate = generated tokens / wall time "
        "(prefill + decode); prefill = prompt tokens / wall time for 1 generated token"
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
