"""Where a saturated engine's time goes: steps, kernels and the batch cap, on one GPU.

Runs the `fixed` request set of benchmarks.gpu_stack (512 prompt / 256 output tokens, greedy,
EOS ignored) through one warmed LLMEngine, as `LLM.generate` drives it, once per running-batch
cap (`--caps`: the scheduler's max_num_seqs for that pass), and reports per pass the output
tokens/s, every request's time per output token (TPOT: from its first token to its last, over
the tokens between) and the step mix (decode-only steps vs steps that hold prompt tokens). The
first pass also profiles `--profile-steps` steady steps with torch.profiler: GPU time by kernel
family (matmul, attention, norm, ...) against the steps' wall time, so the gaps show. Triton
kernels compiled after the warm-up are listed (a compile on the serving path is a slow first
request).

    python -m benchmarks.gpu_step_profile --requests 600 --caps 512,384,256 --out profile.json

With `--adapters N` the engine serves N random rank-`--rank` PEFT adapters (all seven
projections) in `--max-loras` slots, all loaded into host memory first, and every cap runs
twice on it: the requests on the base model, then each naming an adapter drawn Zipf
(`--zipf-s`) over the N; both profiled, so the LoRA steps' kernels, their share of the wall
time and the host's gaps compare with the base steps' of the same engine.

    python -m benchmarks.gpu_step_profile --adapters 48 --max-loras 16 --caps 256 \
        --low-requests 0 --out lora-profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu_stack import DEFAULT_MODEL, fixed_specs, percentiles_ms
from benchmarks.lora_stack_adapters import write_adapters
from loadtest.datasets import choose_adapters

# Kernel families by substrings of the kernel name, first match wins.
FAMILIES = (
    ("lora", ("lora",)),
    ("attention", ("attention", "attn", "flash", "fmha")),
    ("matmul", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "skinny", "matmul", "sm90")),
    ("norm", ("rms", "norm")),
    ("rotary / kv store", ("rotary", "kv_store", "paged_kv")),
    ("activation", ("swiglu", "silu")),
    ("sampling", ("sort", "argmax", "softmax", "topk", "multinomial", "exponential", "sampl")),
    ("copies", ("copy", "memcpy", "memset", "fill", "index", "gather", "scatter", "cat")),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, needles in FAMILIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def run_pass(
    engine: Any,
    specs: list,
    cap: int,
    profile_steps: int,
    tag: str,
    adapters: list[str] | None = None,
) -> dict[str, Any]:
    """One pass of `specs` under a running-batch cap (each naming `adapters[i]` when given:
    "" is the base model); profiles steady steps if asked."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.common.protocol.sampling_params import SamplingParams

    scheduler = engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_seqs=cap)
    for number, spec in enumerate(specs):
        params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
        adapter = adapters[number] if adapters else None
        engine.add_request(
            f"{tag}-{spec.index}", list(spec.prompt_token_ids), params, adapter=adapter or None
        )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, int] = defaultdict(int)
    steps: list[tuple[float, int, int]] = []  # (seconds, prefill tokens, decoded tokens)
    profile_from = 120
    profiler = None
    profiled: dict[str, Any] = {}
    host = HostTimers(engine)
    started = time.perf_counter()
    while engine.has_unfinished():
        index = len(steps)
        if profile_steps and index == profile_from:
            torch.cuda.synchronize()
            profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            profiler.__enter__()
            profile_started = time.perf_counter()
            host.start()
        output = engine.step()
        now = time.perf_counter()
        decoded = 0
        for delta in output.deltas:
            count = len(delta.new_token_ids)
            decoded += count
            if count:
                first.setdefault(delta.request_id, now)
                last[delta.request_id] = now
                tokens[delta.request_id] += count
        steps.append((output.step_time_s, max(output.num_batched_tokens - decoded, 0), decoded))
        if profiler is not None and index == profile_from + profile_steps - 1:
            torch.cuda.synchronize()
            wall = time.perf_counter() - profile_started
            profiler.__exit__(None, None, None)
            profiled = kernel_breakdown(profiler, wall, steps[profile_from:])
            profiled["host_ms"] = host.stop()
            profiler = None
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    tpot_s = [(last[r] - first[r]) / (tokens[r] - 1) for r in first if tokens[r] > 1]
    mixed = [s for s in steps if s[1] > 0]
    decode_only = [s for s in steps if s[1] == 0]
    result = {
        "max_num_seqs": cap,
        "requests": len(specs),
        "seconds": round(elapsed, 3),
        "output_tok_s": round(sum(tokens.values()) / elapsed, 1),
        "tpot_ms": percentiles_ms(tpot_s),
        "steps": len(steps),
        "step_ms": percentiles_ms([s[0] for s in steps]),
        "mixed_steps": {"count": len(mixed), **mean_columns(mixed)},
        "decode_steps": {"count": len(decode_only), **mean_columns(decode_only)},
    }
    if adapters:
        result["adapter_requests"] = sum(1 for name in adapters if name)
        result["pauses"] = scheduler.num_pauses
        if engine.adapters is not None:
            result["slot_writes"] = engine.adapters.manager.num_slot_writes
    if profiled:
        result["profile"] = profiled
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)
    return result


