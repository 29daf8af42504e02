"""Multi-LoRA through the whole stack: N adapters in S device slots against the base model.

    python -m benchmarks.lora_stack --out lora-stack.json     # on a machine with an NVIDIA GPU
    python -m benchmarks.lora_stack --model dummy:tiny --device cpu --adapters 8 --max-loras 2 \
        --input-len 32 --output-len 16 --num-requests 300 --duration-s 10 --concurrency 16 \
        --workers 2 --budget-s 120                              # a smoke run on a CPU

What the product's multi-LoRA goal asks, measured in one run: `--adapters` (100) random PEFT
rank-16 adapters on all seven projections (benchmarks/lora_stack_adapters.py writes them under
a temporary `--adapter-root`), a stack started as `sluice up --no-ray --no-redis` does (a
`Stack` in this process) with `--max-loras` (16) device slots, every adapter in host memory
(`--max-cpu-loras` = N) and the router's `--lora-max-wait-s`; adapters registered by name with
the router's AddAdapter (as `sluice adapters add`). Requests: `--input-len` (512) random token
ids, `--output-len` (256) tokens, greedy, EOS ignored, fixed seeds. In order:

0. Warm-up of each stack, not timed: a few base requests and, on the LoRA stack, one short
   request per adapter (every adapter then sits in host memory, as it does in a steady state
   with max_cpu_loras >= N).
1. Base saturation: closed loop at `--concurrency` for `--num-requests`; the saturation rate is
   the steady part's output tokens/s (first finish to last send) over the output length.
2. Base model, Poisson at `--rate-fraction` (0.8) x that rate for `--duration-s`.
3. The same arrivals and prompts, each naming an adapter drawn Zipf (`--zipf-s` 1.1) over the N
   adapters, as `sluice bench --adapter-dist zipf` draws them.

Phases 1 and 2 run on a stack without adapters (`--base-stack plain`, the default: the base
model as it is served without LoRA), stopped before the LoRA stack starts; `--base-stack same`
runs them on the LoRA stack (one start less; base rows then go through the LoRA-capable steps).
`--slot-quanta 100,25` repeats phase 3 on a fresh LoRA stack per `--lora-slot-quantum-ms` value
(`lora_poisson` is the first; the others go in `quantum_sweep` with their ratios to the base),
and `--ab-engine-args=FLAGS` (repeatable) once more per value with those engine flags added
(`lora_poisson_ab_1`, ...): an A/B of an engine option on one card, in one run.
The router's queue wait comes from its first-token phase histogram (bucket bounds) and is
bounded above by the client's TTFT. Phase durations shrink to fit `--budget-s`; a request still
running at the budget's end is cut (DEADLINE_EXCEEDED, counted in the phase's errors), and a
Poisson phase with cut requests leaves the output and TTFT goals undecided (`cut_by_budget`):
its output counts to a finish that never came.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import lora_stack_adapters as adapters_side
from benchmarks.lora_stack_load import (
    make_specs,
    run_phase,
    steady_rate,
    summarize,
    ttft_p99_by_group,
    with_adapters,
)
from loadtest.datasets import choose_adapters

DRAIN_ALLOWANCE_S = 5.0  # beyond output_len x TPOT after the last arrival
LORA_EXTRA_DRAIN_S = 20.0  # kept for requests of rare adapters still queued at the end
STOP_ALLOWANCE_S = 15.0
RESTART_ALLOWANCE_S = 10.0  # beyond the first start, for the second stack's registration
# Registration (~0.2 s: read and hashed) and warm-up (~0.25-0.3 s: read, checked, hashed,
# pinned on the engine's loader threads) of each adapter on a LoRA stack's start, measured on
# H100 and H200 hosts.
WARM_S_PER_ADAPTER = 0.6


def _time_left(deadline: float) -> float:
    return deadline - time.monotonic()


@dataclass(frozen=True)
class LoRAVariant:
    """One LoRA phase's stack: its key in `phases`, slot quantum and extra engine flags."""

    key: str
    quantum_ms: float | None = None
    engine_args: str = ""

    @property
    def label(self) -> str:  # of its stack in setup and of its log directory
        return self.key.replace("_poisson", "")


def lora_variants(args: argparse.Namespace) -> list[LoRAVariant]:
    """The LoRA phases of a run: one per --slot-quanta value (the engine's default quantum
    without any), then one per --ab-engine-args at the first quantum."""
    quanta = args.slot_quanta or [None]
    variants = [
        LoRAVariant(
            "lora_poisson" if index == 0 else f"lora_poisson_quantum_{quantum_ms:g}", quantum_ms
        )
        for index, quantum_ms in enumerate(quanta)
    ]
    variants += [
        LoRAVariant(f"lora_poisson_ab_{index}", quanta[0], flags)
        for index, flags in enumerate(args.ab_engine_args, start=1)
    ]
    return variants


