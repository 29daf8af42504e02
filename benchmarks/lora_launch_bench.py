"""What the LoRA kernels cost a step outside CUDA graphs: eager launches at step shapes.

    python -m benchmarks.lora_launch_bench --out lora-launch.json      # on an NVIDIA GPU

Decode steps replay CUDA graphs with the shrink/expand kernels inside; prefill and mixed steps
launch them eagerly, 2 per projection per layer (256 for a 32-layer Llama). For
`dummy:llama-3-8b` shapes (one layer's buffers, run 32 times), 16 slots of random rank-16
adapters on all seven projections, bf16, this times the LoRA work of a whole step in four row
layouts (a mixed step of 200 decode rows over 16 adapters plus 330 prompt rows of 3; decode
rows of 16 adapters; a 2048-row prefill of 4) as GPU time (CUDA events) and host time (the
launching thread), beside the base projections' matmuls of the same rows (cuBLAS, same run),
for the torch path and for the Triton kernels: their defaults launched through Triton's own
dispatch and directly (the serving path, services/engine/kernels/triton/launch.py), and other
launch settings (programs per SM, rows per tile, K per split, output columns per block, blocks
per expand work item). When host time equals GPU time, the launches, not the kernels, set the
step's cost.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from services.common.protocol.dummy_shapes import DUMMY_SHAPES
from services.engine.kernels.triton import launch as launch_mod
from services.engine.kernels.triton import lora_expand as expand_mod
from services.engine.kernels.triton import lora_shrink as shrink_mod
from services.engine.lora import batch as batch_mod
from services.engine.lora import runtime as runtime_mod
from services.engine.lora.batch import LoRABatch
from services.engine.lora.projections import PROJECTIONS
from services.engine.lora.slots import LoRASlots
from services.engine.lora.weights import AdapterWeights, ProjectionWeights
from services.engine.models.config import ModelConfig

LAYERS = 32
SLOTS = 16
RANK = 16
# (programs per SM, rows per tile, decode K per split, prefill K per split, expand BLOCK_N,
# expand blocks per work item in prefill-sized steps)
VARIANTS = [
    (8, 16, 256, 1024, 256, 4),  # the defaults
    (8, 16, 256, 1024, 256, 1),
    (8, 16, 256, 1024, 256, 2),
    (8, 16, 256, 1024, 256, 8),
    (8, 16, 256, 1024, 128, 8),
    (16, 16, 256, 1024, 256, 4),
    (4, 16, 256, 1024, 256, 4),
    (8, 32, 256, 1024, 256, 4),
    (8, 16, 512, 1024, 256, 4),
]


def _layouts(seed: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1 / (i + 1) ** 1.1 for i in range(SLOTS)])

    def zipf(n: int) -> list[int]:
        return torch.multinomial(weights, n, replacement=True, generator=generator).tolist()

    return {
        "mixed: 200 decode rows of 16 adapters + 330 prompt rows of 3": (
            zipf(200) + [0] * 150 + [5] * 100 + [9] * 80
        ),
        "decode: 256 rows of 16 adapters": zipf(256),
        "decode: 64 rows, 4 each of 16 adapters": list(range(SLOTS)) * 4,
        "prefill: 2048 rows, 512 each of 4 adapters": [
            s for s in (0, 3, 7, 11) for _ in range(512)
        ],
    }


def _timed(fn: Callable[[], None], reps: int) -> tuple[float, float]:
    """(GPU ms, host ms) per call: CUDA events around `reps` calls, and the host's clock."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    host_ms = (time.perf_counter() - began) * 1e3 / reps
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host_ms


def _filled_slots(config: ModelConfig) -> LoRASlots:
    slots = LoRASlots(config, max_loras=SLOTS, max_rank=RANK, dtype=torch.bfloat16, device="cuda")
    for slot in range(SLOTS):
        layer = {}
        for name in PROJECTIONS:
            shape = slots.shapes[name]
            a = torch.randn(shape.num_slices, RANK, shape.in_features) / 64
            b = torch.randn(shape.out_features, RANK) / 4
            layer[name] = ProjectionWeights(a.to(torch.bfloat16), b.to(torch.bfloat16))
        slots.write(slot, AdapterWeights(f"a{slot}", "0" * 64, RANK, frozenset(), (layer,)))
    return slots


