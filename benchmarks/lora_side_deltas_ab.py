"""Decode steps of several adapters with the LoRA kernels in line or beside the base matmuls.

One process, one GPU: the CUDA runner's fast path on `dummy:llama-3-8b` (bf16, random
weights), its decode graphs up to `--max-rows` rows, 64 device slots of random rank-16
adapters on all seven projections (as benchmarks/lora_bench.py). First the base step at each
row count (graphs without LoRA), then in interleaved rounds the LoRA decode graphs captured
each way (`CudaModelRunner.recapture_lora_graphs`): in line (the shrink beside the matmul up
to 64 rows and the deltas first above, "lora-many" graphs of the deltas first for steps of 4+
adapters up to 64 rows) and beside (`--lora-side-deltas`: each projection's shrink and expand
on a second stream beside its base matmul, the next kernel adding the written deltas). Each
figure is the median over the rounds of the mean of `--iterations` back-to-back steps.

    python -m benchmarks.lora_side_deltas_ab --rounds 3 --output side-deltas.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.lora_bench import (
    BLOCK_SIZE,
    RANK,
    Blocks,
    decode_batch,
    random_adapter,
    runner_step,
    time_steps,
    with_slots,
)
from services.common.model_files import ModelFiles
from services.engine.forward_batch import ScheduledBatch
from services.engine.lora.config import LoRAConfig
from services.engine.lora.engine_adapters import EngineAdapters

SLOTS = 64
# (rows, distinct adapters) of the decode steps compared
CASES = ((64, 8), (64, 64), (128, 16), (256, 16), (256, 64))
WAYS = ("inline", "beside")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_side_deltas_ab", description=__doc__
    )
    parser.add_argument("--shape", default="llama-3-8b", help="dummy model shape")
    parser.add_argument("--iterations", type=int, default=30, help="timed steps per sample")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each way")
    parser.add_argument("--context", type=int, default=512, help="tokens before each decode")
    parser.add_argument("--max-rows", type=int, default=256, help="the widest decode graph")
    parser.add_argument("--output", type=Path, default=None)
    return parser


def cases_for(max_rows: int) -> tuple[tuple[int, int], ...]:
    """The (rows, adapters) cases a runner whose widest graph is `max_rows` rows can replay."""
    return tuple((rows, count) for rows, count in CASES if rows <= max_rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.engine.cuda_runner import CudaModelRunner

    files = ModelFiles(
        name=f"dummy:{args.shape}", weights_dir=None, tokenizer_dir=Path("."),
        dummy_shape=args.shape,
    )  # fmt: skip
    runner = CudaModelRunner(
        files, device="cuda", dtype=torch.bfloat16, max_num_seqs=args.max_rows,
        kv_cache_bytes=24 << 30, block_size=BLOCK_SIZE,
    )  # fmt: skip
    config = runner.model_config
    sync = torch.cuda.synchronize
    blocks = Blocks(runner.num_blocks)
    cases = cases_for(args.max_rows)
    widest = decode_batch(blocks, max(rows for rows, _ in cases), args.context, config.vocab_size)
    batches = {rows: ScheduledBatch(widest.sequences[:rows]) for rows, _ in cases}
    it = args.iterations
    base = {
        rows: time_steps(runner_step(runner, None, batch), it, sync)
        for rows, batch in batches.items()
    }
    lora_config = LoRAConfig(
        max_loras=SLOTS, max_cpu_loras=SLOTS, max_lora_rank=RANK, adapter_root="/nonexistent",
        fused_decode=False,  # steps of one adapter are not compared here
    )  # fmt: skip
    adapters = EngineAdapters(
        lora_config, config, dtype=runner.dtype, device=torch.device("cuda"), kernels="triton",
        max_rows=max(8192, args.max_rows),
    )  # fmt: skip
    runner.bind_lora(adapters)  # captures the in-line graphs
    for slot in range(SLOTS):
        adapters.slots.write(slot, random_adapter(adapters, f"r{slot}", slot, torch.device("cuda")))
    sync()
    steps = {
        (rows, count): runner_step(
            runner, adapters, with_slots(batches[rows], [row % count for row in range(rows)])
        )
        for rows, count in cases
    }
    samples: dict[str, dict[str, list[float]]] = {way: {} for way in WAYS}
    capture_s: dict[str, list[float]] = {way: [] for way in WAYS}
    current = "inline"
    for _ in range(args.rounds):
        for way in WAYS:
            if way != current:
                started = time.perf_counter()
                runner.recapture_lora_graphs(adapters, side_deltas=way == "beside")
                capture_s[way].append(time.perf_counter() - started)
                current = way
            for (rows, count), step in steps.items():
                label = f"decode{rows}_{count}_adapters"
                samples[way].setdefault(label, []).append(time_steps(step, it, sync))
    medians = {
        way: {label: statistics.median(values) for label, values in by_label.items()}
        for way, by_label in samples.items()
    }
    table = {}
    for rows, count in cases:
        label = f"decode{rows}_{count}_adapters"
        inline, beside = medians["inline"][label], medians["beside"][label]
        table[label] = {
            "base_ms": round(base[rows], 3),
            "inline_ms": round(inline, 3),
            "beside_ms": round(beside, 3),
            "inline_over_base": round(inline / base[rows], 3),
            "beside_over_base": round(beside / base[rows], 3),
            "beside_over_inline": round(beside / inline, 3),
        }
    return {
        "device": torch.cuda.get_device_name(),
        "model": files.name,
        "dtype": "bfloat16",
        "rank": RANK,
        "modules": "all seven (q, k, v, o, gate, up, down)",
        "decode_context_tokens": args.context,
        "iterations": it,
        "rounds": args.rounds,
        "execution_path": runner.execution_path,
        "recapture_s": {
            way: [round(value, 1) for value in values] for way, values in capture_s.items()
        },
        "steps": table,
        "samples_ms": {
            way: {
                label: [round(value, 3) for value in values] for label, values in by_label.items()
            }
            for way, by_label in samples.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    report["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    given = sys.argv[1:] if argv is None else argv
    report["command"] = " ".join(["python -m benchmarks.lora_side_deltas_ab", *given])
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