@dataclass(frozen=True)
class RunningStack:
    stack: Any  # services.launcher.Stack
    target: str  # the router's gRPC address
    metrics_url: str  # the router's /metrics


def start_stack(
    args: argparse.Namespace,
    adapter_root: Path | None,
    log_dir: Path,
    quantum_ms: float | None,
    extra_engine_args: str = "",
) -> RunningStack:
    """A stack as `sluice up --no-ray --no-redis` starts it, adapters on when given a root."""
    from services.common.ports import free_port
    from services.launcher import Stack, StackConfig

    lora_flags = () if adapter_root is None else (
        "--adapter-root", str(adapter_root), "--max-loras", str(args.max_loras),
        "--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", str(args.rank),
    )  # fmt: skip
    if adapter_root is not None and quantum_ms is not None:
        lora_flags += ("--lora-slot-quantum-ms", f"{quantum_ms:g}")
    metrics_port = free_port()
    router_args = (
        "--lora-max-wait-s", str(args.lora_max_wait_s),
        "--max-queue-delay-s", str(args.max_queue_delay_s),
        "--metrics-port", str(metrics_port), "--log-level", "WARNING",
        *args.router_args.split(),
    )  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    config = StackConfig(
        model=args.model, port=free_port(),
        engine_args=(
            "--device", args.device, *lora_flags, *args.engine_args.split(),
            *extra_engine_args.split(),
        ),
        router_args=router_args, log_dir=log_dir, startup_timeout_s=400.0,
    )  # fmt: skip
    stack = Stack(config).start()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    return RunningStack(stack, stack.router_address, metrics_url)


def prepare(args: argparse.Namespace, root: Path | None, names: list[str], log_dir: Path,
            setup: dict[str, Any], variant: LoRAVariant) -> RunningStack:  # fmt: skip
    """Start a stack (adapters on with a root: `variant`'s), register the adapters, warm it
    (one short request per adapter, 8 base)."""
    from services.launcher import describe_engines

    started = time.perf_counter()
    running = start_stack(args, root, log_dir, variant.quantum_ms, variant.engine_args)
    key = variant.label if root is not None else "plain"
    setup[f"{key}_stack_start_s"] = round(time.perf_counter() - started, 1)
    setup[f"{key}_engines"] = describe_engines(running.stack.engine_addresses)
    print(f"{key} stack up in {setup[f'{key}_stack_start_s']}s", flush=True)
    target = running.target
    if root is None:
        names = []
    else:
        setup["register_s"] = round(adapters_side.register_adapters(target, names), 2)
        print(f"registered {len(names)} adapters in {setup['register_s']}s", flush=True)
    warm = make_specs(len(names) + 8, min(args.input_len, 32), 2, seed=args.seed + 7)
    warm = with_adapters(warm, [*names, *[""] * 8])
    started = time.perf_counter()
    records = run_phase(warm, [0.0] * len(warm), target, concurrency=32, workers=1)
    setup[f"{key}_warm_up_s"] = round(time.perf_counter() - started, 1)
    setup[f"{key}_warm_up_errors"] = summarize(records)["errors"]
    print(f"{key} warm-up: {len(warm)} requests in {setup[f'{key}_warm_up_s']}s", flush=True)
    return running


