"""How long a burst of adapters not in memory takes to load, by loader threads.

    python -m benchmarks.lora_load_bench --out lora-load.json     # CPU or GPU machine

Writes `--adapters` random rank-`--rank` PEFT adapters on all seven projections of `--model`'s
shapes (`dummy:llama-3-8b`: 84 MB each in bf16), registers them with an engine's LoRA parts
(`EngineAdapters`, the engine's own manager and loader: read, SHA-256 verified, checked, laid
out; pinned for a GPU), then asks for all of them at once, as a burst of requests for cold
adapters does, and times until every one is in host memory. Each `--workers` count
(`--lora-load-workers`) runs in turn, `--repeats` times, on fresh LoRA parts; the files stay in
the page cache after the first read, so the figures are the loaders' CPU work, not the disk.
The report gives the median seconds per setting and its ratio to the first (the baseline, one
thread by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.faults import cpu_name
from benchmarks.lora_stack_adapters import model_config_of, write_adapters
from services.engine.lora.config import LoRAConfig
from services.engine.lora.engine_adapters import EngineAdapters
from services.engine.lora.loader import inspect_adapter


def load_burst(
    records: list, root: Path, model_config: Any, *, workers: int, device: str, rank: int
) -> float:
    """Seconds from asking for every adapter at once until all are in host memory."""
    config = LoRAConfig(
        max_loras=1,
        max_cpu_loras=len(records),
        max_lora_rank=rank,
        adapter_root=str(root),
        load_workers=workers,
    )
    done = threading.Event()
    adapters = EngineAdapters(
        config, model_config, dtype=torch.bfloat16, device=device, on_load_done=done.set
    )
    manager = adapters.manager
    try:
        for record in records:
            adapters.register(record)
        started = time.perf_counter()
        for record in records:
            manager.hold(record.name)
        while True:
            done.clear()
            failures = manager.poll()
            if failures:
                raise RuntimeError(f"adapter load failed: {failures[0][1]}")
            if manager.num_loading == 0:
                return time.perf_counter() - started
            done.wait(1.0)
    finally:
        adapters.shutdown()


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    model_config = model_config_of(args.model)
    with tempfile.TemporaryDirectory(prefix="lora-load-") as directory:
        root = Path(directory)
        written = write_adapters(root, args.model, args.adapters, args.rank, progress=print)
        records = [
            inspect_adapter(
                name, name, adapter_root=root, model_config=model_config, max_rank=args.rank
            )
            for name in written["names"]
        ]
        seconds: dict[int, list[float]] = {workers: [] for workers in args.workers}
        for repeat in range(args.repeats):
            for workers in args.workers:
                elapsed = load_burst(
                    records, root, model_config, workers=workers, device=device, rank=args.rank
                )
                seconds[workers].append(round(elapsed, 3))
                print(f"repeat {repeat + 1}: {workers} loader threads: {elapsed:.2f}s")
    baseline = statistics.median(seconds[args.workers[0]])
    rows = []
    for workers in args.workers:
        median = statistics.median(seconds[workers])
        rows.append(
            {
                "workers": workers,
                "seconds": seconds[workers],
                "median_s": round(median, 3),
                "per_adapter_ms": round(1000 * median / args.adapters, 1),
                "over_baseline": round(median / baseline, 3),
            }
        )
    if device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = cpu_name()
    return {
        "device": device_name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.lora_load_bench " + " ".join(args.argv),
        "model": args.model,
        "adapters": args.adapters,
        "rank": args.rank,
        "bytes_each": written["bytes_each"],
        "torch_threads": torch.get_num_threads(),
        "results": rows,
    }


def _counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of counts: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_load_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="dummy:llama-3-8b", help="shapes of the adapters")
    parser.add_argument("--adapters", type=int, default=16, help="adapters in the burst")
    parser.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    parser.add_argument(
        "--workers",
        type=_counts,
        default=[1, 2, 4],
        help="comma-separated loader thread counts; the first is the baseline",
    )
    parser.add_argument("--repeats", type=int, default=3, help="bursts per setting, in turn")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the slots live (cuda: the host copies are pinned, as an engine's are)",
    )
    parser.add_argument("--out", type=Path, help="write the report here as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.adapters < 1 or args.repeats < 1 or min(args.workers) < 1:
        parser.error("--adapters, --repeats and every --workers must be >= 1")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    report = run(args)
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    for row in report["results"]:
        print(
            f"{row['workers']} loader threads: {row['median_s']:.2f}s for {args.adapters} "
            f"adapters ({row['per_adapter_ms']:.0f} ms each), {row['over_baseline']:.2f}x "
            "the baseline"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
