"""GPU engine benchmark: correctness and speed of the CUDA fast path in one run.

For each dummy shape (random bf16 weights of the real model's shape): checks the fast path's
logits against a float32 plain-PyTorch reference and transformers' bf16 model on the same
weights (relative error), then measures the device's copy-bandwidth and bf16-matmul ceilings,
the bs=1 decode step at contexts 128 and 2048, decode tokens/s per batch size, prefill tokens/s
on 8k-token batches, and transformers' generate at bs=1. Writes a JSON report after every stage
so a cut-off run still leaves its numbers. `python -m benchmarks.gpu_bench --help`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

HEADLINE_SHAPE = "llama-3-8b"
DEFAULT_OUTPUT = Path("benchmarks/results/engine-h100.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", default="llama-3-8b,llama-3.2-1b", help="dummy shapes")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON report")
    parser.add_argument("--copy-to", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--batches", default="16,64,128,256,384,512", help="decode batch sizes")
    parser.add_argument("--decode-context", type=int, default=512, help="context for tok/s")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed steps per batch")
    parser.add_argument("--device", default="cuda", help="only cuda is supported")
    args, ignored = parser.parse_known_args(argv)
    if ignored:  # options of engine_bench's CPU mode, which hands --device cuda over to us
        print(f"gpu_bench: ignoring options {ignored}", file=sys.stderr)

    import torch

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        print("gpu_bench needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks import gpu_bench_model

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.gpu_bench " + " ".join(argv or sys.argv[1:]),
        "software": {"python": platform.python_version(), "torch": torch.__version__},
        "models": {},
    }
    try:
        import transformers
        import triton

        report["software"].update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError as error:
        report["software"]["import_error"] = str(error)

    def save() -> None:
        _headline(report)
        text = json.dumps(report, indent=2, sort_keys=False)
        for path in filter(None, (args.output, args.copy_to)):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")

    report["ceilings"] = gpu_bench_model.measure_ceilings()
    print("ceilings", report["ceilings"], flush=True)
    save()
    batches = [int(size) for size in args.batches.split(",") if size]
    for shape in [name for name in args.models.split(",") if name]:
        started = time.perf_counter()
        entry: dict[str, Any] = {}
        report["models"][shape] = entry
        try:
            gpu_bench_model.bench_shape(
                shape, entry, report["ceilings"], batches, args.decode_context,
                args.decode_steps, save,
            )  # fmt: skip
        except Exception as error:  # keep the other shape's numbers; say what broke
            import traceback

            entry["error"] = "".join(traceback.format_exception(error))[-4000:]
            print(entry["error"], file=sys.stderr, flush=True)
        entry["wall_s"] = round(time.perf_counter() - started, 1)
        save()
        torch.cuda.empty_cache()
    save()
    _print_table(report)
    return 0


def _headline(report: dict[str, Any]) -> None:
    """The report's headline keys at the top level, taken from the Llama-3-8B entry."""
    entry = report["models"].get(HEADLINE_SHAPE, {})
    keys = {
        "decode_bs1_ms": "decode_bs1_ms",
        "decode_bs1_floor_ratio": "decode_bs1_floor_ratio",
        "decode_bs1_floor_ratio_read_bytes": "decode_bs1_floor_ratio_read_bytes",
        "decode_tok_s_bs64": "decode_tok_s_bs64",
        "decode_tok_s_best": "decode_tok_s_best",
        "prefill_tok_s": "prefill_tok_s",
        "prefill_matmul_fraction": "prefill_matmul_fraction",
        "speedup_vs_transformers_bs1": "speedup_vs_transformers_bs1",
    }
    for key, source in keys.items():
        report[key] = entry.get(source)
    report["headline_model"] = f"dummy:{HEADLINE_SHAPE}"


def _print_table(report: dict[str, Any]) -> None:
    print(f"device: {report['device']}  ceilings: {report.get('ceilings')}")
    columns = [
        "max_rel_error_vs_fp32", "decode_bs1_ms", "decode_bs1_ctx2048_ms", "decode_bs1_floor_ms",
        "decode_bs1_floor_ratio", "decode_bs1_floor_ratio_read_bytes", "decode_tok_s_bs16",
        "decode_tok_s_bs64", "decode_tok_s_bs256",
        "decode_tok_s_best", "decode_best_batch", "prefill_tok_s", "prefill_matmul_fraction",
        "transformers_bs1_ms", "speedup_vs_transformers_bs1",
    ]  # fmt: skip
    for shape, entry in report["models"].items():
        print(f"== {shape}")
        for column in columns:
            print(f"  {column:32s} {entry.get(column)}")
        if "error" in entry:
            print("  ERROR", entry["error"][-600:])


if __name__ == "__main__":
    raise SystemExit(main())
