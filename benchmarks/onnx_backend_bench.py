"""The onnxruntime forward backend against torch on the CPU: decode step time and prefill rate.

Builds one model runner per backend on the same model, dtype and thread count, in one process,
and times `execute_greedy` on hand-built steps (no scheduler, no sampling): a decode step of
`--batch` sequences at `--context` cached tokens each, and a prefill of `--prefill-tokens`
prompt tokens in one chunk. Steps alternate between the backends, so a busy neighbour on a
shared machine slows both alike; each figure is the median of `--repeats` steps after warm-up.
Prints the device, the date, the command, each backend's figures and their ratio as JSON.

    python -m benchmarks.onnx_backend_bench --batch 8 --context 128 --prefill-tokens 256
    python -m benchmarks.onnx_backend_bench --device cuda --model dummy:llama-3.2-1b \
        --dtype bfloat16 --batch 32

On CUDA, "torch" is the fast path (Triton kernels, decode CUDA graphs) and "onnxruntime" needs
its CUDA execution provider (onnxruntime-gpu); the report lists the providers installed and the
error of a backend that could not start. `decode_batchful_segments_ms` is the segment graphs of
one decode step alone, without the attention between them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.engine_bench import cpu_name
from services.common.model_files import ModelFiles, resolve_model
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence

BACKENDS = ("torch", "onnxruntime")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.onnx_backend_bench", description=__doc__
    )
    parser.add_argument("--model", default="", help='model ("" = the default SmolLM2-135M)')
    parser.add_argument("--dtype", default="float32", help="model dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=1 << 30, help="KV cache of each runner"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per decode step")
    parser.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    parser.add_argument("--prefill-tokens", type=int, default=256, help="tokens of the prefill")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per figure")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated (default: both)"
    )
    return parser


def decode_batch(batch: int, context: int, block_size: int) -> ScheduledBatch:
    """`batch` sequences decoding one token after `context` cached ones, disjoint blocks."""
    blocks = -(-(context + 1) // block_size)
    return ScheduledBatch(
        [
            ScheduledSequence(
                seq_id=index,
                token_ids=[100 + index],
                start_position=context,
                block_table=list(range(index * blocks, (index + 1) * blocks)),
                needs_logits=True,
            )
            for index in range(batch)
        ]
    )


def prefill_batch(tokens: int, block_size: int) -> ScheduledBatch:
    blocks = -(-tokens // block_size)
    ids = [(7 * index) % 1000 + 10 for index in range(tokens)]
    return ScheduledBatch([ScheduledSequence(0, ids, 0, list(range(blocks)), True)])


def median_s(runner: Any, batch: ScheduledBatch, repeats: int) -> float:
    runner.execute_greedy(batch)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.execute_greedy(batch)
        _synchronize(runner.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def batchful_ms(runner: Any, rows: int, repeats: int) -> float:
    """Median time of all of one step's segment graphs (no attention) at `rows` tokens."""
    from services.engine.backends import segments

    config = runner.model_config
    calls = []
    for spec in segments.SEGMENTS:
        count = rows if spec.kind != segments.HEAD.kind else min(rows, runner.max_num_seqs)
        inputs = segments.segment_inputs(
            config, spec.kind, count, dtype=runner.dtype, device=runner.device
        )
        layers = config.num_layers if spec.per_layer else 1
        calls += [(spec.kind, layer, inputs) for layer in range(layers)]
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for kind, layer, inputs in calls:
            runner.segments.run(kind, layer, inputs)
        _synchronize(runner.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


def _synchronize(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def model_files(model: str) -> ModelFiles:
    """The model's files; a dummy shape needs no tokenizer here (none is run)."""
    if model.startswith("dummy:"):
        shape = model.removeprefix("dummy:")
        return ModelFiles(name=model, weights_dir=None, tokenizer_dir=Path("."), dummy_shape=shape)
    return resolve_model(model or None)


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"GPU: {torch.cuda.get_device_name(device)}"
    return f"CPU: {cpu_name()}, {torch.get_num_threads()} torch threads"


def run(args: argparse.Namespace) -> dict:
    import onnxruntime
    import torch

    from services.common.errors import SluiceError
    from services.engine.config import EngineConfig
    from services.engine.runner_factory import create_model_runner

    files = model_files(args.model)
    runners = {}
    errors = {}
    backends = args.backends.split(",")
    for backend in backends:
        config = EngineConfig(
            model=args.model or None,
            backend=backend,
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=max(256, args.batch),
            max_num_batched_tokens=max(2048, args.prefill_tokens),
        )
        try:
            runners[backend] = create_model_runner(config, files)
        except SluiceError as exc:
            errors[backend] = str(exc)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    figures: dict[str, dict[str, list[float]]] = {backend: {} for backend in runners}
    if runners:
        block_size = next(iter(runners.values())).block_size
        decode = decode_batch(args.batch, args.context, block_size)
        prefill = prefill_batch(args.prefill_tokens, block_size)
        fill = prefill_batch(args.batch * (args.context + block_size), block_size)
        for runner in runners.values():  # fill the cache the decodes read
            runner.execute_greedy(fill)
    for _ in range(3):  # alternate, so that noise hits both backends
        for backend, runner in runners.items():
            step_s = median_s(runner, decode, args.repeats)
            prefill_s = median_s(runner, prefill, max(3, args.repeats // 3))
            figures[backend].setdefault("decode_step_ms", []).append(step_s * 1e3)
            figures[backend].setdefault("prefill_tokens_per_s", []).append(
                args.prefill_tokens / prefill_s
            )
            if getattr(runner, "segments", None) is not None:
                figures[backend].setdefault("decode_batchful_segments_ms", []).append(
                    batchful_ms(runner, args.batch, args.repeats)
                )
    result = {
        backend: {name: round(statistics.median(values), 3) for name, values in named.items()}
        for backend, named in figures.items()
    }
    summary = {
        "device": device_name(args.device),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.onnx_backend_bench " + " ".join(sys.argv[1:]),
        "model": files.name,
        "dtype": args.dtype,
        "batch": args.batch,
        "context": args.context,
        "prefill_tokens": args.prefill_tokens,
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime_providers": onnxruntime.get_available_providers(),
        "backends": result,
        "errors": errors,
    }
    if set(BACKENDS) <= set(result):
        torch_figures, onnx_figures = result["torch"], result["onnxruntime"]
        summary["decode_step_ratio_onnxruntime_over_torch"] = round(
            onnx_figures["decode_step_ms"] / torch_figures["decode_step_ms"], 3
        )
        summary["prefill_rate_ratio_onnxruntime_over_torch"] = round(
            onnx_figures["prefill_tokens_per_s"] / torch_figures["prefill_tokens_per_s"], 3
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
