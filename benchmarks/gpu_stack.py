"""GPU stack benchmark: the same requests through the offline engine and through `sluice up`.

    python -m benchmarks.gpu_stack                       # on a machine with an NVIDIA GPU
    python -m benchmarks.gpu_stack --num-requests 300    # a shorter run

Two request sets from a fixed seed, the same for every part: `fixed` (N prompts of 512 random
token ids, 256 output tokens each) and `sharegpt` (N prompts with ShareGPT-like log-normal
input and output lengths). Greedy, EOS ignored. In order:

1. Offline, in a child process (its GPU memory is gone when it ends): the bf16 matmul rate
   (8192^3, this GPU, this run), an LLMEngine built with default settings, warmed
   (LLMEngine.warm_up), then each set added at once and stepped to the end, as `LLM.generate`
   drives it. The compute bound of a set is its matmul FLOPs (every processed token through
   every layer, the LM head for every generated token) plus its attention FLOPs (causal QK^T and
   PV), over the measured matmul rate; `offline_over_compute_bound` is the compute-bound time
   over the measured time. Each set's `schedule_floor` prices the engine's own schedule at the
   run's matmul and copy rates (weights and KV reads counted: benchmarks/schedule_floor.py);
   `offline_over_schedule_floor` is that floor over the measured time.
2. The stack (`sluice up --no-ray --no-redis` as a Stack in this process, engine on CUDA,
   router with `--max-queue-delay-s`), fresh: a low Poisson rate first (the slowest and the
   mean of the first 10 requests' time to first token against the p50 of the rest), then each
   set closed-loop at `--concurrency` streams (by default the engines' max_num_seqs, the most
   they run at once: more would wait in the queue; a request the queue-delay bound refuses is
   sent again after the router's retry-after, its TTFT counted from its first send) for
   saturation (output tokens/s against the offline figure, the router's and tokenizer's CPU
   seconds per streamed token), then Poisson rates as multiples of the measured saturation rate
   (2x: the overload point; the admitted requests' p99 TTFT and the goodput at a TTFT SLO of
   2 s and a TPOT SLO of 50 ms against the saturation request rate), and last, time left, the
   low-load arrivals once more on the warm stack (`first10_replay_ttft_over_p50`: a slow
   request among the first ten that is slow again there met another request's prefill, which
   no warm-up removes).

`--target-step-ms` gives the stack's engine a step-time target (chunked prefill sized so each
step's predicted time stays within it; services/engine/step_budget.py), and
`--offline-target-step-ms` the offline engine one, so one run compares either with the default
(both 0: off). Both are recorded at the top of the report; each offline set also records its
step times (`step_ms`).

Writes the JSON report (top-level keys first, then every phase) and, per stack phase, the
harness's report and plots (`loadtest.report.write_report`) under `--plots-dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.datasets import RequestSpec

DEFAULT_MODEL = "dummy:llama-3-8b"
TTFT_SLO_MS = 2000.0
TPOT_SLO_MS = 50.0
VOCAB_LIMIT = 10_000


# ---- the requests ---------------------------------------------------------------------------
def fixed_specs(count: int, seed: int = 0) -> list[RequestSpec]:
    """`count` prompts of 512 random token ids, 256 output tokens each."""
    rng = np.random.default_rng(seed)
    return [
        RequestSpec(i, 512, 256, tuple(int(t) for t in rng.integers(100, VOCAB_LIMIT, 512)))
        for i in range(count)
    ]


def sharegpt_like_specs(count: int, seed: int = 1, max_len: int = 4096) -> list[RequestSpec]:
    """ShareGPT-like lengths: log-normal inputs (median 170, mean ~255 tokens, 8-2048) and
    outputs (median 150, mean ~205, 8-1024), random token ids."""
    rng = np.random.default_rng(seed)
    inputs = np.clip(rng.lognormal(math.log(170), 0.9, count), 8, 2048).astype(int)
    outputs = np.clip(rng.lognormal(math.log(150), 0.8, count), 8, 1024).astype(int)
    specs = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs, strict=True)):
        n_out = int(min(n_out, max_len - n_in - 1))
        ids = tuple(int(t) for t in rng.integers(100, VOCAB_LIMIT, int(n_in)))
        specs.append(RequestSpec(i, int(n_in), n_out, ids))
    return specs


def request_sets(count: int) -> dict[str, list[RequestSpec]]:
    return {"fixed": fixed_specs(count), "sharegpt": sharegpt_like_specs(count)}


# ---- the compute bound ----------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> Shape:
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
        )

    @property
    def layer_matmul_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = (
            self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        )
        return self.layers * per_layer


def work_flops(shape: Shape, specs: list[RequestSpec]) -> dict[str, float]:
    """Matmul and attention FLOPs of serving `specs` (prefill + decode, greedy)."""
    matmul = attention = 0.0
    per_position = 4.0 * shape.heads * shape.head_dim * shape.layers  # QK^T + PV per key
    for spec in specs:
        processed = spec.input_tokens + spec.output_tokens - 1  # the last token is not fed
        matmul += 2.0 * shape.layer_matmul_params * processed
        matmul += 2.0 * shape.hidden * shape.vocab * spec.output_tokens  # LM head rows
        attention += per_position * processed * (processed + 1) / 2
    return {"matmul_flops": matmul, "attention_flops": attention}


def compute_bound(shape: Shape, specs: list[RequestSpec], matmul_tflop_s: float) -> dict:
    """The fastest the set can run at the measured matmul rate (attention at the same rate)."""
    flops = work_flops(shape, specs)
    seconds = (flops["matmul_flops"] + flops["attention_flops"]) / (matmul_tflop_s * 1e12)
    output_tokens = sum(spec.output_tokens for spec in specs)
    return {
        **{key: round(value / 1e15, 3) for key, value in flops.items()},  # PFLOP
        "bound_s": round(seconds, 3),
        "bound_output_tok_s": round(output_tokens / seconds, 1),
    }


# ---- offline (child process) ----------------------------------------------------------------
def run_offline(
    model: str,
    count: int,
    out: Path,
    device: str = "cuda",
    target_step_ms: float = 0.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """The offline part; writes its JSON to `out` after every stage."""
    import torch

    from benchmarks.gpu_bench_model import measure_ceilings
    from services.common.protocol.dummy_shapes import dummy_config
    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    on_gpu = device.startswith("cuda")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if on_gpu else device}

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    # The matmul rate of this run (a CPU smoke run takes a nominal 1 TFLOP/s).
    result["ceilings"] = measure_ceilings() if on_gpu else {"matmul_tflop_s": 1.0}
    save()
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=device,
            target_step_ms=target_step_ms,
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    result["engine_build_s"] = round(time.perf_counter() - started, 2)
    print(f"offline engine built in {result['engine_build_s']}s", flush=True)
    warm = engine.warm_up()
    print(warm.summary(), flush=True)
    result["warm_up"] = {"seconds": round(warm.seconds, 2), "summary": warm.summary()}
    info = engine.info
    result["engine"] = {
        "max_num_seqs": info.max_num_seqs,
        "max_num_batched_tokens": info.max_num_batched_tokens,
        "target_step_ms": info.target_step_ms,
        "num_blocks": info.num_blocks,
        "block_size": info.block_size,
        "execution_path": info.execution_path,
    }
    save()
    shape = Shape.of(dummy_config(model.removeprefix("dummy:")))
    matmul_rate = result["ceilings"]["matmul_tflop_s"]
    for name, specs in request_sets(count).items():
        stamp = time.perf_counter_ns()
        for spec in specs:
            params = SamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{name}-{stamp}-{spec.index}", list(spec.prompt_token_ids), params)
        started = time.perf_counter()
        steps = output_tokens = 0
        step_s: list[float] = []
        while engine.has_unfinished():
            output = engine.step()
            for delta in output.deltas:
                output_tokens += len(delta.new_token_ids)
            step_s.append(output.step_time_s)
            steps += 1
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        bound = compute_bound(shape, specs, matmul_rate)
        result[name] = {
            "requests": len(specs),
            "input_tokens": sum(s.input_tokens for s in specs),
            "output_tokens": output_tokens,
            "seconds": round(elapsed, 3),
            "steps": steps,
            "step_ms": percentiles_ms(step_s),
            "output_tok_s": round(output_tokens / elapsed, 1),
            "overlapped_steps": engine.num_overlapped_steps,
            "preemptions": engine.num_preemptions,
            **bound,
            "over_compute_bound": round(bound["bound_s"] / elapsed, 3),
        }
        save()
        print(name, json.dumps(result[name]), flush=True)


def add_schedule_floors(offline: dict[str, Any], model: str, kv_cache_dtype: str) -> None:
    """Each timed set's floor on the engine's schedule at the run's ceilings
    (benchmarks/schedule_floor.py), computed here, after the offline child has ended, so that
    nothing runs beside the timed engine. Not on a CPU smoke run (no copy rate)."""
    from benchmarks.schedule_floor import floors_of_report

    if "copy_gb_s" not in offline.get("ceilings", {}) or "engine" not in offline:
        return
    for name, floor in floors_of_report(offline, model, kv_cache_dtype).items():
        offline[name]["schedule_floor"] = floor
        offline[name]["over_schedule_floor"] = floor["measured_over_floor"]


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """Mean, p50, p90, p99 and max of step times, in ms."""
    if not seconds:
        return {}
    values = np.asarray(seconds) * 1e3
    stats = {"mean": float(values.mean()), "max": float(values.max())}
    for q in (50, 90, 99):
        stats[f"p{q}"] = float(np.percentile(values, q))
    return {key: round(value, 2) for key, value in stats.items()}


# ---- the stack ------------------------------------------------------------------------------
def _phase(
    name: str,
    specs: list[RequestSpec],
    times: list[float],
    target: str,
    *,
    concurrency: int | None,
    workers: int,
    plots_dir: Path | None,
    pids: dict[str, int],
    retries: int = 0,
) -> dict[str, Any]:
    """One load phase through the router: the harness's report plus CPU seconds per token
    (`retries`: sends again of a request refused with RESOURCE_EXHAUSTED)."""
    import psutil

    from loadtest.report import build_report, write_report
    from loadtest.runner import run
    from loadtest.schedule import ClientOptions

    processes = {key: psutil.Process(pid) for key, pid in pids.items()}

    def cpu() -> dict[str, float]:
        return {key: sum(p.cpu_times()[:2]) for key, p in processes.items()}

    options = ClientOptions(
        target=target, grpc_channels=8, timeout_s=900.0, temperature=0.0, retries=retries
    )
    before = cpu()
    result = run(
        specs, times, options, max_concurrency=concurrency, workers=workers, emit=lambda m: None
    )
    after = cpu()
    slo = {"ttft": TTFT_SLO_MS, "tpot": TPOT_SLO_MS}
    report = build_report(result.records, slo=slo, config={"phase": name})
    if plots_dir is not None:
        with contextlib.suppress(Exception):  # plots are a by-product; keep the figures
            write_report(report, plots_dir / f"{name}.json", result.records, None, 0.0)
    summary, details = report["summary"], report["details"]
    tokens = max(details["total_output_tokens"], 1)
    ok = [r for r in result.records if r.status == "OK"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    phase = {
        "requests": len(specs),
        "concurrency": concurrency,
        "duration_s": round(details["duration_s"], 3),
        "completed": details["completed"],
        "errors": details["errors"],
        "retried_requests": details["retried_requests"],
        "output_tok_s": round(summary["output_token_throughput"], 1),
        "request_rate": round(summary["request_throughput"], 3),
        "goodput_req_s": round(summary["goodput"], 3),
        "ttft_ms": {k: _round(v) for k, v in summary["ttft_ms"].items()},
        "tpot_ms": {k: _round(v) for k, v in summary["tpot_ms"].items()},
        "admitted_p99_ttft_s": round(float(np.percentile(ttfts, 99)), 3) if ttfts else None,
        "cpu_us_per_token": {
            key: round((after[key] - before[key]) / tokens * 1e6, 2) for key in processes
        },
        "ttft_in_order_s": [None if r.ttft_s is None else round(r.ttft_s, 4) for r in ok[:12]],
        "ttft_after_first10_p50_ms": (
            round(float(np.median([r.ttft_s for r in ok[10:] if r.ttft_s is not None])) * 1e3, 2)
            if len(ok) > 10
            else None
        ),
    }
    if concurrency is None:  # open arrivals: what happened second by second
        phase["timeline"] = send_timeline(result.records)
    shown = {k: v for k, v in phase.items() if k not in ("ttft_in_order_s", "timeline")}
    print(name, json.dumps(shown), flush=True)
    return phase


def send_timeline(records: list[Any], bucket_s: float = 1.0) -> list[dict[str, Any]]:
    """The requests by the second they were sent in: how many, how many were refused, and
    the TTFTs of the admitted ones (median and largest): where in a phase a tail comes from."""
    sent = [r for r in records if r.sent_s is not None]
    if not sent:
        return []
    start = min(r.sent_s for r in sent)
    buckets: dict[int, list[Any]] = {}
    for record in sent:
        buckets.setdefault(int((record.sent_s - start) // bucket_s), []).append(record)
    rows = []
    for index in sorted(buckets):
        group = buckets[index]
        ttfts = [r.ttft_s for r in group if r.status == "OK" and r.ttft_s is not None]
        rows.append(
            {
                "from_s": round(index * bucket_s, 3),
                "sent": len(group),
                "refused": sum(r.status == "RESOURCE_EXHAUSTED" for r in group),
                "ttft_p50_s": round(float(np.median(ttfts)), 3) if ttfts else None,
                "ttft_max_s": round(max(ttfts), 3) if ttfts else None,
            }
        )
    return rows


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def run_stack(args: argparse.Namespace, report: dict[str, Any], save) -> None:
    from loadtest.arrivals import arrival_times
    from services.common.ports import free_port
    from services.launcher import Stack, StackConfig, describe_engines, engine_info

    log_dir = Path(tempfile.mkdtemp(prefix="gpu-stack-"))
    config = StackConfig(
        model=args.model,
        port=free_port(),
        engine_args=(
            *("--device", args.device, "--target-step-ms", str(args.target_step_ms)),
            *("--kv-cache-dtype", args.kv_cache_dtype),
        ),
        router_args=("--max-queue-delay-s", str(args.max_queue_delay_s), "--log-level", "WARNING"),
        log_dir=log_dir,
        startup_timeout_s=400.0,
    )
    started = time.perf_counter()
    stack = Stack(config).start()
    stack_report: dict[str, Any] = {"start_s": round(time.perf_counter() - started, 1)}
    report["stack"] = stack_report
    try:
        stack_report["engines"] = describe_engines(stack.engine_addresses)
        stack_report["engine_log"] = _engine_log_lines(log_dir)
        save()
        target = stack.router_address
        pids = {"router": stack.router.process.pid, "tokenizer": stack.tokenizer.process.pid}
        sets = request_sets(args.num_requests)
        common = {"target": target, "plots_dir": args.plots_dir, "pids": pids}
        # 1. Fresh stack, low load: the first 10 requests against the steady state.
        low = sets["fixed"][: args.low_requests]
        times_low = arrival_times("exponential", args.low_rate, num_requests=len(low), seed=3)
        phase = _phase("low-load", low, times_low, concurrency=None, workers=1, **common)
        first = [t for t in phase["ttft_in_order_s"][:10] if t is not None]
        steady = phase["ttft_after_first10_p50_ms"]
        phase["first10_ttft_s"] = first
        stack_report["low_load"] = phase
        if first and steady:  # the slowest of the first 10, and their mean, over the steady p50
            report["first10_ttft_over_p50"] = round(max(first) * 1e3 / steady, 3)
            report["first10_ttft_mean_over_p50"] = round(np.mean(first) * 1e3 / steady, 3)
        save()
        # 2. Saturation: each set closed-loop, by default as many streams as the engines run
        # at once (more would only queue, and the queue-delay bound refuses what waits long).
        concurrency = args.concurrency or sum(
            engine_info(address).max_num_seqs for address in stack.engine_addresses
        )
        stack_report["saturation_concurrency"] = concurrency
        for name, specs in sets.items():
            if _time_left(args) < 60:
                stack_report[f"saturation_{name}"] = {"skipped": "out of time"}
                continue
            times = [0.0] * len(specs)
            phase = _phase(
                f"saturation-{name}", specs, times, concurrency=concurrency,
                workers=args.workers, retries=SATURATION_RETRIES, **common,
            )  # fmt: skip
            stack_report[f"saturation_{name}"] = phase
            save()
        saturation = stack_report.get("saturation_fixed", {})
        sat_rate = saturation.get("request_rate")
        if sat_rate:
            report["router_cpu_us_per_token"] = saturation["cpu_us_per_token"]["router"]
            report["tokenizer_cpu_us_per_token"] = saturation["cpu_us_per_token"]["tokenizer"]
            report["router_ceiling_tok_s_per_core"] = round(
                1e6 / max(report["router_cpu_us_per_token"], 1e-3)
            )
        # 3. Poisson rates as multiples of the saturation rate (2x: overload).
        for multiple in [float(m) for m in args.rate_multiples.split(",") if m] if sat_rate else []:
            rate = multiple * sat_rate
            count = min(args.num_requests, max(50, int(rate * args.sweep_duration_s)))
            if _time_left(args) < count / rate + 45:
                stack_report[f"poisson_{multiple:g}x"] = {"skipped": "out of time"}
                continue
            specs = sets["fixed"][:count]
            times = arrival_times("exponential", rate, num_requests=count, seed=5)
            phase = _phase(
                f"poisson-{multiple:g}x", specs, times, concurrency=None, workers=args.workers,
                **common,
            )  # fmt: skip
            phase["offered_req_s"] = round(rate, 3)
            stack_report[f"poisson_{multiple:g}x"] = phase
            if multiple == 2.0:
                report["overload_admitted_p99_ttft_s"] = phase["admitted_p99_ttft_s"]
                report["overload_goodput_over_saturation"] = round(
                    phase["goodput_req_s"] / sat_rate, 3
                )
                report["overload_refused"] = phase["errors"].get("RESOURCE_EXHAUSTED", 0)
            save()
        # 4. The low-load arrivals once more, the stack long warm: a request among the first
        # ten that is as slow here met another request's prefill (the schedule), not a cold
        # stack. Its slowest first-10 TTFT over the same steady p50 as the fresh run's.
        if steady and _time_left(args) > times_low[-1] + 30:
            replay = _phase("low-load-replay", low, times_low, concurrency=None, workers=1,
                            **common)  # fmt: skip
            stack_report["low_load_replay"] = replay
            again = [t for t in replay["ttft_in_order_s"][:10] if t is not None]
            if again:
                report["first10_replay_ttft_over_p50"] = round(max(again) * 1e3 / steady, 3)
            save()
    finally:
        stack_report["engine_log"] = _engine_log_lines(log_dir)
        stack.stop()
        save()


# A saturation stream refused by the queue-delay bound (every stream starts at once, so the
# first prompts queue for seconds) sends its request again after the router's retry-after, as
# a client would; the engines meanwhile work through what was admitted. Its TTFT counts from
# the first send.
SATURATION_RETRIES = 100


def _engine_log_lines(log_dir: Path) -> list[str]:
    keys = (
        "step limits", "warmed in", "CUDA fast path", "KV blocks", "Traceback", "Error",
        "measured", "warm-up did not cover",
    )  # fmt: skip
    lines = []
    for path in sorted(log_dir.glob("engine*.log")):
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                if any(key in line for key in keys):
                    lines.append(line[-400:])
    return lines[-20:]


_DEADLINE = [float("inf")]


def _time_left(args: argparse.Namespace) -> float:
    return _DEADLINE[0] - time.monotonic()


# ---- main -----------------------------------------------------------------------------------
def headline(report: dict[str, Any]) -> None:
    """The top-level ratios from the offline part and the saturation phase."""
    offline = report.get("offline", {}).get("fixed", {})
    report["offline_output_tok_s"] = offline.get("output_tok_s")
    report["offline_over_compute_bound"] = offline.get("over_compute_bound")
    sharegpt = report.get("offline", {}).get("sharegpt", {})
    report["offline_sharegpt_over_compute_bound"] = sharegpt.get("over_compute_bound")
    report["offline_over_schedule_floor"] = offline.get("over_schedule_floor")
    stack = report.get("stack", {})
    for name, key in (
        ("fixed", "stack_over_offline_tok_s"),
        ("sharegpt", "stack_over_offline_sharegpt"),
    ):
        saturation = stack.get(f"saturation_{name}", {}).get("output_tok_s")
        base = report.get("offline", {}).get(name, {}).get("output_tok_s")
        if saturation and base:
            report[key] = round(saturation / base, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_stack", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run")
    parser.add_argument("--num-requests", type=int, default=1000, help="requests per set")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="closed-loop streams (default 0: the engines' max_num_seqs, summed)",
    )
    parser.add_argument("--workers", type=int, default=4, help="load-generator processes")
    parser.add_argument("--low-rate", type=float, default=2.0, help="req/s of the fresh stack")
    parser.add_argument("--low-requests", type=int, default=40)
    parser.add_argument("--rate-multiples", default="0.5,2", help="Poisson rates x saturation")
    parser.add_argument(
        "--sweep-duration-s", type=float, default=20.0, help="seconds of load per Poisson rate"
    )
    parser.add_argument("--max-queue-delay-s", type=float, default=1.0)
    parser.add_argument(
        "--target-step-ms",
        type=float,
        default=0.0,
        help="the stack engine's step-time target in ms (default 0: off)",
    )
    parser.add_argument(
        "--offline-target-step-ms",
        type=float,
        default=0.0,
        help="the offline engine's step-time target in ms (default 0: off)",
    )
    parser.add_argument("--budget-s", type=float, default=560.0, help="stop starting phases after")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default by GPU name)")
    parser.add_argument("--plots-dir", type=Path, default=None, help="harness reports + plots")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="the engines' KV cache: auto or fp8"
    )
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-stack", action="store_true")
    parser.add_argument("--offline-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offline_child is not None:
        run_offline(
            args.model,
            args.num_requests,
            args.offline_child,
            args.device,
            args.offline_target_step_ms,
            args.kv_cache_dtype,
        )
        return 0
    _DEADLINE[0] = time.monotonic() + args.budget_s
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_stack needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    tag = "h200" if "H200" in device else "h100" if "H100" in device else device.split()[-1].lower()
    out = args.out or Path(f"benchmarks/results/gpu-stack-{tag}.json")
    report: dict[str, Any] = {
        "offline_over_compute_bound": None,
        "offline_output_tok_s": None,
        "offline_over_schedule_floor": None,
        "stack_over_offline_tok_s": None,
        "first10_ttft_over_p50": None,
        "max_queue_delay_s": args.max_queue_delay_s,
        "target_step_ms": args.target_step_ms,
        "offline_target_step_ms": args.offline_target_step_ms,
        "kv_cache_dtype": args.kv_cache_dtype,
        "overload_admitted_p99_ttft_s": None,
        "overload_goodput_over_saturation": None,
        "router_cpu_us_per_token": None,
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.gpu_stack "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "requests_per_set": args.num_requests,
        "slo_ms": {"ttft": TTFT_SLO_MS, "tpot": TPOT_SLO_MS},
        "software": {"torch": torch.__version__},
    }
    del torch

    def save() -> None:
        headline(report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    if not args.skip_offline:
        child_out = Path(tempfile.mkdtemp(prefix="gpu-stack-offline-")) / "offline.json"
        command = [sys.executable, "-m", "benchmarks.gpu_stack", "--model", args.model]
        command += ["--num-requests", str(args.num_requests), "--device", args.device]
        command += ["--offline-target-step-ms", str(args.offline_target_step_ms)]
        command += ["--kv-cache-dtype", args.kv_cache_dtype]
        command += ["--offline-child", str(child_out)]
        started = time.perf_counter()
        try:
            status = subprocess.run(command, timeout=max(60, _time_left(args) - 200)).returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
        report["offline"] = json.loads(child_out.read_text()) if child_out.is_file() else {}
        report["offline"]["exit_status"] = status
        report["offline"]["wall_s"] = round(time.perf_counter() - started, 1)
        add_schedule_floors(report["offline"], args.model, args.kv_cache_dtype)
        save()
    if not args.skip_stack:
        run_stack(args, report, save)
    save()
    keys = [
        "device", "offline_output_tok_s", "offline_over_compute_bound",
        "offline_over_schedule_floor",
        "offline_sharegpt_over_compute_bound", "stack_over_offline_tok_s",
        "stack_over_offline_sharegpt", "first10_ttft_over_p50", "first10_ttft_mean_over_p50",
        "first10_replay_ttft_over_p50",
        "max_queue_delay_s", "target_step_ms", "offline_target_step_ms",
        "overload_admitted_p99_ttft_s", "overload_goodput_over_saturation", "overload_refused",
        "router_cpu_us_per_token", "tokenizer_cpu_us_per_token", "router_ceiling_tok_s_per_core",
    ]  # fmt: skip
    for key in keys:
        print(f"{key:40s} {report.get(key)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