def low_load_pass(engine: Any, specs: list, rate: float, tag: str) -> dict[str, Any]:
    """Requests arriving every 1/rate s on a fresh engine: each one's TTFT, in order."""
    from services.common.protocol.sampling_params import SamplingParams

    added: dict[str, float] = {}
    ttft: dict[str, float] = {}
    order: list[str] = []
    started = time.perf_counter()
    next_index = 0
    while next_index < len(specs) or engine.has_unfinished():
        now = time.perf_counter()
        while next_index < len(specs) and now - started >= next_index / rate:
            spec = specs[next_index]
            request_id = f"{tag}-{spec.index}"
            params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(request_id, list(spec.prompt_token_ids), params)
            added[request_id] = time.perf_counter()
            order.append(request_id)
            next_index += 1
        if not engine.has_unfinished():
            time.sleep(0.0005)
            continue
        output = engine.step()
        now = time.perf_counter()
        for delta in output.deltas:
            if delta.new_token_ids and delta.request_id not in ttft:
                ttft[delta.request_id] = now - added[delta.request_id]
    values = [round(ttft[r] * 1e3, 2) for r in order]
    later = percentiles_ms([ttft[r] for r in order[10:]])
    return {"rate": rate, "ttft_ms_in_order": values, "after_first_10_ms": later}


def kernel_breakdown(profiler: Any, wall_s: float, steps: list) -> dict[str, Any]:
    """GPU time by kernel family and the top kernels over the profiled steps."""
    by_family: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in profiler.events():
        if event.device_type.name != "CUDA":
            continue
        micros = event.device_time
        by_family[family(event.name)] += micros
        entry = by_kernel[event.name]
        entry[0] += micros
        entry[1] += 1
    gpu_us = sum(by_family.values())
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:25]
    return {
        "steps": len(steps),
        "wall_ms": round(wall_s * 1e3, 2),
        "gpu_busy_ms": round(gpu_us / 1e3, 2),
        "prefill_tokens": int(sum(s[1] for s in steps)),
        "decoded_tokens": int(sum(s[2] for s in steps)),
        "family_ms": {
            k: round(v / 1e3, 2) for k, v in sorted(by_family.items(), key=lambda i: -i[1])
        },
        "top_kernels": [
            {"name": name[:120], "ms": round(v[0] / 1e3, 3), "calls": v[1]} for name, v in top
        ],
    }


def mean_columns(steps: list[tuple[float, int, int]]) -> dict[str, float]:
    """Mean step ms, prompt tokens and decoded tokens of some steps."""
    if not steps:
        return {}
    seconds, prefill, decoded = np.asarray(steps, dtype=float).T
    return {
        "step_ms": round(float(seconds.mean() * 1e3), 2),
        "prefill_tokens": round(float(prefill.mean()), 1),
        "decoded_tokens": round(float(decoded.mean()), 1),
    }