def _step_ms(runtime: runtime_mod.LoRARuntime, row_slots: list[int]) -> tuple[float, float]:
    """A whole step's LoRA work (every projection of LAYERS layers) for these rows."""
    shapes = runtime.slots.shapes
    rows = len(row_slots)
    xs = {
        n: torch.randn(rows, s.in_features, dtype=torch.bfloat16, device="cuda")
        for n, s in shapes.items()
    }
    ys = {
        n: torch.randn(rows, s.out_features, dtype=torch.bfloat16, device="cuda")
        for n, s in shapes.items()
    }
    runtime.set_batch(LoRABatch.from_row_slots(row_slots))

    def step() -> None:
        for _ in range(LAYERS):
            for name in PROJECTIONS:
                runtime.apply(0, name, xs[name], ys[name])

    return _timed(step, reps=10)


def _base_ms(slots: LoRASlots, rows: int) -> float:
    """The base projections' matmuls of a whole step for `rows` rows (cuBLAS)."""
    weights = {
        n: torch.randn(s.out_features, s.in_features, dtype=torch.bfloat16, device="cuda")
        for n, s in slots.shapes.items()
    }
    inputs = {
        n: torch.randn(rows, w.shape[1], dtype=torch.bfloat16, device="cuda")
        for n, w in weights.items()
    }

    def step() -> None:
        for _ in range(LAYERS):
            for name in PROJECTIONS:
                torch.matmul(inputs[name], weights[name].T)

    return _timed(step, reps=10)[0]


def _set_variant(variant: tuple[int, ...]) -> None:
    """Set the kernels' launch constants (a runtime made afterwards builds its tables
    from them)."""
    programs, tile_rows, decode_k, prefill_k, block_n, sub_blocks = variant
    shrink_mod.PROGRAMS_PER_SM = programs
    batch_mod.TILE_ROWS = runtime_mod.TILE_ROWS = tile_rows
    shrink_mod.DECODE_K_PER_SPLIT, shrink_mod.PREFILL_K_PER_SPLIT = decode_k, prefill_k
    expand_mod.BLOCK_N, expand_mod.WIDE_SUB_BLOCKS = block_n, sub_blocks
    shrink_mod._shrink_launch.cache_clear()  # its constexprs follow the K per split


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_launch_bench")
    parser.add_argument("--out", type=Path, default=Path("lora-launch.json"))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("lora_launch_bench needs a CUDA device")
        return 2
    settings = {**DUMMY_SHAPES["llama-3-8b"], "num_hidden_layers": 1}
    config = ModelConfig.from_dict({**settings, "architectures": ["LlamaForCausalLM"]}, name="l8")
    torch.manual_seed(args.seed)
    slots = _filled_slots(config)
    layouts = _layouts(args.seed)
    report = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m benchmarks.lora_launch_bench --out " + str(args.out),
        "base_matmuls_ms": {
            name: round(_base_ms(slots, len(rows)), 3) for name, rows in layouts.items()
        },
        "runs": [],
    }
    print(json.dumps(report["base_matmuls_ms"], indent=1), flush=True)
    # The defaults through Triton's own dispatch on every launch, then with direct launches
    # (kernels/triton/launch.py, the serving path), then the other settings.
    runs = [
        ("torch", None, True),
        ("triton", VARIANTS[0], False),
        *(("triton", variant, True) for variant in VARIANTS),
    ]
    for kernels, variant, direct in runs:
        launch_mod.DIRECT_LAUNCH = direct
        if variant is not None:
            _set_variant(variant)
        runtime = runtime_mod.LoRARuntime(slots, kernels=kernels, max_rows=8192)
        label = kernels
        if variant is not None:
            label = "triton pps={} tile={} dk={} pk={} bn={} sub={}".format(*variant)
            label += ", direct launches" if direct else ", Triton's dispatch"
        for name, rows in layouts.items():
            gpu_ms, host_ms = _step_ms(runtime, rows)
            run = {
                "kernels": label,
                "layout": name,
                "gpu_ms": round(gpu_ms, 3),
                "host_ms": round(host_ms, 3),
            }
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
