"""Several-GPU benchmark: data parallel through one router, and tensor-parallel decode latency.

    python -m benchmarks.multi_gpu                  # on a host with 2+ NVIDIA GPUs
    bash benchmarks/multi_gpu_run.sh                # the same plus the TP GPU tests, one command

(a) Data parallel. The same request set (fixed: N prompts of 512 random token ids, 256 output
tokens each, greedy, EOS ignored; benchmarks/gpu_stack.py) goes closed-loop through one router
(`sluice up --no-ray --no-redis` as a Stack in this process) over 1 engine on GPU 0, then over
G engines, one per GPU (each pinned with CUDA_VISIBLE_DEVICES, as `sluice up` pins them), in
the same run. Concurrency is `--concurrency-per-gpu` streams per engine, so every engine is
saturated. Reported: output tokens/s of each and `dp_speedup` (G GPUs over 1; goal >= 1.9 at 2).

(b) Tensor parallel. In a child process per size (its GPU memory is gone when it ends): an
LLMEngine on `--tp-model` (default dummy:llama-3-8b) at TP=1, then at TP=2 (ranks on GPUs 0
and 1, NCCL, NVLink multicast off), warmed, one request of 128 prompt tokens decoding 256
tokens: the median wall time of its decode steps (`LLMEngine.step`, batch 1, CUDA graphs with
the all-reduces inside). Reported: `tp2_over_tp1_decode_step` (goal <= 0.6).

Writes the JSON report to `--out` (default benchmarks/results/multi-gpu-<gpu>.json) after
every phase.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "dummy:llama-3-8b"
PROMPT_TOKENS = 128
DECODE_TOKENS = 256
WARM_STEPS = 16


# ---- (b) tensor-parallel decode step, in a child process ------------------------------------
def run_decode_child(model: str, tensor_parallel_size: int, out: Path) -> None:
    """Median bs=1 decode step of `model` at `tensor_parallel_size`; JSON to `out`."""
    import torch

    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    result: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size}
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(model=model, device="cuda", tensor_parallel_size=tensor_parallel_size)
    )
    result["engine_build_s"] = round(time.perf_counter() - started, 1)
    result["execution_path"] = engine.info.execution_path
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("decode", list(range(1000, 1000 + PROMPT_TOKENS)), params)
    engine.step()  # the prefill
    step_ms = []
    while engine.has_unfinished():
        torch.cuda.synchronize()
        begin = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - begin) * 1e3)
    steady = step_ms[WARM_STEPS:]
    result.update(
        decode_steps=len(step_ms),
        decode_step_p50_ms=round(statistics.median(steady), 4),
        decode_step_p10_ms=round(sorted(steady)[len(steady) // 10], 4),
        decode_step_p90_ms=round(sorted(steady)[len(steady) * 9 // 10], 4),
    )
    runner = engine.runner
    result["graph_steps"] = getattr(runner, "graph_steps", None)
    out.write_text(json.dumps(result, indent=1))
    if runner.tensor_parallel is not None:
        runner.tensor_parallel.close()


def tensor_parallel_decode(args: argparse.Namespace, report: dict[str, Any], save) -> None:
    results = {}
    for size in (1, 2):
        out = Path(tempfile.mkdtemp(prefix="multi-gpu-tp-")) / "decode.json"
        command = [sys.executable, "-m", "benchmarks.multi_gpu", "--tp-model", args.tp_model]
        command += ["--decode-child", str(size), "--child-out", str(out)]
        started = time.perf_counter()
        try:
            status = subprocess.run(command, timeout=args.tp_timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
        results[size] = json.loads(out.read_text()) if out.is_file() else {}
        results[size].update(exit_status=status, wall_s=round(time.perf_counter() - started, 1))
        report["tensor_parallel"] = {f"tp{key}": value for key, value in results.items()}
        save()
    one, two = (results[size].get("decode_step_p50_ms") for size in (1, 2))
    if one and two:
        report["tp2_over_tp1_decode_step"] = round(two / one, 3)
    save()


# ---- (a) data parallel through one router -------------------------------------------------
def data_parallel(args: argparse.Namespace, report: dict[str, Any], save) -> None:
    from benchmarks.gpu_stack import _phase, fixed_specs
    from services.common.ports import free_port
    from services.launcher import Stack, StackConfig, describe_engines

    specs = fixed_specs(args.num_requests)
    runs: dict[str, Any] = {}
    report["data_parallel"] = runs
    for gpus in (1, args.gpus):
        log_dir = Path(tempfile.mkdtemp(prefix=f"multi-gpu-dp{gpus}-"))
        config = StackConfig(
            model=args.model,
            port=free_port(),
            engines=gpus,
            engine_gpus=tuple(str(index) for index in range(gpus)),
            engine_args=("--device", "cuda"),
            router_args=("--log-level", "WARNING"),
            log_dir=log_dir,
            startup_timeout_s=400.0,
        )
        started = time.perf_counter()
        stack = Stack(config).start()
        run: dict[str, Any] = {"gpus": gpus, "start_s": round(time.perf_counter() - started, 1)}
        runs[f"gpus{gpus}"] = run
        try:
            run["engines"] = describe_engines(stack.engine_addresses)
            pids = {"router": stack.router.process.pid, "tokenizer": stack.tokenizer.process.pid}
            concurrency = args.concurrency_per_gpu * gpus
            run["saturation"] = _phase(
                f"saturation-{gpus}gpu",
                specs,
                [0.0] * len(specs),
                stack.router_address,
                concurrency=concurrency,
                workers=args.workers,
                plots_dir=None,
                pids=pids,
            )
        finally:
            stack.stop()
            save()
    one = runs.get("gpus1", {}).get("saturation", {}).get("output_tok_s")
    many = runs.get(f"gpus{args.gpus}", {}).get("saturation", {}).get("output_tok_s")
    if one and many:
        report["dp_speedup"] = round(many / one, 3)
    save()


# ---- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multi_gpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="data-parallel model")
    parser.add_argument("--tp-model", default=DEFAULT_MODEL, help="tensor-parallel model")
    parser.add_argument("--gpus", type=int, default=2, help="engines of the data-parallel run")
    parser.add_argument("--num-requests", type=int, default=400, help="requests per DP run")
    parser.add_argument("--concurrency-per-gpu", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="load-generator processes")
    parser.add_argument("--tp-timeout-s", type=float, default=150.0, help="per TP child")
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--decode-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_child is not None:
        run_decode_child(args.tp_model, args.decode_child, args.child_out)
        return 0
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2 or args.gpus > count:
        print(f"multi_gpu needs {max(2, args.gpus)} GPUs, {count} visible", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in device else "h100" if "H100" in device else device.split()[-1]
    out = args.out or Path(f"benchmarks/results/multi-gpu-{tag.lower()}-x{count}.json")
    report: dict[str, Any] = {
        "dp_speedup": None,
        "tp2_over_tp1_decode_step": None,
        "device": f"{count} x {device}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.multi_gpu "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "tp_model": args.tp_model,
        "software": {
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        },
    }
    del torch

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    if not args.skip_tp:
        tensor_parallel_decode(args, report, save)
    if not args.skip_dp:
        data_parallel(args, report, save)
    for key in ("device", "dp_speedup", "tp2_over_tp1_decode_step"):
        print(f"{key:28s} {report.get(key)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
