"""The engine's own schedule priced at the GPU's ceilings: a floor for gpu_stack's offline sets.

`benchmarks.gpu_stack` measures the offline engine against a compute bound that counts FLOPs
only. A step of the engine also reads every weight once and each running sequence's KV cache,
and a step of few rows is bound by those reads, not by its FLOPs. This replays the real
scheduler (LLMEngine over `HostOnlyRunner`, which computes nothing; every request added at once
as `LLM.generate` does, with the engine's batch cap, step token budget and KV blocks) and
prices each step it launches as kernels that run one after another at the measured ceilings:

    max(matmul FLOPs / matmul rate, weight bytes / copy rate)            the projections, LM head
    + max(prompt attention FLOPs / matmul rate, its KV bytes / copy rate)    prompt chunks
    + max(decode attention FLOPs / matmul rate, its KV bytes / copy rate)    decode rows

(weights in bf16; KV bytes: each chunk's context read once and its tokens written once, in the
cache's element type). The sum over the steps is the time an engine of sequential kernels, each
at a ceiling, would take on that schedule: what `offline_over_compute_bound` can reach on a set
is the compute bound's time over this floor. The figures are a model's: everything between the
kernels (launch gaps, host work, the sampler, norms and rotary) is left out.

    python -m benchmarks.schedule_floor benchmarks/results/gpu-stack-h100.json \
        benchmarks/results/gpu-stack-h200.json benchmarks/results/gpu-stack-kv-fp8-h100.json \
        --out benchmarks/results/schedule-floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.engine_host_bench import HostOnlyRunner
from benchmarks.gpu_stack import Shape, compute_bound, request_sets
from loadtest.datasets import RequestSpec
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.forward_batch import ScheduledBatch
from services.engine.llm_engine import LLMEngine

WEIGHT_BYTES = 2  # bf16 weights


class StepPrice:
    """A launched step's time at the ceilings, split into its three kernel groups."""

    def __init__(
        self, shape: Shape, *, matmul_tflop_s: float, copy_gb_s: float, kv_element_bytes: int
    ) -> None:
        self.shape = shape
        self.flop_s = matmul_tflop_s * 1e12
        self.byte_s = copy_gb_s * 1e9
        self.weight_bytes = WEIGHT_BYTES * (shape.layer_matmul_params + shape.hidden * shape.vocab)
        self.kv_token_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_element_bytes
        self.per_key_flops = 4.0 * shape.heads * shape.head_dim * shape.layers  # QK^T + PV

    def seconds(self, batch: ScheduledBatch) -> dict[str, float]:
        shape = self.shape
        tokens = logits = 0
        keys = {"prompt": 0.0, "decode": 0.0}  # query-key pairs
        kv_tokens = {"prompt": 0, "decode": 0}  # cache tokens read or written
        for seq in batch.sequences:
            length, start = len(seq.token_ids), seq.start_position
            kind = "decode" if length == 1 else "prompt"
            tokens += length
            logits += seq.needs_logits
            keys[kind] += length * start + length * (length + 1) / 2
            kv_tokens[kind] += start + length
        flops = 2.0 * shape.layer_matmul_params * tokens + 2.0 * shape.hidden * shape.vocab * logits
        price = {"matmul": max(flops / self.flop_s, self.weight_bytes / self.byte_s)}
        for kind in ("prompt", "decode"):
            price[kind] = max(
                keys[kind] * self.per_key_flops / self.flop_s,
                kv_tokens[kind] * self.kv_token_bytes / self.byte_s,
            )
        price["weight_bound"] = float(flops / self.flop_s < self.weight_bytes / self.byte_s)
        price["weight_bound_s"] = price["weight_bound"] * (
            price["matmul"] + price["prompt"] + price["decode"]
        )
        return price


