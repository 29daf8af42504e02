"""The LoRA shrink's K splits summed in split order against float atomics, in one process.

The graphs of `benchmarks.lora_kernel_ab` (a step's 128 cuBLAS projections of `dummy:llama-3-8b`
with each decode layout's LoRA work, captured in a CUDA graph and replayed; 64 device slots of
random rank-16 adapters on all seven projections, bf16), through `LoRARuntime.project` as the
model runs them: the shrink beside the matmul (`project`, 1-3 adapters in graphs of up to 64
rows) and the deltas written first (`first`, every wider graph and graphs of 4+ adapters).
Variants, in the same rounds (median of 3, each the graph's time minus the same graph without
LoRA, in ms):

- `old_project`, `old_first`: the shrink of `--baseline-dir` (a `lora_shrink.py` of a revision
  whose splits add into u with float atomics, e.g. `git show REV:services/engine/kernels/triton/
  lora_shrink.py`), with this tree's expand;
- `s{N}_project`, `s{N}_first`: this tree's shrink (splits summed in split order through the
  workspace) with N input features a split in decode-sized steps, for each N of
  `--split-sizes` (the default, `DECODE_K_PER_SPLIT`, is 256).

    python -m benchmarks.lora_split_sums_ab --baseline-dir DIR --out lora-split-sums.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import lora_kernel_ab as ab
from services.engine.kernels.triton import lora_shrink as shrink_mod
from services.engine.lora import runtime as runtime_mod


def make_runtime(
    slots: Any, split: int, deltas_first: bool, old_shrink: Any | None
) -> runtime_mod.LoRARuntime:
    """A runtime whose decode-sized shrinks split K every `split` features (or the baseline's
    shrink, which takes no workspace)."""
    shrink_mod.DECODE_K_PER_SPLIT = split
    shrink_mod._shrink_launch.cache_clear()
    runtime = runtime_mod.LoRARuntime(slots, kernels="triton", max_rows=8192)
    runtime.graph_deltas_first = deltas_first
    if old_shrink is not None:
        runtime._shrink = ab.baseline_shrink(old_shrink)
    return runtime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_split_sums_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--baseline-dir", type=Path, required=True, help="directory with the baseline's shrink"
    )
    parser.add_argument("--split-sizes", default="256,512,1024", help="decode K per split")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--out", type=Path, default=Path("lora-split-sums.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lora_split_sums_ab needs a CUDA device")
        return 2
    slots, weights = ab.llama_8b_projections(torch.device("cuda"))
    old_shrink = ab.load_baseline(args.baseline_dir)[0].lora_shrink
    default_split = shrink_mod.DECODE_K_PER_SPLIT
    variants = {"old_project": (default_split, False, old_shrink)}
    variants["old_first"] = (default_split, True, old_shrink)
    for split in (int(value) for value in args.split_sizes.split(",") if value):
        variants[f"s{split}_project"] = (split, False, None)
        variants[f"s{split}_first"] = (split, True, None)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.lora_split_sums_ab --baseline-dir DIR "
        f"--split-sizes {args.split_sizes} --rounds {args.rounds}",
        "layouts": {},
    }
    layouts = {k: v for k, v in ab._layouts(1).items() if k.startswith("decode")}
    for label, row_slots in layouts.items():
        samples: dict[str, list[float]] = {"base": [], **{name: [] for name in variants}}
        for _ in range(args.rounds):
            samples["base"].append(ab.graph_ms(None, weights, row_slots)[0])
            for name, (split, first, baseline) in variants.items():
                runtime = make_runtime(slots, split, first, baseline)
                samples[name].append(ab.graph_ms(runtime, weights, row_slots, project=True)[0])
                del runtime
        median = {name: statistics.median(values) for name, values in samples.items()}
        case = {name: round(median[name] - median["base"], 3) for name in variants}
        case["base_ms"] = round(median["base"], 3)
        report["layouts"][label] = case
        print(label, json.dumps(case), flush=True)
    shrink_mod.DECODE_K_PER_SPLIT = default_split
    shrink_mod._shrink_launch.cache_clear()
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
