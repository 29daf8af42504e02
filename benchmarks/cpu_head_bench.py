"""The bf16 LM head on CPU, four ways, in one process: the native greedy head, the native
float32-logit head, and oneDNN's packed bf16 matmul with and without the native row argmax.

    python -m benchmarks.cpu_head_bench [--rows 1,8,32,64] [--hidden 576] [--vocab 49152]
        [--threads 2] [--repeats 40]

Prints milliseconds per call (mean of `--repeats` after 5 warmup calls) for each row count.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

from services.engine.kernels.cpu.cpu_native import cpu_kernels
from services.engine.layers.linear import pack_weight, packed_linear


def _ms(call: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_head_bench", description=__doc__
    )
    parser.add_argument("--rows", default="1,8,32,64", help="row counts, comma separated")
    parser.add_argument("--hidden", type=int, default=576, help="hidden size (SmolLM2: 576)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size")
    parser.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    parser.add_argument("--repeats", type=int, default=40, help="timed calls per figure")
    args = parser.parse_args(argv)
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_greedy_head:
        parser.error("needs the native CPU kernels built with AVX-512 BF16")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden, generator=generator).to(torch.bfloat16)
    native, packed = kernels.pack_greedy_head(weight), pack_weight(weight)
    print(f"hidden {args.hidden}, vocab {args.vocab}, {args.threads} threads; ms per call")
    print(f"{'rows':>5} {'greedy':>8} {'lm_head':>8} {'onednn+argmax':>14} {'onednn':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(rows, args.hidden, generator=generator).to(torch.bfloat16)
        calls = (
            lambda x=hidden: kernels.greedy_head(x, native, args.vocab),
            lambda x=hidden: kernels.lm_head(x, native, args.vocab),
            lambda x=hidden: kernels.argmax_rows(packed_linear(x, packed)),
            lambda x=hidden: packed_linear(x, packed),
        )
        greedy, logits, onednn_argmax, onednn = (_ms(call, args.repeats) for call in calls)
        print(f"{rows:>5} {greedy:>8.3g} {logits:>8.3g} {onednn_argmax:>14.3g} {onednn:>8.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
