"""Paged decode attention on a GPU: a bf16 and a float8 (kv_cache_dtype fp8) KV cache.

One layer's decode attention of `--batch` sequences of `--context` cached tokens each
(`dummy:llama-3-8b`'s 32 query heads over 8 KV heads of 128, blocks of 16 tokens scattered
through the cache), timed by `triton.testing.do_bench` for each cache type: the kernel as the
engine launches it (`paged_decode_attention`), then every setting of the split kernel in a
sweep (splits, tokens a tile: 32 to 256, warps, pipeline stages), each checked against the
engine's launch. Prints, per cache type, the engine's launch and the fastest settings: ms a
layer, the cache bytes read over that time (TB/s) and the relative difference of the output.

    python -m benchmarks.decode_attention_bench --out decode-attention.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from typing import Any

_LOG2E = 1.4426950408889634


class _Setup:
    """One layer's query, block tables and lengths, shared by both cache types."""

    def __init__(self, batch: int, context: int) -> None:
        import torch

        torch.manual_seed(0)
        self.batch, self.context, self.block_size = batch, context, 16
        self.heads, self.kv_heads, self.head_dim = 32, 8, 128
        per_sequence = -(-context // self.block_size)
        self.num_blocks = batch * per_sequence + 8
        tables = torch.randperm(self.num_blocks)[: batch * per_sequence]
        self.tables = tables.view(batch, per_sequence).to(torch.int32).cuda()
        self.lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.query = torch.randn(batch, self.heads, self.head_dim, device="cuda").bfloat16()
        self.scale = self.head_dim**-0.5


def _split_launch(setup: _Setup, key_cache, value_cache, out, setting: tuple[int, ...]):
    """A launch of the split kernel (and merge, with several splits) at one setting."""
    import torch
    import triton

    from services.engine.kernels.triton import decode_attention as kernels

    splits, block_n, warps, stages = setting
    mode = 1 if splits == 1 else 0  # one split writes; more: the merge kernel after
    parts = (setup.batch, setup.heads, splits)
    partial_out = torch.empty(
        (*parts, setup.head_dim) if mode == 0 else (1, setup.head_dim),
        dtype=torch.float32,
        device="cuda",
    )
    partial_lse = torch.empty(parts if mode == 0 else (1,), dtype=torch.float32, device="cuda")

    def launch() -> None:
        kernels._decode_split_kernel[(setup.batch, setup.kv_heads, splits)](
            setup.query, key_cache, value_cache, setup.tables, setup.lens, partial_out,
            partial_lse, out, partial_lse, setup.scale * _LOG2E, setup.tables.stride(0),
            setup.heads, setup.kv_heads, NUM_SPLITS=splits,
            GROUP=setup.heads // setup.kv_heads, GROUP_P=16, HEAD_DIM=setup.head_dim,
            BLOCK_SIZE=setup.block_size, BLOCK_N=block_n, MODE=mode, USE_PDL=False,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        if mode == 0:
            kernels._decode_merge_kernel[(setup.batch * setup.heads,)](
                partial_out, partial_lse, out, NUM_SPLITS=splits,
                SPLITS_P=triton.next_power_of_2(splits), HEAD_DIM=setup.head_dim,
                USE_PDL=False, num_warps=2,
            )  # fmt: skip

    return launch


def time_cache(setup: _Setup, dtype) -> dict[str, Any]:
    """The engine's launch and the sweep over one cache type."""
    import torch
    from triton.testing import do_bench

    from services.engine.kernels.triton.decode_attention import paged_decode_attention

    shape = (setup.num_blocks, setup.block_size, setup.kv_heads, setup.head_dim)
    key_cache = torch.randn(shape, device="cuda").to(dtype)
    value_cache = torch.randn(shape, device="cuda").to(dtype)
    cache_bytes = 2 * setup.batch * setup.context * setup.kv_heads * setup.head_dim
    cache_bytes *= key_cache.element_size()

    def engine_launch() -> torch.Tensor:
        return paged_decode_attention(
            setup.query, key_cache, value_cache, setup.tables, setup.lens, setup.scale
        )

    want = engine_launch().float()

    def figures(ms: float, out: torch.Tensor) -> dict[str, float]:
        difference = (out.float() - want).norm() / want.norm()
        return {
            "ms": round(ms, 4),
            "tb_s": round(cache_bytes / ms / 1e9, 2),
            "difference": round(float(difference), 5),
        }

    entry: dict[str, Any] = {"engine": figures(do_bench(engine_launch, warmup=10, rep=50), want)}
    entry["sweep"] = {}
    for setting in itertools.product((1, 2, 4), (32, 64, 128, 256), (4, 8), (2, 3, 4)):
        out = torch.empty_like(setup.query)
        name = "splits {}, tile {}, warps {}, stages {}".format(*setting)
        launch = _split_launch(setup, key_cache, value_cache, out, setting)
        try:
            launch()
            torch.cuda.synchronize()
            entry["sweep"][name] = figures(do_bench(launch, warmup=10, rep=50), out)
        except Exception as error:  # noqa: BLE001 - a setting that does not compile
            entry["sweep"][name] = {"error": str(error)[:200]}
    timed = sorted((value["ms"], name) for name, value in entry["sweep"].items() if "ms" in value)
    entry["fastest"] = [name for _, name in timed[:5]]
    return entry


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    setup = _Setup(args.batch, args.context)
    flags = f"--batch {args.batch} --context {args.context}"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"python -m benchmarks.decode_attention_bench {flags}",
        "shape": {
            "batch": setup.batch,
            "context": setup.context,
            "heads": setup.heads,
            "kv_heads": setup.kv_heads,
            "head_dim": setup.head_dim,
            "block_size": setup.block_size,
        },  # fmt: skip
        "caches": {},
    }
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        entry = report["caches"][str(dtype).removeprefix("torch.")] = time_cache(setup, dtype)
        print(dtype, "engine:", entry["engine"], flush=True)
        for name in entry["fastest"]:
            print("   ", name, entry["sweep"][name], flush=True)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_attention_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=384, help="sequences (the H100's cap)")
    parser.add_argument("--context", type=int, default=640, help="cached tokens each")
    parser.add_argument("--out", default=None, help="also write the report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("decode_attention_bench needs a CUDA device", file=sys.stderr)
        return 2
    report = run(args)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
