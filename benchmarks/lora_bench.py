"""What multi-LoRA costs one engine step, against the base step measured in the same run.

GPU mode (`--mode gpu`, default shape dummy:llama-3-8b in bfloat16, random weights, no files):
the CUDA runner's fast path and its decode graphs, first without LoRA (the base step), then
with the LoRA runtime bound (graphs captured again with the shrink/expand kernels in every
replay) and 64 slots of random rank-16 adapters on all seven projections:

- decode, batch of 64: base rows only through the LoRA-capable graphs, one adapter for the
  whole batch (its LoRA inside the base kernels, services/engine/lora/fused.py, and the same
  step through the LoRA kernels' graphs), 8 adapters, and 64 distinct adapters (one per row);
- prefill of 8192 tokens: 4 sequences of 2048 tokens (4 adapters) and 8 sequences of 1024
  tokens (8 adapters), each against its own base step;
- eager steps (16 prompts of 512 tokens; 12 of 512 with 128 decode rows; the two prefills
  above), in interleaved rounds against the same step on the base model: the kernels' deltas
  written before the base matmul, added after it, gate_up's added by SwiGLU as it reads them
  (the default; for runs through cuBLAS too, or for the kernels' tiles only), and runs of at
  least 512, 1024, 2048 (the default) or 4096 rows through cuBLAS instead of the kernels;
- the LoRA kernels of one decode step (every layer's four fused projections) launched eagerly
  one by one: on a fast GPU this is bounded by the host's launch rate, not the kernels (the
  graph-captured rows above are the kernels' cost); and the bytes of A and B a step of N
  distinct adapters must read, over the measured copy bandwidth: the floor no kernel goes
  under.

CPU mode (`--mode cpu`, the default model): the CPU runner's decode step of 32 sequences with
k in {1, 4, 16} distinct random rank-16 adapters (all seven projections) against the same step
of base rows only, in interleaved rounds (median of each), plus the step before LoRA was bound;
each k twice, the LoRA math through the native kernels (the default where they build) and
through torch ops (`*_torch_ops`).

Steps run through the runner directly (no tokenizer, gRPC, Ray or Redis), each timed as the
mean wall time of `--iterations` back-to-back steps after warm-up, with `begin_step` (the
engine's per-step LoRA layout) inside the timed loop. Prints one JSON report (`--output` too).

    python -m benchmarks.lora_bench --mode gpu --output lora-gpu.json
    python -m benchmarks.lora_bench --mode cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from services.common.model_files import ModelFiles
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from services.engine.lora.config import LoRAConfig
from services.engine.lora.engine_adapters import EngineAdapters
from services.engine.lora.projections import PROJECTIONS
from services.engine.lora.runtime import LONG_SEGMENT_ROWS
from services.engine.lora.weights import AdapterWeights, ProjectionWeights

RANK = 16
BLOCK_SIZE = 16
# eager_ab's settings of the runtime: (write_tile_deltas, long_segment_rows, SwiGLU adding
# gate_up's deltas as it reads them (--lora-fused-swiglu), and the long runs' too).
EAGER_VARIANTS = {
    "deltas_first": (True, LONG_SEGMENT_ROWS, False, False),
    "fused_swiglu": (True, LONG_SEGMENT_ROWS, True, True),  # the default
    "fused_swiglu_short_runs_only": (True, LONG_SEGMENT_ROWS, True, False),
    "tiles_added_after": (False, LONG_SEGMENT_ROWS, False, False),
    "runs_of_512_through_cublas": (True, 512, True, True),
    "runs_of_1024_through_cublas": (True, 1024, True, True),
    "runs_of_4096_through_cublas": (True, 4096, True, True),
}
MIXED_CONTEXT = 256  # tokens before each decode row of the mixed step


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_bench", description=__doc__)
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--shape", default="llama-3-8b", help="dummy shape (gpu mode)")
    parser.add_argument("--model", default=None, help="model (cpu mode; default model)")
    parser.add_argument("--iterations", type=int, default=30, help="timed steps per sample")
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved samples (cpu mode; gpu: eager A/B)"
    )
    parser.add_argument("--context", type=int, default=512, help="tokens before each decode")
    parser.add_argument("--output", type=Path, default=None)
    return parser


# ---- shared ----------------------------------------------------------------------------------
def random_adapter(
    adapters: EngineAdapters, name: str, seed: int, device: torch.device, std: float = 0.01
) -> AdapterWeights:
    """Rank-RANK factors on all seven modules (the four fused projections, every slice)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = adapters.dtype
    layers = []
    for _ in range(adapters.model_config.num_layers):
        layer = {}
        for projection in PROJECTIONS:
            shape = adapters.slots.shapes[projection]
            a = torch.randn(
                (shape.num_slices, RANK, shape.in_features), generator=generator, device=device
            )
            b = torch.randn((shape.out_features, RANK), generator=generator, device=device)
            layer[projection] = ProjectionWeights((a * std).to(dtype), (b * std).to(dtype))
        layers.append(layer)
    modules = frozenset(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    return AdapterWeights(name, f"random-{seed}", RANK, modules, tuple(layers))


class Blocks:
    """Hands out KV blocks to synthetic sequences (never freed: the cache is sized for all)."""

    def __init__(self, num_blocks: int) -> None:
        self.next = 0
        self.num_blocks = num_blocks

    def take(self, tokens: int) -> list[int]:
        count = -(-tokens // BLOCK_SIZE)
        if self.next + count > self.num_blocks:
            raise RuntimeError(f"KV cache too small: {self.next + count} > {self.num_blocks}")
        table = list(range(self.next, self.next + count))
        self.next += count
        return table


def decode_batch(blocks: Blocks, rows: int, context: int, vocab: int) -> ScheduledBatch:
    return ScheduledBatch(
        [
            ScheduledSequence(
                seq_id=index,
                token_ids=[(index * 7919) % vocab],
                start_position=context,
                block_table=blocks.take(context + 1),
                needs_logits=True,
            )
            for index in range(rows)
        ]
    )


def prefill_batch(blocks: Blocks, sequences: int, tokens: int, vocab: int) -> ScheduledBatch:
    generator = torch.Generator().manual_seed(sequences)
    return ScheduledBatch(
        [
            ScheduledSequence(
                seq_id=1000 + index,
                token_ids=torch.randint(0, vocab, (tokens,), generator=generator).tolist(),
                start_position=0,
                block_table=blocks.take(tokens),
                needs_logits=True,
            )
            for index in range(sequences)
        ]
    )


def with_slots(batch: ScheduledBatch, slots: list[int]) -> ScheduledBatch:
    return ScheduledBatch(
        [
            ScheduledSequence(
                seq.seq_id,
                seq.token_ids,
                seq.start_position,
                seq.block_table,
                seq.needs_logits,
                slot,
            )  # fmt: skip
            for seq, slot in zip(batch.sequences, slots, strict=True)
        ]
    )


def time_steps(
    step: Callable[[], Any], iterations: int, sync: Callable[[], None], warmup: int = 3
) -> float:
    """Mean wall ms of `iterations` back-to-back steps (after `warmup` untimed ones)."""
    for _ in range(warmup):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    sync()
    return (time.perf_counter() - started) * 1000.0 / iterations


def runner_step(runner: Any, adapters: EngineAdapters | None, batch: ScheduledBatch) -> Callable:
    def step() -> Any:
        if adapters is not None:
            adapters.begin_step(batch)
        return runner.execute_greedy(batch)

    return step


def adapter_bytes(weights: AdapterWeights) -> int:
    return weights.nbytes


# ---- GPU -------------------------------------------------------------------------------------
def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    from services.engine.cuda_runner import CudaModelRunner

    device = torch.device("cuda")
    files = ModelFiles(
        name=f"dummy:{args.shape}", weights_dir=None, tokenizer_dir=Path("."),
        dummy_shape=args.shape,
    )  # fmt: skip
    started = time.perf_counter()
    runner = CudaModelRunner(
        files, device="cuda", dtype=torch.bfloat16, max_num_seqs=64,
        kv_cache_bytes=16 << 30, block_size=BLOCK_SIZE, lora_fold_rank=RANK,
    )  # fmt: skip
    build_s = time.perf_counter() - started
    config = runner.model_config
    vocab = config.vocab_size
    sync = torch.cuda.synchronize
    blocks = Blocks(runner.num_blocks)
    decode = decode_batch(blocks, 64, args.context, vocab)
    prefills = {
        "4x2048": prefill_batch(blocks, 4, 2048, vocab),
        "8x1024": prefill_batch(blocks, 8, 1024, vocab),
    }
    # Eager steps whose prompt runs are shorter than the default long-run threshold.
    short_runs = {
        "prefill16x512": prefill_batch(blocks, 16, 512, vocab),
        "mixed12x512+128": mixed_batch(blocks, 12, 512, 128, MIXED_CONTEXT, vocab),
    }
    it = args.iterations
    base = {"decode64": time_steps(runner_step(runner, None, decode), it, sync)}
    for label, batch in prefills.items():
        base[f"prefill{label}"] = time_steps(
            runner_step(runner, None, batch), max(it // 5, 3), sync
        )

    lora_config = LoRAConfig(
        max_loras=64,
        max_cpu_loras=64,
        max_lora_rank=RANK,
        adapter_root="/nonexistent",
        fused_decode=True,  # the one-adapter step both ways (its graphs, the LoRA kernels')
    )
    adapters = EngineAdapters(
        lora_config, config, dtype=runner.dtype, device=device, kernels="triton", max_rows=8192
    )
    started = time.perf_counter()
    runner.bind_lora(adapters)  # wraps the projections, captures the graphs again
    bind_s = time.perf_counter() - started
    weights = None
    for slot in range(64):
        weights = random_adapter(adapters, f"random-{slot}", seed=slot, device=device)
        adapters.slots.write(slot, weights)
    sync()
    per_adapter = adapter_bytes(weights)

    rows = len(decode.sequences)
    cases = {
        "decode64_base_rows": with_slots(decode, [-1] * rows),
        "decode64_one_adapter": with_slots(decode, [0] * rows),
        "decode64_8_adapters": with_slots(decode, [row % 8 for row in range(rows)]),
        "decode64_64_adapters": with_slots(decode, list(range(rows))),
    }
    lora = {
        name: time_steps(runner_step(runner, adapters, b), it, sync) for name, b in cases.items()
    }
    fused = adapters.runtime.fused
    if fused is not None:  # the same step through the LoRA kernels' graphs, same run
        adapters.runtime.fused = None
        one = runner_step(runner, adapters, cases["decode64_one_adapter"])
        lora["decode64_one_adapter_lora_kernels"] = time_steps(one, it, sync)
        adapters.runtime.fused = fused
    for label, batch in prefills.items():
        count = len(batch.sequences)
        lora[f"prefill{label}_{count}_adapters"] = time_steps(
            runner_step(runner, adapters, with_slots(batch, list(range(count)))),
            max(it // 5, 3),
            sync,
        )
    eager_cases = {**short_runs, **{f"prefill{label}": batch for label, batch in prefills.items()}}
    eager = eager_ab(adapters, runner, eager_cases, sync, max(it // 5, 3), args.rounds)
    kernels_ms = lora_kernel_ms(adapters, config, rows, sync, it)
    kernels_graph_ms = lora_kernel_ms(adapters, config, rows, sync, it, graph=True)
    swap = adapter_swap_ms(adapters, runner, decode, sync)
    bandwidth = copy_bandwidth_bytes_per_s()
    floor_ms = {str(n): n * per_adapter / bandwidth * 1000.0 for n in (1, 8, 64)}
    ratios = {
        "decode64_base_rows": lora["decode64_base_rows"] / base["decode64"],
        "decode64_one_adapter": lora["decode64_one_adapter"] / base["decode64"],
        **(
            {}
            if fused is None
            else {
                "decode64_one_adapter_lora_kernels": lora["decode64_one_adapter_lora_kernels"]
                / base["decode64"]
            }
        ),
        "decode64_8_adapters": lora["decode64_8_adapters"] / base["decode64"],
        "decode64_64_adapters": lora["decode64_64_adapters"] / base["decode64"],
        "prefill4x2048_4_adapters": lora["prefill4x2048_4_adapters"] / base["prefill4x2048"],
        "prefill8x1024_8_adapters": lora["prefill8x1024_8_adapters"] / base["prefill8x1024"],
    }
    return {
        "mode": "gpu",
        "device": torch.cuda.get_device_name(),
        "model": files.name,
        "dtype": "bfloat16",
        "rank": RANK,
        "modules": "all seven (q, k, v, o, gate, up, down)",
        "decode_context_tokens": args.context,
        "iterations": it,
        "execution_path": runner.execution_path,
        "build_s": round(build_s, 1),
        "bind_and_recapture_s": round(bind_s, 1),
        "adapter_bytes": per_adapter,
        "base_ms": _round(base),
        "lora_ms": _round(lora),
        "ratio_to_base": _round(ratios, 3),
        "eager_short_runs": eager,
        "lora_kernels_alone_ms": _round(kernels_ms),
        "lora_kernels_alone_graph_ms": _round(kernels_graph_ms),
        "adapter_swap": swap,
        "copy_bandwidth_gb_per_s": round(bandwidth / 1e9, 1),
        "adapter_read_floor_ms": _round(floor_ms),
    }


def mixed_batch(
    blocks: Blocks, prompts: int, tokens: int, decodes: int, context: int, vocab: int
) -> ScheduledBatch:
    """A mixed step: `prompts` prompt chunks of `tokens` then `decodes` decode rows."""
    sequences = prefill_batch(blocks, prompts, tokens, vocab).sequences
    return ScheduledBatch(sequences + decode_batch(blocks, decodes, context, vocab).sequences)


def eager_ab(
    adapters: EngineAdapters,
    runner: Any,
    batches: dict[str, ScheduledBatch],
    sync: Callable[[], None],
    iterations: int,
    rounds: int,
) -> dict[str, Any]:
    """Eager steps, each prompt on an adapter of its own (decode rows on 16 adapters in turn),
    under each EAGER_VARIANTS setting of the runtime, against the same step with every row on
    the base model (the LoRA runtime bound, doing nothing): interleaved rounds, the median of
    each, ratios to that base."""
    runtime = adapters.runtime
    saved = (
        runtime.write_tile_deltas,
        runtime.long_segment_rows,
        runtime.tile_consumer,
        runtime.consumer_takes_long_runs,
    )
    consumer = runtime.tile_consumer or runner.fast.ops  # the SwiGLU kernel's (fused_swiglu)
    steps: dict[tuple[str, str], Callable] = {}
    for label, batch in batches.items():
        slots = [
            index if len(seq.token_ids) > 1 else index % 16
            for index, seq in enumerate(batch.sequences)
        ]
        steps[label, "base"] = runner_step(runner, adapters, with_slots(batch, [-1] * len(slots)))
        for variant in EAGER_VARIANTS:
            steps[label, variant] = runner_step(runner, adapters, with_slots(batch, slots))
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    try:
        for _ in range(rounds):
            for (label, variant), step in steps.items():
                # no adapter row in the base step: the runtime's settings do not matter there
                write, threshold, takes, long_runs = EAGER_VARIANTS.get(
                    variant, (*saved[:2], True, True)
                )
                runtime.write_tile_deltas, runtime.long_segment_rows = write, threshold
                runtime.tile_consumer = consumer if takes else None
                runtime.consumer_takes_long_runs = long_runs
                samples[label, variant].append(time_steps(step, iterations, sync, warmup=1))
    finally:
        (
            runtime.write_tile_deltas,
            runtime.long_segment_rows,
            runtime.tile_consumer,
            runtime.consumer_takes_long_runs,
        ) = saved
    median = {key: statistics.median(values) for key, values in samples.items()}
    return {
        "variants": {name: list(setting) for name, setting in EAGER_VARIANTS.items()},
        "base_ms": {label: round(median[label, "base"], 2) for label in batches},
        "ratio_to_base": {
            label: {
                variant: round(median[label, variant] / median[label, "base"], 3)
                for variant in EAGER_VARIANTS
            }
            for label in batches
        },
    }


def lora_kernel_ms(
    adapters: EngineAdapters,
    config: Any,
    rows: int,
    sync: Callable[[], None],
    iterations: int,
    *,
    graph: bool = False,
) -> dict[str, float]:
    """The shrink/expand launches of one decode step alone (all layers, four projections),
    launched one by one or (graph) replayed from a CUDA graph as a decode step runs them."""
    from services.engine.lora.batch import LoRABatch

    runtime = adapters.runtime
    shapes = adapters.slots.shapes
    device = adapters.device
    inputs = {
        name: torch.randn(rows, shape.in_features, device=device, dtype=adapters.dtype)
        for name, shape in shapes.items()
    }
    outputs = {
        name: torch.zeros(rows, shape.out_features, device=device, dtype=adapters.dtype)
        for name, shape in shapes.items()
    }
    result = {}
    for label, slots in (("one_adapter", [0] * rows), ("64_adapters", list(range(rows)))):
        runtime.set_batch(LoRABatch.from_row_slots(slots))

        def step() -> None:
            for layer in range(config.num_layers):
                for name in PROJECTIONS:
                    runtime.apply(layer, name, inputs[name], outputs[name])

        if graph:
            step()  # compiled before capture
            sync()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                step()
            result[label] = time_steps(captured.replay, iterations, sync)
        else:
            result[label] = time_steps(step, iterations, sync)
    runtime.set_batch(LoRABatch(0))
    return result


def adapter_swap_ms(
    adapters: EngineAdapters, runner: Any, decode: ScheduledBatch, sync: Callable[[], None]
) -> dict[str, float]:
    """What a request whose adapter is in host memory but in no slot pays before its first
    token: the slot write (pinned host → device, on the step thread) ahead of its step, against
    the bare copy of the same bytes and the same step with the adapter already resident."""
    from services.engine.lora.weights import stack_layers

    host = random_adapter(adapters, "swapped-in", seed=999, device=torch.device("cpu"))
    host = stack_layers(host, pin=True)  # as the engine's loader leaves it in the host cache
    slot = adapters.slots.max_loras - 1
    batch = with_slots(decode, [slot] + [-1] * (len(decode.sequences) - 1))
    step = runner_step(runner, adapters, batch)
    resident_ms = time_steps(step, 10, sync)

    def swap_and_step() -> None:
        adapters.slots.write(slot, host)
        step()

    swap_ms = time_steps(swap_and_step, 10, sync)
    flat = torch.empty(host.nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(flat, device="cuda")
    copy_ms = time_steps(lambda: target.copy_(flat, non_blocking=True), 10, sync)
    return _round(
        {
            "step_resident_ms": resident_ms,
            "step_after_swap_ms": swap_ms,
            "added_ms": swap_ms - resident_ms,
            "h2d_copy_ms": copy_ms,
            "added_over_copy_ms": swap_ms - resident_ms - copy_ms,
        }
    )


def copy_bandwidth_bytes_per_s() -> float:
    """Device-to-device copy rate, bytes read per second (a copy reads and writes each byte)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    elapsed_ms = time_steps(lambda: target.copy_(source), 10, torch.cuda.synchronize)
    return 2 * source.numel() / (elapsed_ms / 1000.0)


# ---- CPU -------------------------------------------------------------------------------------
def cpu_main(args: argparse.Namespace) -> dict[str, Any]:
    from services.common.model_files import resolve_model
    from services.engine.cpu_runner import CpuModelRunner

    files = resolve_model(args.model)
    runner = CpuModelRunner(files, block_size=BLOCK_SIZE, kv_cache_bytes=1 << 30)
    config = runner.model_config
    blocks = Blocks(runner.num_blocks)
    decode = decode_batch(blocks, 32, args.context, config.vocab_size)
    it = args.iterations

    def sync() -> None:
        return None

    base_ms = time_steps(runner_step(runner, None, decode), it, sync)
    lora_config = LoRAConfig(
        max_loras=16, max_cpu_loras=16, max_lora_rank=RANK, adapter_root="/nonexistent"
    )
    adapters = EngineAdapters(lora_config, config, dtype=runner.dtype, device="cpu")
    runner.bind_lora(adapters)
    for slot in range(16):
        adapters.slots.write(
            slot, random_adapter(adapters, f"random-{slot}", seed=slot, device=torch.device("cpu"))
        )
    rows = len(decode.sequences)
    cases = {"base_rows": with_slots(decode, [-1] * rows)}
    for k in (1, 4, 16):
        cases[f"{k}_adapters"] = with_slots(decode, [row % k for row in range(rows)])
    # The LoRA math through the native kernels (the runner's default where they built) and
    # through torch ops, in the same rounds.
    native = adapters.runtime.cpu_kernels
    paths = {"": native} if native is None else {"": native, "_torch_ops": None}
    # Interleaved rounds, median per case: a shared CPU's noise hits every case alike.
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for suffix, kernels in paths.items():
            adapters.runtime.cpu_kernels = kernels
            for name, batch in cases.items():
                step = runner_step(runner, adapters, batch)
                samples.setdefault(name + suffix, []).append(time_steps(step, it, sync))
    adapters.runtime.cpu_kernels = native
    lora_ms = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "mode": "cpu",
        "device": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "model": config.name,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "rank": RANK,
        "batch": rows,
        "decode_context_tokens": args.context,
        "iterations": it,
        "rounds": args.rounds,
        "lora_math": "native kernels" if native is not None else "torch ops",
        "no_lora_ms_before_binding": round(base_ms, 3),
        "median_ms": _round(lora_ms),
        "ratio_to_base_rows": _round(
            {key: value / lora_ms["base_rows"] for key, value in lora_ms.items()}, 3
        ),
    }


def _round(values: dict[str, float], digits: int = 3) -> dict[str, float]:
    return {key: round(value, digits) for key, value in values.items()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = gpu_main(args) if args.mode == "gpu" else cpu_main(args)
    report["date"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
