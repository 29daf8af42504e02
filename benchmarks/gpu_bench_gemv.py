"""Microbenchmark of the bs=1 projections: every skinny-matmul configuration and
cuBLAS on the Llama-3-8B matrix shapes, in GB/s of weight streamed.

Each shape is timed over enough distinct weight copies (one per layer, as a decode step reads
them) that L2 cannot hold them, all launches captured in one CUDA graph (as decode runs), with
triton.testing.do_bench's median of the replays. Prints one table per
shape, best first; `--json` writes the numbers. On a GPU machine, from the repository root:
`python -m benchmarks.gpu_bench_gemv --json gemv.json` (benchmarks/gpu_run.sh runs it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (role, N, K, copies): Llama-3-8B's fused projections, lm_head once per step.
SHAPES = (
    ("qkv", 6144, 4096, 32),
    ("output", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 16),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 2),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_bench_gemv", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (batch size)")
    args = parser.parse_args(argv)
    import torch  # after parsing: --help works where Triton is not installed

    from services.engine.kernels.triton.skinny_matmul import candidates, skinny_matmul

    results: dict[str, list[dict]] = {}
    for role, n, k, copies in SHAPES:
        rows = _time_shape(n, k, copies, args.rows, candidates(args.rows), skinny_matmul)
        results[role] = rows
        cublas = next(row for row in rows if row["config"] == "cublas")
        print(f"== {role} N={n} K={k} rows={args.rows}: cuBLAS {cublas['us']} us "
              f"{cublas['gb_s']} GB/s", flush=True)  # fmt: skip
        for row in rows[:6]:
            print(f"   {row['config']:32s} {row['us']:8.2f} us {row['gb_s']:8.1f} GB/s "
                  f"err {row['rel_error']}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _time_shape(n: int, k: int, copies: int, num_rows: int, configs, skinny_matmul) -> list[dict]:
    """cuBLAS and every configuration on `copies` random [n, k] weights, fastest first."""
    import torch

    from services.engine.kernels.triton.skinny_matmul import time_in_graph

    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)
    ]
    x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
    expected = (x.double() @ weights[0].double().T).float()
    rows = []
    for config in (None, *configs):
        if config is None:
            multiply = lambda weight: torch.nn.functional.linear(x, weight)  # noqa: E731
        else:
            multiply = lambda weight, c=config: skinny_matmul(x, weight, c)  # noqa: E731

        def run(multiply=multiply) -> None:
            for weight in weights:
                multiply(weight)

        out = multiply(weights[0]).float()
        error = float((out - expected).norm() / expected.norm())
        elapsed_ms = time_in_graph(run) / copies
        rows.append(
            {
                "config": "cublas" if config is None else str(list(config)),
                "us": round(elapsed_ms * 1e3, 2),
                "gb_s": round(n * k * 2 / (elapsed_ms * 1e-3) / 1e9, 1),
                "rel_error": round(error, 5),
            }
        )
    rows.sort(key=lambda row: row["us"])
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
