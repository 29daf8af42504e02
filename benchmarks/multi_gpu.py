"""Several-GPU benchmark: data parallel through one router, and tensor-parallel decode latency.

    python -m benchmarks.multi_gpu                  # on a host with 2+ NVIDIA GPUs
    bash benchmarks/multi_gpu_run.sh                # the same plus the TP GPU tests, one command

(a) Data parallel. The same request set (fixed: `--requests-per-gpu` x G prompts of 512 random
token ids, 256 output tokens each, greedy, EOS ignored; benchmarks/gpu_stack.py) goes
closed-loop through one router (`sluice up --no-ray --no-redis` as a Stack in this process)
over 1 engine on GPU 0, then over 2, 4, ... up to G engines, one per GPU (each pinned with
CUDA_VISIBLE_DEVICES, as `sluice up` pins them), in the same run. Concurrency is
`--concurrency-per-gpu` streams per engine, so every engine is saturated. Reported: output
tokens/s of each, `dp_speedup` (2 GPUs over 1; goal >= 1.9) and `dp_speedup_by_gpus`.

(b) Tensor parallel. In a child process per run (its GPU memory is gone when it ends): an
LLMEngine on `--tp-model` (default dummy:llama-3-8b) at TP=1, at TP=2 (ranks on GPUs 0 and 1,
NVLink multicast off) with the one-shot all-reduce over symmetric memory, and at TP=2 with
NCCL for every sum; each warmed, one request of 128 prompt tokens decoding 256 tokens: the
median wall time of its decode steps (`LLMEngine.step`, batch 1, CUDA graphs with the
all-reduces inside, a device sync around each), the GPU time of rank 0's graph replays, the
host time of sending a step to rank 1, and how many greedy tokens equal TP=1's (bf16: partial
sums round differently). Then a second request decodes as a server runs it, no sync between
steps (the engine launches each step before reading the last one's token): its time per
output token. Reported: `tp2_over_tp1_decode_step` (synced steps; goal <= 0.6) and
`tp2_over_tp1_tpot` (steps as served).

(c) With `--stack-tp`: one engine at TP=2 (GPUs 0 and 1) behind the router, the same request
set closed loop: tensor parallelism served as `sluice up --tensor-parallel-size 2` serves it.

Writes the JSON report to `--out` (default benchmarks/results/multi-gpu-<gpu>.json) after
every phase.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
SUMS = {  # how a TP run sums: (custom_all_reduce, fuse_sum_norm)
    "fused": (True, True),
    "one-shot": (True, False),
    "nccl": (False, False),
}


def run_decode_child(model: str, tensor_parallel_size: int, sums: str, out: Path) -> None:
    """Median bs=1 decode step of `model` at `tensor_parallel_size`; JSON to `out`.

    Beside the step's wall time: the GPU time of rank 0's graph replay (CUDA events around
    it; at TP > 1 it includes waiting at the first all-reduce for the other rank) and the host
    time of sending the step to the other ranks. The greedy tokens go in the report, so runs
    of different sizes can be compared.
    """
    import torch

    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    result: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size}
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cuda",
            tensor_parallel_size=tensor_parallel_size,
            custom_all_reduce=SUMS[sums][0],
            fuse_sum_norm=SUMS[sums][1],
        )
    )
    result["engine_build_s"] = round(time.perf_counter() - started, 1)
    result["execution_path"] = engine.info.execution_path
    runner = engine.runner
    gpu_ms: list[float] = []
    send_ms: list[float] = []
    timed_decode(runner, gpu_ms, send_ms)
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("decode", list(range(1000, 1000 + PROMPT_TOKENS)), params)
    tokens: list[int] = []
    step_ms = []
    first = True
    while engine.has_unfinished():
        torch.cuda.synchronize()
        begin = time.perf_counter()
        output = engine.step()
        torch.cuda.synchronize()
        if not first:  # the prefill is not a decode step
            step_ms.append((time.perf_counter() - begin) * 1e3)
        first = False
        for delta in output.deltas:
            tokens += delta.new_token_ids
    steady = step_ms[WARM_STEPS:]
    result["tpot_ms"] = round(served_tpot_ms(engine, runner, params), 4)
    result.update(
        decode_steps=len(step_ms),
        decode_step_p50_ms=round(statistics.median(steady), 4),
        decode_step_p10_ms=round(sorted(steady)[len(steady) // 10], 4),
        decode_step_p90_ms=round(sorted(steady)[len(steady) * 9 // 10], 4),
        graph_gpu_p50_ms=round(statistics.median(gpu_ms[WARM_STEPS:]), 4) if gpu_ms else None,
        send_step_p50_ms=round(statistics.median(send_ms[WARM_STEPS:]), 4) if send_ms else None,
        graph_steps=getattr(runner, "graph_steps", None),
        tokens=tokens,
    )
    out.write_text(json.dumps(result, indent=1))
    if runner.tensor_parallel is not None:
        runner.tensor_parallel.close()


def served_tpot_ms(engine: Any, runner: Any, params: Any) -> float:
    """Mean time per output token of one request decoded with no sync between steps (the
    timing wrappers removed), from its first decode step to its last token."""
    import torch

    for owner in (getattr(runner, "fast", None), runner.tensor_parallel):
        if owner is not None:  # back to the class's methods: no per-step event sync
            for name in ("decode", "send_decode"):
                owner.__dict__.pop(name, None)
    engine.add_request("served", list(range(2000, 2000 + PROMPT_TOKENS)), params)
    engine.step()  # the prefill
    engine.step()  # the first decode step, launched ahead of the next
    torch.cuda.synchronize()
    tokens, begin = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(delta.new_token_ids) for delta in engine.step().deltas)
    return (time.perf_counter() - begin) * 1e3 / max(tokens, 1)


def timed_decode(runner: Any, gpu_ms: list[float], send_ms: list[float]) -> None:
    """Wrap the runner's graph decode (and its step send) to record their times."""
    import torch

    fast = getattr(runner, "fast", None)
    if fast is not None:
        decode = fast.decode

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            outputs = decode(*args, **kwargs)
            end.record()
            end.synchronize()
            gpu_ms.append(begin.elapsed_time(end))
            return outputs

        fast.decode = timed
    if runner.tensor_parallel is not None:
        send = runner.tensor_parallel.send_decode

        def timed_send(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            send(*args, **kwargs)
            send_ms.append((time.perf_counter() - begin) * 1e3)

        runner.tensor_parallel.send_decode = timed_send


def tensor_parallel_decode(args: argparse.Namespace, report: dict[str, Any], save) -> None:
    """TP=1; TP=2 (decode sums fused with their norms); TP=2 with a one-shot all-reduce, then
    the norm; TP=2 with NCCL for every sum: each in its own child process."""
    runs = {
        "tp1": (1, "fused"),
        "tp2": (2, "fused"),
        "tp2_one_shot": (2, "one-shot"),
        "tp2_nccl": (2, "nccl"),
    }
    results: dict[str, dict[str, Any]] = {}
    section: dict[str, Any] = {"date": _now(), "command": report["command"]}
    report["tensor_parallel"] = section
    for name, (size, sums) in runs.items():
        out = Path(tempfile.mkdtemp(prefix="multi-gpu-tp-")) / "decode.json"
        command = [sys.executable, "-m", "benchmarks.multi_gpu", "--tp-model", args.tp_model]
        command += ["--decode-child", str(size), "--child-out", str(out)]
        command += ["--child-sums", sums]
        started = time.perf_counter()
        try:
            status = subprocess.run(command, timeout=args.tp_timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
        results[name] = json.loads(out.read_text()) if out.is_file() else {}
        results[name].update(exit_status=status, wall_s=round(time.perf_counter() - started, 1))
        section[name] = results[name]
        save()
    one = results["tp1"].get("decode_step_p50_ms")
    one_tpot = results["tp1"].get("tpot_ms")
    for name in ("tp2", "tp2_one_shot", "tp2_nccl"):
        two = results[name].get("decode_step_p50_ms")
        if one and two:
            section[f"{name}_over_tp1_decode_step"] = round(two / one, 3)
        two_tpot = results[name].get("tpot_ms")
        if one_tpot and two_tpot:
            section[f"{name}_over_tp1_tpot"] = round(two_tpot / one_tpot, 3)
        reference, ours = results["tp1"].get("tokens"), results[name].get("tokens")
        if reference and ours:
            section[f"{name}_greedy_tokens_equal_to_tp1"] = _common_prefix(reference, ours)
    fused, unfused = results["tp2"].get("tokens"), results["tp2_one_shot"].get("tokens")
    if fused and unfused:  # the fused kernel rounds as the all-reduce + norm do: same tokens
        section["tp2_greedy_tokens_equal_to_tp2_one_shot"] = _common_prefix(fused, unfused)
    for result in results.values():  # compared: the token lists need not stay in the report
        result.pop("tokens", None)
    report["tp2_over_tp1_decode_step"] = section.get("tp2_over_tp1_decode_step")
    report["tp2_over_tp1_tpot"] = section.get("tp2_over_tp1_tpot")
    save()


def _common_prefix(first: list[int], second: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    pairs = enumerate(zip(first, second, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(first), len(second)))


# ---- (a) data parallel through one router -------------------------------------------------
def data_parallel(args: argparse.Namespace, report: dict[str, Any], save) -> None:
    runs: dict[str, Any] = {"date": _now(), "command": report["command"]}
    report["data_parallel"] = runs
    sizes = dp_sizes(args.gpus)
    requests = args.requests_per_gpu * sizes[-1]  # one set for every size: the largest's
    speedups: dict[str, float] = {}
    report["dp_speedup_by_gpus"] = speedups
    for gpus in sizes:
        run = stack_saturation(args, engines=gpus, gpus_per_engine=1, save=save, requests=requests)
        runs[f"gpus{gpus}"] = run
        one = runs["gpus1"].get("saturation", {}).get("output_tok_s")
        many = run.get("saturation", {}).get("output_tok_s")
        if gpus > 1 and one and many:
            speedups[str(gpus)] = round(many / one, 3)
    report["dp_speedup"] = speedups.get("2")
    save()


def dp_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... below `gpus`, then `gpus` itself: the engine counts of the DP run."""
    sizes, size = [], 1
    while size < gpus:
        sizes.append(size)
        size *= 2
    return [*sizes, gpus]


def stack_tensor_parallel(args: argparse.Namespace, report: dict[str, Any], save) -> None:
    """(c) One engine at TP=2 (GPUs 0 and 1) through the router: tensor parallelism served."""
    run = stack_saturation(
        args, engines=1, gpus_per_engine=2, save=save, requests=2 * args.requests_per_gpu
    )
    report["stack_tensor_parallel"] = {"date": _now(), "command": report["command"], **run}
    save()


def stack_saturation(
    args: argparse.Namespace, *, engines: int, gpus_per_engine: int, save, requests: int
) -> dict[str, Any]:
    """`engines` engines of `gpus_per_engine` GPUs each behind one router, closed loop over
    the fixed set of `requests` requests."""
    from benchmarks.gpu_stack import _phase, fixed_specs
    from services.common.ports import free_port
    from services.launcher import Stack, StackConfig, describe_engines

    specs = fixed_specs(requests)
    gpus = [str(index) for index in range(engines * gpus_per_engine)]
    groups = tuple(
        ",".join(gpus[i * gpus_per_engine : (i + 1) * gpus_per_engine]) for i in range(engines)
    )
    engine_args = ("--device", "cuda")
    if gpus_per_engine > 1:
        engine_args += ("--tensor-parallel-size", str(gpus_per_engine))
    config = StackConfig(
        model=args.model,
        port=free_port(),
        engines=engines,
        engine_gpus=groups,
        engine_args=engine_args,
        router_args=("--log-level", "WARNING"),
        log_dir=Path(tempfile.mkdtemp(prefix=f"multi-gpu-{engines}x{gpus_per_engine}-")),
        startup_timeout_s=400.0,
    )
    started = time.perf_counter()
    stack = Stack(config).start()
    run: dict[str, Any] = {
        "engines": engines,
        "gpus_per_engine": gpus_per_engine,
        "start_s": round(time.perf_counter() - started, 1),
    }
    try:
        run["engine_info"] = describe_engines(stack.engine_addresses)
        pids = {"router": stack.router.process.pid, "tokenizer": stack.tokenizer.process.pid}
        run["saturation"] = _phase(
            f"saturation-{engines}x{gpus_per_engine}gpu",
            specs,
            [0.0] * len(specs),
            stack.router_address,
            concurrency=args.concurrency_per_gpu * engines,
            workers=max(args.workers, 2 * engines),  # load generators keep up with the engines
            plots_dir=None,
            pids=pids,
        )
    finally:
        stack.stop()
        save()
    return run


TP_KEYS = ("tensor_parallel", "tp2_over_tp1_decode_step", "tp2_over_tp1_tpot")
DP_KEYS = ("data_parallel", "dp_speedup", "dp_speedup_by_gpus")
STACK_KEYS = ("stack_tensor_parallel",)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- main -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.multi_gpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="data-parallel model")
    parser.add_argument("--tp-model", default=DEFAULT_MODEL, help="tensor-parallel model")
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="most engines of the data-parallel run (default: every visible GPU); it runs "
        "1, 2, 4, ... engines up to this many",
    )
    parser.add_argument(
        "--requests-per-gpu",
        type=int,
        default=400,
        help="requests of the DP set per GPU of its largest run (every run gets the same set)",
    )
    parser.add_argument("--concurrency-per-gpu", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4, help="load-generator processes")
    parser.add_argument("--tp-timeout-s", type=float, default=150.0, help="per TP child")
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument(
        "--stack-tp",
        action="store_true",
        help="also serve one TP=2 engine through the router at saturation (phase c)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the skipped phase's figures (each with its date and command) from --out",
    )
    parser.add_argument("--decode-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--child-sums", choices=sorted(SUMS), default="fused", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.decode_child is not None:
        run_decode_child(args.tp_model, args.decode_child, args.child_sums, args.child_out)
        os._exit(0)  # past the group's teardown: nothing of this child is needed any more
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    args.gpus = count if args.gpus is None else args.gpus
    if count < 2 or not 2 <= args.gpus <= count:
        print(f"multi_gpu needs {max(2, args.gpus)} GPUs, {count} visible", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    tag = "h200" if "H200" in device else "h100" if "H100" in device else device.split()[-1]
    out = args.out or Path(f"benchmarks/results/multi-gpu-{tag.lower()}-x{count}.json")
    report: dict[str, Any] = {
        "dp_speedup": None,
        "dp_speedup_by_gpus": None,
        "tp2_over_tp1_decode_step": None,
        "tp2_over_tp1_tpot": None,
        "device": f"{count} x {device}",
        "date": _now(),
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

    if args.update and out.is_file():  # keep the phases this run skips, with their own dates
        previous = json.loads(out.read_text())
        phases = ((args.skip_tp, TP_KEYS), (args.skip_dp, DP_KEYS), (not args.stack_tp, STACK_KEYS))
        for skipped, keys in phases:
            if skipped:
                report.update({key: previous[key] for key in keys if key in previous})

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    if not args.skip_tp:
        tensor_parallel_decode(args, report, save)
    if not args.skip_dp:
        data_parallel(args, report, save)
    if args.stack_tp:
        stack_tensor_parallel(args, report, save)
    for key in ("device", "dp_speedup_by_gpus", "tp2_over_tp1_decode_step", "tp2_over_tp1_tpot"):
        print(f"{key:28s} {report.get(key)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
