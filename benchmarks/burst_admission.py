"""Admission by time under a burst: what a fresh stack admits when requests come faster than it
could ever start them, and how long the admitted ones wait for their first token.

    python -m benchmarks.burst_admission                   # the default model on this CPU
    python -m benchmarks.burst_admission --model dummy:llama-3-8b --device cuda --rate 400 \\
        --requests 600

A stack (`sluice up --no-ray --no-redis`, router `--max-queue-delay-s`), a short warm phase
(the engine measures its rates: 20 requests of 128 prompt tokens at 4 a second), then the
burst through `sluice bench` (Poisson arrivals at `--rate`, prompts of 512 +- 256 random token
ids, 128 output tokens). A request the router cannot start within the bound should be refused at
once (RESOURCE_EXHAUSTED); an admitted one should see its first token within about the bound.
Prints and writes a JSON report: refused and admitted counts, the admitted requests' TTFT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.faults import cpu_name
from benchmarks.gpu_soak import run_bench


def bench(target: str, out: Path, *flags: str) -> dict[str, Any]:
    """One `sluice bench` run in a child process; its report."""
    report, _, code, stderr = run_bench(target, out, list(flags))
    if report is None or code != 0:
        raise RuntimeError(f"sluice bench exited {code}: {stderr}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.burst_admission",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="", help="model ('': the default model)")
    parser.add_argument("--device", default="cpu", help="the engine's device")
    parser.add_argument("--rate", type=float, default=40.0, help="burst arrivals a second")
    parser.add_argument("--requests", type=int, default=60, help="requests in the burst")
    parser.add_argument("--max-queue-delay-s", type=float, default=3.0, help="the router's bound")
    parser.add_argument("--out", type=Path, default=Path("burst-admission.json"))
    args = parser.parse_args(argv)

    from services.common.ports import free_port
    from services.launcher import Stack, StackConfig, describe_engines

    work = Path(tempfile.mkdtemp(prefix="burst-admission-"))
    config = StackConfig(
        model=args.model or None, port=free_port(), engine_args=("--device", args.device),
        router_args=("--max-queue-delay-s", str(args.max_queue_delay_s), "--log-level",
                     "WARNING"),
        log_dir=work / "logs", startup_timeout_s=400.0,
    )  # fmt: skip
    stack = Stack(config).start()
    try:
        target = stack.router_address
        engines = describe_engines(stack.engine_addresses)
        warm = ("--rate", "4", "--num-requests", "20", "--input-mean", "128", "--output-mean", "32")
        bench(target, work / "warm.json", *warm)
        burst = bench(
            target, work / "burst.json", "--rate", str(args.rate), "--num-requests",
            str(args.requests), "--input-mean", "512", "--input-stdev", "256",
            "--output-mean", "128", "--seed", "7",
        )  # fmt: skip
    finally:
        stack.stop()
    details, summary = burst["details"], burst["summary"]
    ttft = summary["ttft_ms"]
    report = {
        "device": f"{cpu_name()} (engine on {args.device})",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(
            ["python", "-m", "benchmarks.burst_admission", *(argv or sys.argv[1:])]
        ),
        "engines": engines,
        "max_queue_delay_s": args.max_queue_delay_s,
        "requests": details["num_requests"],
        "admitted_completed": details["completed"],
        "errors": details["errors"],
        "admitted_ttft_ms": {key: ttft.get(key) for key in ("mean", "p50", "p90", "p99")},
    }
    print(json.dumps({k: v for k, v in report.items() if k != "engines"}), flush=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