def schedule_floor(
    shape: Shape,
    specs: list[RequestSpec],
    *,
    engine: dict[str, Any],
    ceilings: dict[str, float],
    kv_element_bytes: int = 2,
) -> dict[str, Any]:
    """The floor of `specs` on the schedule of an engine with `engine`'s settings
    (max_num_seqs, max_num_batched_tokens, num_blocks, block_size) at `ceilings`
    (matmul_tflop_s, copy_gb_s)."""
    price = StepPrice(
        shape,
        matmul_tflop_s=ceilings["matmul_tflop_s"],
        copy_gb_s=ceilings["copy_gb_s"],
        kv_element_bytes=kv_element_bytes,
    )
    totals = dict.fromkeys(("matmul", "prompt", "decode", "weight_bound", "weight_bound_s"), 0.0)

    def add_price(batch: ScheduledBatch) -> None:
        for key, value in price.seconds(batch).items():
            totals[key] += value

    runner = HostOnlyRunner(
        num_blocks=engine["num_blocks"],
        block_size=engine["block_size"],
        max_model_len=max(s.input_tokens + s.output_tokens for s in specs) + 16,
        on_launch=add_price,
    )
    config = EngineConfig(
        model="host-only",
        device="cpu",
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        stats_log_interval_s=0,
    )
    host = LLMEngine(config, model_runner=runner)
    for spec in specs:
        params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
        host.add_request(f"r{spec.index}", list(spec.prompt_token_ids or ()), params)
    output_tokens = 0
    while host.has_unfinished():
        for delta in host.step().deltas:
            output_tokens += len(delta.new_token_ids)
    floor_s = totals["matmul"] + totals["prompt"] + totals["decode"]
    return {
        "floor_s": round(floor_s, 3),
        "floor_output_tok_s": round(output_tokens / floor_s, 1),
        "steps": runner.launches,
        "weight_bound_steps": int(totals["weight_bound"]),
        "weight_bound_steps_s": round(totals["weight_bound_s"], 3),
        "matmul_s": round(totals["matmul"], 3),
        "prompt_attention_s": round(totals["prompt"], 3),
        "decode_attention_s": round(totals["decode"], 3),
        "preemptions": host.num_preemptions,
    }


def floors_of_report(offline: dict[str, Any], model: str, kv_cache_dtype: str) -> dict[str, Any]:
    """For each set of a gpu_stack report's offline part: its floor, and the measured time and
    the compute bound against it."""
    from services.common.protocol.dummy_shapes import dummy_config

    count = offline_requests(offline)
    if count is None:
        return {}
    shape = Shape.of(dummy_config(model.removeprefix("dummy:")))
    sets = request_sets(count)
    result: dict[str, Any] = {}
    for name, specs in sets.items():
        measured = offline.get(name)
        if not measured:
            continue
        floor = schedule_floor(
            shape,
            specs,
            engine=offline["engine"],
            ceilings=offline["ceilings"],
            kv_element_bytes=1 if kv_cache_dtype == "fp8" else 2,
        )
        bound = compute_bound(shape, specs, offline["ceilings"]["matmul_tflop_s"])
        result[name] = {
            **floor,
            "measured_s": measured["seconds"],
            "measured_steps": measured["steps"],
            "measured_over_floor": round(floor["floor_s"] / measured["seconds"], 3),
            "compute_bound_over_floor": round(bound["bound_s"] / floor["floor_s"], 3),
        }
    return result


def offline_requests(offline: dict[str, Any]) -> int | None:
    """How many requests a set of the report's offline part had (None: no set was timed)."""
    counts = [offline[name]["requests"] for name in ("fixed", "sharegpt") if name in offline]
    return counts[0] if counts else None


def gpu_stack_reports(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The gpu_stack reports in a file: the file itself, or each of its values that is one."""
    if "offline" in data:
        return {"report": data}
    return {
        key: value for key, value in data.items() if isinstance(value, dict) and "offline" in value
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.schedule_floor", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "reports", type=Path, nargs="+", help="gpu_stack JSON reports with an offline part"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the floors as JSON")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    for path in args.reports:
        reports = gpu_stack_reports(json.loads(path.read_text()))
        if not reports:
            print(f"{path}: no gpu_stack offline part in it", file=sys.stderr)
            return 2
        for key, report in reports.items():
            name = path.stem if key == "report" else f"{path.stem}:{key}"
            result[name] = report_floors(report)
            for set_name, row in result[name]["sets"].items():
                print(f"{name} {set_name}: {describe(row)}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def report_floors(report: dict[str, Any]) -> dict[str, Any]:
    """One gpu_stack report's floors, with what they were computed from."""
    offline = report["offline"]
    kv_cache_dtype = report.get("kv_cache_dtype", "auto")
    return {
        "device": report["device"],
        "date": report["date"],
        "command": report["command"],
        "kv_cache_dtype": kv_cache_dtype,
        "ceilings": offline["ceilings"],
        "engine": {k: v for k, v in offline["engine"].items() if k != "execution_path"},
        "sets": floors_of_report(offline, report["model"], kv_cache_dtype),
    }


def describe(row: dict[str, Any]) -> str:
    """One set's floor in a line."""
    return (
        f"measured {row['measured_s']:.2f} s ({row['measured_steps']} steps), floor"
        f" {row['floor_s']:.2f} s ({row['steps']} steps, {row['weight_bound_steps']} bound by"
        f" weight reads, {row['weight_bound_steps_s']:.2f} s of it; matmul"
        f" {row['matmul_s']:.2f} + prompt attention {row['prompt_attention_s']:.2f} + decode"
        f" attention {row['decode_attention_s']:.2f}):"
        f" measured/floor {row['measured_over_floor']}, compute bound/floor"
        f" {row['compute_bound_over_floor']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