def poisson_phase(args: argparse.Namespace, running: RunningStack, specs: list,
                  times: list[float], timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """One open-loop phase with the router's queue waits and the slot loads seen meanwhile."""
    before = adapters_side.scrape_queue_buckets(running.metrics_url)
    poller = adapters_side.ResidencyPoller(running.target).start()
    records = run_phase(
        specs, times, running.target, concurrency=None, workers=args.workers,
        timeout_s=timeout_s,
    )  # fmt: skip
    residency = poller.stop()
    after = adapters_side.scrape_queue_buckets(running.metrics_url)
    phase = summarize(records)
    phase["router_queue_wait"] = adapters_side.queue_wait_window(
        before, after, args.lora_max_wait_s
    )
    phase["residency"] = residency
    bound_s = args.lora_max_wait_s  # TTFT includes the queue wait: an upper bound on the count
    phase["ttft_over_lora_max_wait"] = sum(1 for r in records if (r.ttft_s or 0.0) > bound_s)
    names = adapters_side.adapter_names(args.adapters)
    if any(spec.adapter for spec in specs):
        phase["distinct_adapters"] = len({spec.adapter for spec in specs})
        phase["ttft_p99_ms"] = ttft_p99_by_group(records, set(names[: args.max_loras]))
    return phase


def run_bench(args: argparse.Namespace, report: dict[str, Any], save, deadline: float) -> None:
    from loadtest.arrivals import arrival_times

    root = args.adapter_dir or Path(tempfile.mkdtemp(prefix="lora-stack-adapters-"))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="lora-stack-logs-"))
    plain = args.base_stack == "plain"
    setup: dict[str, Any] = {"adapter_root": str(root), "base_stack": args.base_stack}
    report["setup"] = setup
    phases: dict[str, Any] = {}
    report["phases"] = phases
    running: RunningStack | None = None
    try:
        written = adapters_side.write_adapters(
            root, args.model, args.adapters, args.rank, args.seed
        )
        names = written.pop("names")
        setup.update(written)
        save()
        variants = lora_variants(args)
        running = prepare(
            args, None if plain else root, names, log_dir / args.base_stack, setup, variants[0]
        )
        save()
        # 1. Base saturation, closed loop.
        specs = make_specs(args.num_requests, args.input_len, args.output_len, args.seed + 1)
        records = run_phase(
            specs, [0.0] * len(specs), running.target, concurrency=args.concurrency,
            workers=args.workers, timeout_s=max(30.0, _time_left(deadline) - 60.0),
        )  # fmt: skip
        phases["base_saturation"] = {"concurrency": args.concurrency, **summarize(records)}
        rate = steady_rate(records) or phases["base_saturation"]["request_rate"]
        report["saturation_req_s"] = round(rate, 3)
        report["rate_req_s"] = round(rate * args.rate_fraction, 3)
        print("base_saturation", json.dumps(phases["base_saturation"]), flush=True)
        save()
        # 2 and 3: the same Poisson arrivals and prompts, base then Zipf-drawn adapters.
        tpot_s = (phases["base_saturation"]["tpot_ms"]["p50"] or 50.0) / 1e3
        drain_s = DRAIN_ALLOWANCE_S + args.output_len * tpot_s
        restart_s = RESTART_ALLOWANCE_S + WARM_S_PER_ADAPTER * len(names)
        restart_s = setup["plain_stack_start_s"] + restart_s if plain else 0.0
        lora_restart_s = RESTART_ALLOWANCE_S + WARM_S_PER_ADAPTER * len(names)
        lora_restart_s += setup["plain_stack_start_s"] if plain else setup["lora_stack_start_s"]
        restart_s += lora_restart_s * (len(variants) - 1)
        spare_s = (
            _time_left(deadline) - restart_s
            - (STOP_ALLOWANCE_S + LORA_EXTRA_DRAIN_S) * len(variants)
        )  # fmt: skip
        phases_left = 1 + len(variants)
        duration_s = min(args.duration_s, spare_s / phases_left - drain_s)
        report["phase_duration_s"] = round(duration_s, 1)
        if duration_s < 3.0:
            report["skipped"] = f"out of time: {duration_s:.0f}s per Poisson phase left"
            return
        times = arrival_times(
            "exponential", report["rate_req_s"], duration_s=duration_s, seed=args.seed + 2
        )
        specs = make_specs(len(times), args.input_len, args.output_len, args.seed + 3)
        rng = np.random.default_rng(args.seed + 4)
        drawn = choose_adapters(rng, names, "zipf", args.zipf_s, len(specs))
        print(f"base_poisson: {len(times)} requests over {duration_s:.0f}s", flush=True)
        # The base phase leaves the LoRA phase its share; the LoRA phase may use what is left.
        left_s = _time_left(deadline) - STOP_ALLOWANCE_S - restart_s - duration_s - drain_s
        phase = poisson_phase(args, running, specs, times, max(5.0, left_s - duration_s))
        phases["base_poisson"] = {"offered_req_s": report["rate_req_s"], **phase}
        print("base_poisson", json.dumps(phases["base_poisson"]), flush=True)
        save()
        for index, variant in enumerate(variants):
            if plain or index > 0:
                running.stack.stop()
                running = None
                where = log_dir / variant.label.replace("_", "-")
                running = prepare(args, root, names, where, setup, variant)
                save()
            key = variant.key
            print(f"{key}: {len(times)} requests over {duration_s:.0f}s", flush=True)
            later_s = (lora_restart_s + duration_s + drain_s) * (len(variants) - 1 - index)
            left_s = _time_left(deadline) - STOP_ALLOWANCE_S - later_s
            phase = poisson_phase(
                args,
                running,
                with_adapters(specs, drawn),
                times,
                # never less than the drain: past the budget rather than every request cut
                max(drain_s + LORA_EXTRA_DRAIN_S, left_s - duration_s),
            )
            phases[key] = {"offered_req_s": report["rate_req_s"],
                           "slot_quantum_ms": variant.quantum_ms,
                           "engine_args": variant.engine_args, **phase}  # fmt: skip
            print(key, json.dumps(phases[key]), flush=True)
            save()
    finally:
        setup["engine_log"] = _engine_log_lines(log_dir)
        if running is not None:
            running.stack.stop()
        if args.adapter_dir is None:
            shutil.rmtree(root, ignore_errors=True)
        save()


