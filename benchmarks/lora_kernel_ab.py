"""The LoRA kernels against another version of them, in one process: decode and prefill layouts.

For `dummy:llama-3-8b` shapes (32 layers, each projection's own random base weights), 64 device
slots of random rank-16 adapters on all seven projections, bf16: one step's projections (a
cuBLAS matmul per projection and layer, 128 a step) with each step layout's LoRA work added,
captured in a CUDA graph and replayed (the median of 3 interleaved rounds of 20 replays each);
the LoRA cost is the graph's time minus the same graph without LoRA. Three LoRA variants run in
the same rounds:

- `baseline`: the kernel modules in `--baseline-dir` (a `lora_shrink.py` and a `lora_expand.py`
  of another revision, e.g. from `git show REV:services/engine/kernels/triton/lora_shrink.py`),
  through the runtime's `apply` after each base matmul;
- `current`: this tree's kernels through `apply` (one after the other behind the matmul);
- `project`: this tree's kernels through `LoRARuntime.project`, as the model runs them (in
  steps of up to `SIDE_SHRINK_MAX_ROWS` rows the shrink runs on a side stream beside the matmul);
- `deltas_first`: the same over a plain `x Wᵀ` base (an `nn.Linear`), the deltas written first
  and the base matmul adding onto them at every row count (`graph_deltas_first`, as the runner's
  "lora-many" graphs and every wider graph run it).

Each variant's outputs are compared with the baseline's first (largest absolute difference: a
rounding of bf16, never more). Prints and writes one JSON report.

    mkdir -p /tmp/lora-baseline && for k in shrink expand; do git show \\
      REV:services/engine/kernels/triton/lora_$k.py > /tmp/lora-baseline/lora_$k.py; done
    python -m benchmarks.lora_kernel_ab --baseline-dir /tmp/lora-baseline --out lora-ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from services.common.protocol.dummy_shapes import DUMMY_SHAPES
from services.engine.lora import runtime as runtime_mod
from services.engine.lora.batch import LoRABatch
from services.engine.lora.projections import PROJECTIONS
from services.engine.lora.slots import LoRASlots
from services.engine.models.config import ModelConfig

SLOTS, RANK = 64, 16
SHRINK_MODULE = "services.engine.kernels.triton.lora_shrink"


def _layouts(seed: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1 / (i + 1) ** 1.1 for i in range(16)])

    def zipf(n: int) -> list[int]:
        return torch.multinomial(weights, n, replacement=True, generator=generator).tolist()

    return {
        "decode: 64 rows of one adapter": [0] * 64,
        "decode: 64 rows of 8 adapters": [row % 8 for row in range(64)],
        "decode: 64 rows of 64 adapters": list(range(64)),
        "decode: 128 rows of 16 adapters": zipf(128),
        "decode: 256 rows of 16 adapters": zipf(256),
        "mixed: 200 decode rows of 16 adapters + 330 prompt rows of 3": (
            zipf(200) + [0] * 150 + [5] * 100 + [9] * 80
        ),
        "prefill: 2048 rows, 512 each of 4 adapters": [
            s for s in (0, 3, 7, 11) for _ in range(512)
        ],
    }


def load_baseline(directory: Path) -> tuple[ModuleType, ModuleType]:
    """The baseline's shrink and expand modules, the expand importing the baseline's shrink."""
    shrink = load_module("sluice_baseline_lora_shrink", directory / "lora_shrink.py")
    current = importlib.import_module(SHRINK_MODULE)
    sys.modules[SHRINK_MODULE] = shrink  # what the baseline expand imports its helpers from
    try:
        expand = load_module("sluice_baseline_lora_expand", directory / "lora_expand.py")
    finally:
        sys.modules[SHRINK_MODULE] = current
    return shrink, expand


def load_module(name: str, path: Path) -> ModuleType:
    """The Python file at `path`, imported as module `name` (another revision's kernels)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton reads a kernel's module globals by name
    spec.loader.exec_module(module)
    return module


def random_slots(config: ModelConfig, device: torch.device) -> LoRASlots:
    slots = LoRASlots(config, max_loras=SLOTS, max_rank=RANK, dtype=torch.bfloat16, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    for name in PROJECTIONS:
        for stack, scale in ((slots.a_stacks[name], 1 / 64), (slots.b_stacks[name], 1 / 4)):
            noise = torch.randn(stack.shape, generator=generator, device=device)
            stack.copy_(noise.mul_(scale))
        slots.ranks[name] = [RANK] * SLOTS
        slots.rank_tensors[name].fill_(RANK)
    return slots


def llama_8b_projections(
    device: torch.device,
) -> tuple[LoRASlots, dict[str, torch.Tensor]]:
    """`dummy:llama-3-8b`'s random LoRA slots and each projection's random base weights
    [layers, out, in] in bf16."""
    settings = {**DUMMY_SHAPES["llama-3-8b"], "architectures": ["LlamaForCausalLM"]}
    config = ModelConfig.from_dict(settings, name="llama-3-8b")
    slots = random_slots(config, device)
    weights = {
        name: torch.randn(config.num_layers, shape.out_features, shape.in_features,
                          device=device, dtype=torch.bfloat16).div_(64)
        for name, shape in slots.shapes.items()
    }  # fmt: skip
    return slots, weights


def baseline_shrink(shrink: Callable[..., None]) -> Callable[..., None]:
    """A baseline's lora_shrink as the runtime calls it: one that takes no workspace (its
    splits added atomically) is called without `partials` and `counters`."""
    if "partials" in inspect.signature(shrink).parameters:
        return shrink

    def without_workspace(*args: Any, partials: Any = None, counters: Any = None, **kw: Any):
        shrink(*args, **kw)

    return without_workspace


def runtimes(
    slots: LoRASlots, baseline: tuple[ModuleType, ModuleType]
) -> dict[str, tuple[runtime_mod.LoRARuntime, bool]]:
    """Each LoRA variant: its runtime and whether it runs through `project`."""
    old = runtime_mod.LoRARuntime(slots, kernels="triton", max_rows=8192)
    old_expand = baseline[1].lora_expand
    old._shrink = baseline_shrink(baseline[0].lora_shrink)

    def expand(*args: Any, sub_blocks: int = 1, write: bool = False, **kwargs: Any) -> None:
        assert not write, "the baseline runs through apply (deltas added after the matmul)"
        old_expand(*args, **kwargs)  # one block per work item: the tables of sub_blocks 1

    old._expand = expand
    old._wide_sub_blocks = 1
    current = runtime_mod.LoRARuntime(slots, kernels="triton", max_rows=8192)
    first = runtime_mod.LoRARuntime(slots, kernels="triton", max_rows=8192)
    first.graph_deltas_first = True
    return {
        "baseline": (old, False),
        "current": (current, False),
        "project": (current, True),
        "deltas_first": (first, True),
    }


def graph_ms(
    runtime: runtime_mod.LoRARuntime | None,
    base_weights: dict[str, torch.Tensor],
    row_slots: list[int],
    *,
    project: bool = False,
    replays: int = 20,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean ms of one replay of the step's projections (with `runtime`'s LoRA work unless
    None), and the last projection outputs of each kind."""
    rows = len(row_slots)
    device = next(iter(base_weights.values())).device
    torch.manual_seed(5)
    xs = {
        n: torch.randn(rows, w.shape[2], device=device, dtype=w.dtype)
        for n, w in base_weights.items()
    }
    ys = {
        n: torch.empty(rows, w.shape[1], device=device, dtype=w.dtype)
        for n, w in base_weights.items()
    }
    if runtime is not None:
        runtime.set_batch(LoRABatch.from_row_slots(row_slots))
    plain = runtime is not None and runtime.graph_deltas_first

    def step() -> None:
        for layer in range(next(iter(base_weights.values())).shape[0]):
            for name in PROJECTIONS:
                weight = base_weights[name][layer]
                if project and runtime is not None:
                    base = _linear(weight) if plain else (lambda t, w=weight: t @ w.T)
                    ys[name] = runtime.project(layer, name, xs[name], base)
                    continue
                torch.matmul(xs[name], weight.T, out=ys[name])
                if runtime is not None:
                    runtime.apply(layer, name, xs[name], ys[name])

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return _replay_ms(graph.replay, replays), ys


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """An nn.Linear without bias over `weight` (no copy): a base `plain_weight` recognizes."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def _replay_ms(replay: Callable[[], None], replays: int) -> float:
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_kernel_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--baseline-dir",
        type=Path,
        required=True,
        help="directory with the baseline's lora_shrink.py and lora_expand.py",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--out", type=Path, default=Path("lora-ab.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lora_kernel_ab needs a CUDA device")
        return 2
    slots, base_weights = llama_8b_projections(torch.device("cuda"))
    variants = runtimes(slots, load_baseline(args.baseline_dir))
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": f"python -m benchmarks.lora_kernel_ab --baseline-dir DIR --rounds {args.rounds}",
        "side_shrink_max_rows": runtime_mod.SIDE_SHRINK_MAX_ROWS,
        "layouts": {},
    }
    for label, row_slots in _layouts(1).items():
        outputs = {
            name: graph_ms(runtime, base_weights, row_slots, project=project, replays=1)[1]
            for name, (runtime, project) in variants.items()
        }
        case: dict[str, Any] = {
            f"max_abs_diff_{name}": max(
                (outputs[name][p].float() - outputs["baseline"][p].float()).abs().max().item()
                for p in PROJECTIONS
            )
            for name in ("current", "project", "deltas_first")
        }
        samples: dict[str, list[float]] = {"base": [], **{name: [] for name in variants}}
        for _ in range(args.rounds):
            samples["base"].append(graph_ms(None, base_weights, row_slots)[0])
            for name, (runtime, project) in variants.items():
                samples[name].append(graph_ms(runtime, base_weights, row_slots, project=project)[0])
        median = {name: statistics.median(values) for name, values in samples.items()}
        case["step_ms"] = {name: round(value, 3) for name, value in median.items()}
        case["lora_ms"] = {name: round(median[name] - median["base"], 3) for name in variants}
        case["lora_ms_over_baseline"] = {
            name: round((median[name] - median["base"]) / (median["baseline"] - median["base"]), 3)
            for name in ("current", "project", "deltas_first")
        }
        report["layouts"][label] = case
        print(label, json.dumps(case), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