class HostTimers:
    """Host time spent in the scheduler and in the per-step LoRA layout while profiling."""

    def __init__(self, engine: Any) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._targets = [(engine.scheduler, "schedule")]
        if engine.adapters is not None:
            self._targets.append((engine.adapters, "begin_step"))
        self._saved: list[tuple[Any, str, Any]] = []

    def start(self) -> None:
        for owner, name in self._targets:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(name, original))

    def stop(self) -> dict[str, float]:
        for owner, name, _ in self._saved:
            delattr(owner, name)  # the instance attribute goes: the method shows again
        self._saved.clear()
        return {name: round(total * 1e3, 2) for name, total in self.totals.items()}

    def _timed(self, name: str, original: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - began

        return timed


def load_adapters(engine: Any, names: list[str]) -> None:
    """Register the adapters and bring each into host memory (one short request each), so
    the passes measure steps, not disk reads."""
    from services.common.protocol.sampling_params import SamplingParams

    for name in names:
        engine.register_adapter(engine.inspect_adapter(name, name))
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request(f"load-{name}", [1, 2, 3], params, adapter=name)
    while engine.has_unfinished():
        if engine.waiting_for_adapters():
            engine.wait_for_adapter_load(0.1)
        engine.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_step_profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=600, help="requests per pass")
    parser.add_argument("--caps", default="512,384,256", help="max_num_seqs of each pass")
    parser.add_argument("--profile-steps", type=int, default=40, help="0: no profile")
    parser.add_argument("--low-requests", type=int, default=30, help="0: no low-load pass")
    parser.add_argument("--low-rate", type=float, default=3.0, help="req/s of the low-load pass")
    parser.add_argument("--target-step-ms", type=float, default=0.0)
    parser.add_argument("--adapters", type=int, default=0, help="random LoRA adapters (0: none)")
    parser.add_argument("--max-loras", type=int, default=16, help="device slots")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the draw")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    from services.engine import compile_watch
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    lora: dict[str, Any] = {}
    names: list[str] = []
    if args.adapters:
        root = Path(tempfile.mkdtemp(prefix="step-profile-adapters-"))
        written = write_adapters(
            root, args.model, args.adapters, args.rank, progress=lambda *_: None
        )
        names = written.pop("names")
        lora = {
            "adapter_root": str(root),
            "max_loras": args.max_loras,
            "max_cpu_loras": args.adapters,
            "max_lora_rank": args.rank,
        }
    engine = LLMEngine(
        EngineConfig(model=args.model, device="cuda", target_step_ms=args.target_step_ms, **lora)
    )
    warm = engine.warm_up()
    print(warm.summary(), flush=True)  # the warm-up armed the engine's compile watch
    if names:
        load_adapters(engine, names)
    low_started = time.monotonic()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.gpu_step_profile "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "engine": {
            "max_num_seqs": engine.info.max_num_seqs,
            "max_num_batched_tokens": engine.info.max_num_batched_tokens,
            "target_step_ms": args.target_step_ms,
        },
        "passes": [],
    }
    specs = fixed_specs(args.requests)
    if args.low_requests:
        compiled_before = len(compile_watch.late_compiles())
        low = low_load_pass(engine, specs[: args.low_requests], args.low_rate, "low")
        low["compiled_after_warm_up"] = [
            {"kernel": what, "s_after_start": round(at - low_started, 3)}
            for at, what in compile_watch.late_compiles()[compiled_before:]
        ]
        print(json.dumps(low), flush=True)
        report["low_load"] = low
    drawn = choose_adapters(np.random.default_rng(4), names, "zipf", args.zipf_s, len(specs))
    report["adapters"] = {"count": args.adapters, "max_loras": args.max_loras, "rank": args.rank}
    mixes = [("base", None), ("lora", drawn)] if names else [("base", None)]
    for number, cap in enumerate(int(value) for value in args.caps.split(",")):
        for mix, adapters in mixes:
            compiled_before = len(compile_watch.late_compiles())
            profile_steps = args.profile_steps if number == 0 else 0
            result = run_pass(engine, specs, cap, profile_steps, f"pass{number}-{mix}", adapters)
            result["requests_on"] = mix
            result["compiled_after_warm_up"] = [
                what for _, what in compile_watch.late_compiles()[compiled_before:]
            ]
            report["passes"].append(result)
            args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
