"""Engine-level GPU figures: decode and prefill measured through LLMEngine.step().

gpu_bench.py times the standalone fast model; this module times the same work through the
engine (scheduler, block manager, CudaModelRunner, sampler, output deltas) on a dummy shape, so
the report shows what the engine adds. Per step: greedy sampling, EOS ignored, random prompt
tokens. It also checks the fast path's logits against the plain torch model on the same weights
and KV cache (CudaModelRunner.reference_execute). Run in its own process (it needs the GPU's
memory for its KV cache): `python -m benchmarks.gpu_bench_engine --out engine.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any


def _engine(shape: str, *, max_num_seqs: int, max_batched: int, max_model_len: int):
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=f"dummy:{shape}",
        device="cuda",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )
    return LLMEngine(config)


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def _run(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Add the prompts, step to the end; split step times into prefill and graph decode.

    Requests prefilled first finish first (mixed steps decode them meanwhile), so decode
    figures come from the pure-decode steps that hold the whole batch. `overlapped_steps`
    counts steps the engine scheduled ahead (launched before the previous step's ids were
    read)."""
    from services.common.protocol.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stamp = time.perf_counter_ns()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{stamp}-{index}", prompt, params)
    overlapped_before = getattr(engine, "num_overlapped_steps", 0)
    full_batch, partial, prefill_time, prefill_tokens = [], 0, 0.0, 0
    while engine.has_unfinished():
        start = time.perf_counter()
        output = engine.step()
        elapsed = time.perf_counter() - start
        # A step() returns one step's tokens (with overlap it has launched the next already):
        # a decode of the whole batch has one token per prompt, prefill and mixed steps more.
        if output.num_batched_tokens == len(prompts):
            full_batch.append(elapsed)
        elif output.num_batched_tokens < len(prompts):
            partial += 1
        else:
            prefill_time += elapsed
            prefill_tokens += output.num_batched_tokens
    steady = full_batch[2:] or full_batch
    steady = sorted(steady)[: max(1, int(len(steady) * 0.9))]  # drop the slowest tenth
    step_s = sum(steady) / len(steady) if steady else float("nan")
    return {
        "batch": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "full_batch_decode_steps": len(full_batch),
        "partial_decode_steps": partial,
        "overlapped_steps": getattr(engine, "num_overlapped_steps", 0) - overlapped_before,
        "decode_step_ms": round(step_s * 1e3, 3),
        "decode_tok_s": round(len(prompts) / step_s, 1),
        "prefill_s": round(prefill_time, 4),
        "prefill_tok_s": round(prefill_tokens / prefill_time, 1) if prefill_time else None,
    }


def _check(engine, vocab: int) -> dict[str, float]:
    """Relative error of fast-path logits vs the torch model: prefill then 3 graph decodes."""
    import torch

    from services.engine.forward_batch import ScheduledBatch, ScheduledSequence

    runner = engine.runner
    size = runner.block_size
    lengths = [37, 100]
    prompts = _prompts(2, max(lengths), vocab, seed=7)
    tables = [list(range(1 + 20 * row, 1 + 20 * row + 16)) for row in range(2)]
    sequences = [
        ScheduledSequence(row, prompts[row][: lengths[row]], 0, tables[row], True)
        for row in range(2)
    ]

    def error(batch: ScheduledBatch) -> float:
        fast = runner.execute(batch).double()
        reference = runner.reference_execute(batch).double()
        return float((fast - reference).norm() / reference.norm())

    errors = {"prefill": error(ScheduledBatch(sequences))}
    positions = list(lengths)
    for step in range(3):
        decode = [
            ScheduledSequence(row, [prompts[row][step]], positions[row], tables[row], True)
            for row in range(2)
        ]
        errors[f"decode_{step}"] = error(ScheduledBatch(decode))
        positions = [position + 1 for position in positions]
    assert all(position < 16 * size for position in positions)
    torch.cuda.synchronize()
    return {key: round(value, 5) for key, value in errors.items()}