def headline(report: dict[str, Any], bound_s: float) -> None:
    """The goal's ratios and the longest queue wait from the two Poisson phases."""
    phases = report.get("phases", {})
    base, lora = phases.get("base_poisson"), phases.get("lora_poisson")
    if not base or not lora:
        return
    if base["output_tok_s"]:
        report["lora_over_base_output_tok_s"] = round(
            lora["output_tok_s"] / base["output_tok_s"], 3
        )
    if base["ttft_ms"]["p99"] and lora["ttft_ms"]["p99"]:
        report["lora_over_base_p99_ttft"] = round(
            lora["ttft_ms"]["p99"] / base["ttft_ms"]["p99"], 3
        )
    window = lora["router_queue_wait"]
    client_max_s = (lora["ttft_ms"]["max"] or 0.0) / 1e3
    histogram_max_s = window.get("max_s_at_most") if window.get("count") else None
    bounds = [v for v in (histogram_max_s, client_max_s if lora["ttft_ms"]["max"] else None) if v]
    report["max_queue_wait_s"] = round(min(bounds), 3) if bounds else None
    report["max_queue_wait_s_above"] = window.get("max_s_above")
    if report["max_queue_wait_s"] is not None and report["max_queue_wait_s"] <= bound_s:
        verdict = "met"
    elif (window.get("max_s_above") or 0.0) >= bound_s:
        verdict = "missed"
    else:
        verdict = "undecided (the histogram bucket straddles the bound)"
    report["queue_wait_goal"] = verdict
    report["quantum_sweep"] = [
        {
            "phase": name,
            "slot_quantum_ms": phase.get("slot_quantum_ms"),
            "engine_args": phase.get("engine_args", ""),
            "output_tok_s_over_base": _ratio(phase["output_tok_s"], base["output_tok_s"]),
            "p99_ttft_over_base": _ratio(phase["ttft_ms"]["p99"], base["ttft_ms"]["p99"]),
            "ttft_p50_ms": phase["ttft_ms"]["p50"],
            "tpot_p50_ms": phase["tpot_ms"]["p50"],
        }
        for name, phase in phases.items()
        if name.startswith("lora_poisson")
    ]
    cut = {
        name: phase["errors"]["DEADLINE_EXCEEDED"]
        for name, phase in phases.items()
        if name.endswith("poisson") and phase.get("errors", {}).get("DEADLINE_EXCEEDED")
    }
    output_goal: bool | str = (report.get("lora_over_base_output_tok_s") or 0) >= 0.85
    ttft_goal: bool | str = (report.get("lora_over_base_p99_ttft") or 1e9) <= 3.0
    if cut:
        report["cut_by_budget"] = cut
        output_goal = ttft_goal = (
            f"undecided: {sum(cut.values())} requests cut at the budget's end ({', '.join(cut)});"
            " a longer --budget-s lets them finish"
        )
    report["goals"] = {
        "output_tok_s_ratio_at_least_0.85": output_goal,
        "p99_ttft_ratio_at_most_3": ttft_goal,
        "queue_wait_within_bound": verdict,
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value and base else None


def _engine_log_lines(log_dir: Path) -> list[str]:
    keys = ("step limits", "warmed", "LoRA", "adapter", "CUDA fast path", "engine stats",
            "warm-up did not cover", "Traceback", "Error")  # fmt: skip
    lines = []
    for path in sorted(log_dir.glob("*/engine*.log")):  # the last lines of each stack's engine
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace").splitlines()
            picked = [line[-400:] for line in text if any(key in line for key in keys)]
            lines.extend(f"{path.parent.name}: {line}" for line in picked[-30:])
    return lines


def _quanta(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of milliseconds: {text!r}") from None
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError("quanta must be >= 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_stack", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--model", default="dummy:llama-3-8b")
    add("--device", default="cuda", help="cuda; cpu for a smoke run")
    add("--adapters", type=int, default=100, help="random adapters written and registered")
    add("--rank", type=int, default=16, help="their LoRA rank (also --max-lora-rank)")
    add("--max-loras", type=int, default=16, help="device slots")
    add("--max-cpu-loras", type=int, default=None, help="host cache (default: --adapters)")
    add("--lora-max-wait-s", type=float, default=2.0, help="the router's bound, recorded")
    add("--max-queue-delay-s", type=float, default=3.0, help="the router's admission by time")
    add("--zipf-s", type=float, default=1.1, help="Zipf exponent of the adapter draw")
    add("--input-len", type=int, default=512, help="prompt tokens per request")
    add("--output-len", type=int, default=256, help="output tokens per request")
    add("--concurrency", type=int, default=256, help="closed-loop streams of the saturation")
    add("--num-requests", type=int, default=800, help="requests of the saturation phase")
    add("--rate-fraction", type=float, default=0.8, help="Poisson rate x saturation rate")
    add("--duration-s", type=float, default=60.0, help="seconds of arrivals per Poisson phase")
    add("--workers", type=int, default=4, help="load-generator processes")
    add("--seed", type=int, default=0)
    add("--engine-args", default="", help='more engine flags, e.g. "--kv-cache-bytes 1000000"')
    add(
        "--router-args", default="",
        help='more router flags for both stacks, e.g. "--max-inflight-per-engine 1024"',
    )  # fmt: skip
    add("--adapter-dir", type=Path, default=None, help="write adapters here and keep them")
    add("--log-dir", type=Path, default=None, help="the services' logs (default: a temp dir)")
    add(
        "--base-stack", choices=("plain", "same"), default="plain",
        help="base phases on a stack without adapters (plain), or on the LoRA stack (same: "
        "one start less; base rows then run through the LoRA-capable steps)",
    )  # fmt: skip
    add(
        "--slot-quanta", type=_quanta, default=[],
        help="comma-separated --lora-slot-quantum-ms values: the LoRA phase once per value, each "
        "on a fresh stack (default: the engine's default, one phase)",
    )  # fmt: skip
    add(
        "--ab-engine-args", action="append", default=[], metavar="FLAGS",
        help="the LoRA phase once more on a fresh stack with these engine flags added (after "
        "--engine-args; repeatable), e.g. --ab-engine-args=--lora-fused-swiglu: an A/B of an "
        "engine option on one card",
    )  # fmt: skip
    add("--budget-s", type=float, default=360.0, help="Poisson phases shrink to end by then")
    add("--out", type=Path, default=Path(tempfile.gettempdir()) / "lora-stack.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    args.max_cpu_loras = args.max_cpu_loras or max(args.adapters, args.max_loras)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("lora_stack needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    on_gpu = args.device.startswith("cuda")
    report: dict[str, Any] = {
        "lora_over_base_output_tok_s": None,
        "lora_over_base_p99_ttft": None,
        "max_queue_wait_s": None,
        "lora_max_wait_s": args.lora_max_wait_s,
        "max_queue_wait_s_above": None,
        "queue_wait_goal": None,
        "max_queue_wait_source": "router histogram sluice_router_first_token_phase_seconds"
        '{phase="queue"} of the LoRA phase: upper bound of the bucket of the longest wait, '
        "or the longest client TTFT when lower (TTFT includes the queue wait)",
        "adapters": args.adapters,
        "device_slots": args.max_loras,
        "saturation_req_s": None,
        "rate_req_s": None,
        "device": torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.lora_stack "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "software": {"torch": torch.__version__},
    }
    del torch

    def save() -> None:
        headline(report, args.lora_max_wait_s)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    status = 0
    try:
        run_bench(args, report, save, deadline)
    except Exception as error:  # noqa: BLE001 - keep what was measured, say what failed
        report["error"] = f"{type(error).__name__}: {error}"[-2000:]
        traceback.print_exc()
        status = 1
    save()
    keys = [
        "device", "adapters", "device_slots", "saturation_req_s", "rate_req_s",
        "phase_duration_s", "lora_over_base_output_tok_s", "lora_over_base_p99_ttft",
        "max_queue_wait_s", "max_queue_wait_s_above", "lora_max_wait_s", "queue_wait_goal",
        "cut_by_budget", "skipped", "error",
    ]  # fmt: skip
    for key in keys:
        print(f"{key:32s} {report.get(key)}")
    for name, phase in report.get("phases", {}).items():
        print(
            f"{name:16s} {phase['output_tok_s']:>9} tok/s  TTFT p50/p99 {phase['ttft_ms']['p50']}"
            f"/{phase['ttft_ms']['p99']} ms  TPOT p50/p99 {phase['tpot_ms']['p50']}"
            f"/{phase['tpot_ms']['p99']} ms  errors {phase['errors']}"
        )
    print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
