"""The host time of one direct kernel launch (`CachedLaunch`), against another version of it.

An eager step (prefill or mixed) launches every kernel from Python: ~190 a step for the base
model of a 32-layer Llama and ~420 with LoRA adapters, and where the step's kernels are short
its launches, not the device, set its pace. This times `CachedLaunch.__call__` on this machine
for the LoRA shrink's argument list (13 positional arguments, 9 of them tensors, and 14
constexprs and options), the compiled kernel replaced by a launcher that does nothing and the
driver's stream lookup by a constant, so only the Python work of the launch path counts (no
GPU needed). The baseline is `launch.py` of another revision, loaded beside this tree's, the
two timed in alternating rounds (median per launch of each).

    git show REV:services/engine/kernels/triton/launch.py > /tmp/launch_base.py
    python -m benchmarks.launch_host_bench --baseline /tmp/launch_base.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.lora_kernel_ab import load_module
from services.engine.kernels.triton import launch as current

NAMES = [f"p{i}" for i in range(13)] + [f"C{i}" for i in range(8)] + ["BLOCK_M", "USE_PDL"]


class _Compiled:
    function = "function"
    packed_metadata = "metadata"

    def run(self, *args: Any) -> None:
        pass


class _Kernel:
    arg_names = NAMES

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **named: _Compiled()


class _Driver:
    class active:  # noqa: N801 - the shape of triton.runtime.driver.active
        @staticmethod
        def get_current_stream(device: int) -> int:
            return 0


def launch_us(module: ModuleType, launches: int) -> float:
    """µs per launch of a shrink-like argument list through `module`'s CachedLaunch."""
    saved, module.driver = module.driver, _Driver
    try:
        return _time_launches(module, launches)
    finally:
        module.driver = saved


def _time_launches(module: ModuleType, launches: int) -> float:
    cached = module.CachedLaunch(_Kernel())
    tensors = [torch.empty(64) for _ in range(9)]
    args = (*tensors, 4096, 48, 64, 1)
    named = {f"C{i}": value for i, value in enumerate((4096, 256, 48, 64, 16, 16, True, False))}
    named.update(BLOCK_M=16, num_warps=4, USE_PDL=True, launch_pdl=True)
    cached((8,), *args, **named)  # the first call takes the JIT path
    started = time.perf_counter()
    for _ in range(launches):
        cached((8,), *args, **named)
    elapsed = time.perf_counter() - started
    if cached.direct_launches != launches:
        raise SystemExit("a launch left the direct path")
    return 1e6 * elapsed / launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.launch_host_bench", description=__doc__
    )
    parser.add_argument("--baseline", type=Path, required=True, help="another launch.py")
    parser.add_argument("--launches", type=int, default=20000, help="launches per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    baseline = load_module("sluice_launch_baseline", args.baseline)
    samples: dict[str, list[float]] = {"baseline": [], "current": []}
    for _ in range(args.rounds):
        samples["baseline"].append(launch_us(baseline, args.launches))
        samples["current"].append(launch_us(current, args.launches))
    median = {name: statistics.median(values) for name, values in samples.items()}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "us_per_launch": {name: round(value, 3) for name, value in median.items()},
        "current_over_baseline": round(median["current"] / median["baseline"], 3),
        "rounds": args.rounds,
        "launches_per_round": args.launches,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