def measure_shape(shape: str, batches: list[int], max_tokens: int) -> dict[str, Any]:
    import torch

    max_seqs = max(batches)
    engine = _engine(shape, max_num_seqs=max_seqs, max_batched=8192, max_model_len=4096)
    runner = engine.runner
    vocab = engine.info.vocab_size
    result: dict[str, Any] = {
        "shape": shape,
        "runner": type(runner).__name__,
        "num_blocks": runner.num_blocks,
        "graph_buckets": list(runner.fast.graphs.buckets) if runner.fast is not None else None,
        "logits_rel_error_vs_torch_model": _check(engine, vocab),
    }
    _run(engine, _prompts(1, 16, vocab, 1), 8)  # warm-up (kernels, allocator)
    result["bs1_ctx128"] = _run(engine, _prompts(1, 128, vocab, 2), max_tokens)
    result["bs1_ctx2048"] = _run(engine, _prompts(1, 2048, vocab, 3), max_tokens)
    for batch in batches:
        result[f"batch{batch}_ctx512"] = _run(engine, _prompts(batch, 512, vocab, 4), max_tokens)
    torch.cuda.synchronize()
    del engine, runner
    torch.cuda.empty_cache()
    return result


def profile_host(shape: str, batch: int, steps: int = 20) -> None:
    """cProfile of `steps` steady full-batch decode steps through the engine (host side: the
    GPU work overlaps), printed by own time: where the per-sequence host cost goes."""
    import cProfile
    import pstats

    from services.common.protocol.sampling_params import SamplingParams

    engine = _engine(shape, max_num_seqs=batch, max_batched=8192, max_model_len=4096)
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(_prompts(batch, 512, engine.info.vocab_size, 4)):
        engine.add_request(f"p{index}", prompt, params)
    while engine.step().num_batched_tokens != batch:
        pass
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    print(f"{shape} batch {batch}: {(time.perf_counter() - started) / steps * 1e3:.2f} ms/step")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_bench_engine", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shapes", default="llama-3-8b,llama-3.2-1b", help="dummy shapes")
    parser.add_argument("--batches", default="16,64,256,512", help="decode batch sizes")
    parser.add_argument("--max-tokens", type=int, default=72, help="tokens per request")
    parser.add_argument("--out", type=Path, required=True, help="JSON written here")
    parser.add_argument(
        "--merge-into", type=Path, default=None, help="gpu_bench's JSON: add an engine_level part"
    )
    parser.add_argument(
        "--profile-batch", type=int, default=0, help="only cProfile steady steps at this batch"
    )
    args = parser.parse_args(argv)
    import torch

    if args.profile_batch:
        for shape in args.shapes.split(","):
            profile_host(shape, args.profile_batch)
        return 0

    report: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "shapes": {},
    }
    batches = [int(value) for value in args.batches.split(",")]
    for shape in args.shapes.split(","):
        try:
            report["shapes"][shape] = measure_shape(shape, batches, args.max_tokens)
        except Exception as exc:  # keep the other shapes' figures
            report["shapes"][shape] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({shape: report["shapes"][shape]}, indent=1), flush=True)
        args.out.write_text(json.dumps(report, indent=2))
        if args.merge_into is not None:
            merge(report, args.merge_into)
    return 0


def merge(report: dict[str, Any], path: Path) -> None:
    """Put the engine-level figures next to gpu_bench's standalone ones (headline: 8B shape)."""
    combined = json.loads(path.read_text()) if path.is_file() else {}
    level = combined.setdefault("engine_level", {"shapes": {}})
    level.update({key: value for key, value in report.items() if key != "shapes"})
    level["shapes"].update(report["shapes"])
    headline = combined.get("headline_model", "dummy:llama-3-8b").removeprefix("dummy:")
    figures = report["shapes"].get(headline, {})
    if "bs1_ctx128" in figures:
        step_ms = figures["bs1_ctx128"]["decode_step_ms"]
        combined["engine_decode_bs1_ms"] = step_ms
        standalone = combined.get("models", {}).get(headline, {})
        floor = standalone.get("decode_bs1_floor_ms")
        if floor:
            combined["engine_decode_bs1_floor_ratio"] = round(step_ms / floor, 3)
        read_floor = standalone.get("decode_bs1_floor_read_bytes_ms")
        if read_floor:
            combined["engine_decode_bs1_floor_ratio_read_bytes"] = round(step_ms / read_floor, 3)
        batches = {k: v for k, v in figures.items() if k.startswith("batch")}
        if "batch64_ctx512" in batches:
            combined["engine_decode_tok_s_bs64"] = batches["batch64_ctx512"]["decode_tok_s"]
        best = max(batches.values(), key=lambda entry: entry["decode_tok_s"], default=None)
        if best is not None:
            combined["engine_decode_tok_s_best"] = best["decode_tok_s"]
            combined["engine_decode_best_batch"] = best["batch"]
            largest = max(batches.values(), key=lambda entry: entry["batch"])
            combined["engine_prefill_tok_s"] = largest["prefill_tok_s"]
    path.write_text(json.dumps(combined, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
