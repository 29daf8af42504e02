"""What folding one adapter's LoRA into the base kernels costs each kernel (GPU).

A decode step of one adapter (services/engine/lora/fused.py) runs each projection's matmul
over its weight with the adapter's A below it, and adds u Bᵀ inside the kernel that reads the
projection output next. This times, in the same process, at `--rows` rows of
`dummy:llama-3-8b`'s shapes in bfloat16:

- each projection's cuBLAS matmul over W and over W with `--extras` rows more (what the wider
  output costs, and which widths cuBLAS runs best), each launch of the graph reading another
  layer's weight (`--layers` of them) as the model does, so no weight is served from L2;
- the residual add + RMSNorm, SwiGLU and rotary + KV-store kernels without and with the
  epilogue (rank `--rank`, every row the adapter's).

Each figure: `--reps` launches captured in one CUDA graph, the median over `--iterations`
replays, per launch in microseconds (tp_sum_norm_bench.time_path), at each of `--rows`. Prints
one JSON report (`--out` too).

    python -m benchmarks.lora_epilogue_bench --out lora-epilogue.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as functional

from benchmarks.tp_sum_norm_bench import time_path

# (in features, out features, slices) of the four fused projections of Llama-3-8B
SHAPES = {
    "qkv": (4096, 6144, 3),
    "o": (4096, 4096, 1),
    "gate_up": (4096, 28672, 2),
    "down": (14336, 4096, 1),
}


EXTRAS = (0, 16, 32, 48, 64, 96, 128, 192, 256)


def graph_us(fn: Callable[[], Any], reps: int, iterations: int) -> float:
    """Median microseconds per call of `fn` over replays of a CUDA graph of `reps` calls."""
    return time_path(lambda turn: fn(), "cuda", calls=reps, replays=iterations)[0]


def matmul_us(
    rows_list: list[int], extras: list[int], layers: int, reps: int, iterations: int
) -> dict[str, dict[str, dict[str, float]]]:
    """{rows: {projection: {extra rows: µs a launch}}}: x W_lᵀ with W_l [out + extra, in],
    the graph's launches cycling through `layers` weights."""
    device, dtype = "cuda", torch.bfloat16
    times: dict[str, dict[str, dict[str, float]]] = {str(rows): {} for rows in rows_list}
    for name, (k, n, _slices) in SHAPES.items():
        inputs = {rows: torch.randn(rows, k, device=device, dtype=dtype) for rows in rows_list}
        for extra in extras:
            weights = [
                torch.randn(n + extra, k, device=device, dtype=dtype) * 0.01 for _ in range(layers)
            ]
            for rows, x in inputs.items():
                run = lambda turn, x=x, w=weights: functional.linear(x, w[turn])  # noqa: E731
                per_launch = time_path(run, device, calls=reps, replays=iterations, turns=layers)
                times[str(rows)].setdefault(name, {})[str(extra)] = per_launch[0]
            del weights
            torch.cuda.empty_cache()
    return times


def kernels_us(rows: int, rank: int, reps: int, iterations: int) -> dict[str, dict[str, float]]:
    """The three consumer kernels without and with the epilogue, µs a launch."""
    from services.engine.kernels.triton.lora_epilogue import LoRAEpilogue
    from services.engine.kernels.triton.rms_norm import rms_norm
    from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store
    from services.engine.kernels.triton.swiglu import swiglu

    device, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    rank_tensor = torch.tensor([rank], dtype=torch.int32, device=device)
    rows_on = torch.ones(rows, dtype=torch.int32, device=device)

    def epilogue(wide: torch.Tensor, width: int, bt: torch.Tensor) -> LoRAEpilogue:
        return LoRAEpilogue(wide[:, width:], bt, rows_on, rank_tensor, rank)

    kernels: dict[str, dict[str, float]] = {}
    hidden = SHAPES["o"][1]
    wide = randn(rows, hidden + rank)
    residual, weight = randn(rows, hidden), randn(hidden).abs()
    lora, plain = epilogue(wide, hidden, randn(rank, hidden)), wide[:, :hidden].contiguous()
    kernels["add_rms_norm"] = {
        "plain": graph_us(lambda: rms_norm(plain, residual, weight, 1e-5), reps, iterations),
        "epilogue": graph_us(
            lambda: rms_norm(wide[:, :hidden], residual, weight, 1e-5, lora=lora), reps, iterations
        ),
    }
    width = SHAPES["gate_up"][1]
    wide_gate_up = randn(rows, width + 2 * rank)
    lora_gate_up = epilogue(wide_gate_up, width, randn(rank, width))
    plain_gate_up = wide_gate_up[:, :width].contiguous()
    kernels["swiglu"] = {
        "plain": graph_us(lambda: swiglu(plain_gate_up), reps, iterations),
        "epilogue": graph_us(
            lambda: swiglu(wide_gate_up[:, :width], lora=lora_gate_up), reps, iterations
        ),
    }
    heads, kv_heads, head_dim = 32, 8, 128
    width = SHAPES["qkv"][1]
    wide_qkv = randn(rows, width + 3 * rank)
    lora_qkv = epilogue(wide_qkv, width, randn(rank, width))
    cos = torch.randn(8192, head_dim // 2, device=device)
    sin = torch.randn(8192, head_dim // 2, device=device)
    positions = torch.arange(rows, device=device) + 100
    slots = torch.arange(rows, device=device)
    blocks = (rows + 15) // 16
    key_cache = torch.zeros(blocks, 16, kv_heads, head_dim, device=device, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)

    def rotary(source: torch.Tensor, lora: LoRAEpilogue | None) -> torch.Tensor:
        query, key, value = source[:, :width].split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        return rotary_kv_store(
            query, key, value, positions, cos, sin, slots, key_cache, value_cache, lora=lora
        )

    plain_qkv = wide_qkv[:, :width].contiguous()
    kernels["rotary_kv_store"] = {
        "plain": graph_us(lambda: rotary(plain_qkv, None), reps, iterations),
        "epilogue": graph_us(lambda: rotary(wide_qkv, lora_qkv), reps, iterations),
    }
    return kernels


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_epilogue_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rows", type=_ints, default=[16, 32, 64], help="rows of the step, comma-separated"
    )
    parser.add_argument("--rank", type=int, default=16, help="the adapter's rank (slice width)")
    parser.add_argument(
        "--extras",
        type=_ints,
        default=list(EXTRAS),
        help="rows added below each weight, comma-separated",
    )
    parser.add_argument("--layers", type=int, default=32, help="weights a matmul graph cycles")
    parser.add_argument("--reps", type=int, default=32, help="launches in the graph")
    parser.add_argument("--iterations", type=int, default=20, help="graph replays")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    report = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python -m benchmarks.lora_epilogue_bench", *raw]),
        "rows": args.rows,
        "rank": args.rank,
        "layers": args.layers,
        "matmul_us_by_extra_rows": matmul_us(
            args.rows, args.extras, args.layers, args.reps, args.iterations
        ),
        "kernel_us": {
            str(rows): kernels_us(rows, args.rank, args.reps, args.iterations) for rows in args.rows
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
