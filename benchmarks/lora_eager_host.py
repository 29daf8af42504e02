"""Host and device time of one eager step with prompt tokens, with and without adapters.

    python -m benchmarks.lora_eager_host --out lora-eager-host.json      # on an NVIDIA GPU

Under a Poisson load of many adapters the steps that carry prompt tokens run eagerly (no CUDA
graph), and their launches can outlast the device's work: the engine waits on its own host.
This builds the CUDA runner on `dummy:llama-3-8b` (bf16, random weights) and times one such
step, shaped as that load's average step (two prompt chunks of 463 tokens and 114 decode rows
over a 600-token context), in three cases: the runner before the LoRA runtime is bound, the
bound runtime with every row on the base model, and the rows on 16 random rank-16 adapters
(all seven projections; each prompt on an adapter of its own, the decode rows over all 16).
For each, in interleaved rounds (medians):

- host: from the step's `begin_step` to the return of `launch_greedy`, the device idle at the
  start (nothing queued ahead to wait for), i.e. the launching thread's own time;
- host with the device busy: the same, launched while a long sleep kernel runs (as the engine
  plans a step while the last one runs): above the first where a launch waits on the device;
- device: the same step queued behind that sleep, so every launch is in before the device
  starts: `PendingIds.device_time_s`, the device's time alone.

With `--py-spy DIR` (py-spy on PATH or beside the interpreter) each case's launches also run
under a py-spy sampler for `--spy-seconds`, and the report lists the functions holding the most
samples (own and inclusive): where the host's time goes, without a tracing profiler's cost per
call. The raw stacks go to DIR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import py_spy
from benchmarks.lora_bench import (
    BLOCK_SIZE,
    RANK,
    Blocks,
    decode_batch,
    prefill_batch,
    random_adapter,
    with_slots,
)
from services.common.model_files import ModelFiles
from services.engine.forward_batch import ScheduledBatch
from services.engine.lora.config import LoRAConfig
from services.engine.lora.engine_adapters import EngineAdapters

SLOTS = 16
PROMPTS, PROMPT_TOKENS, DECODES, CONTEXT = 2, 463, 114, 600
SLEEP_CYCLES = 400_000_000  # ~0.2 s at 2 GHz: longer than any step's launches


def served_step(blocks: Blocks, vocab: int) -> ScheduledBatch:
    """Decode rows first, then the prompt chunks (the scheduler's order)."""
    decodes = decode_batch(blocks, DECODES, CONTEXT, vocab).sequences
    prompts = prefill_batch(blocks, PROMPTS, PROMPT_TOKENS, vocab).sequences
    return ScheduledBatch(decodes + prompts)


def adapter_rows(batch: ScheduledBatch) -> list[int]:
    """Each decode row on slot row % 16; each prompt on a slot of its own."""
    slots, prompt = [], 0
    for row, seq in enumerate(batch.sequences):
        if len(seq.token_ids) == 1:
            slots.append(row % SLOTS)
        else:
            slots.append(prompt % SLOTS)
            prompt += 1
    return slots


class Case:
    """One step of one case: its host launch, and its device time behind a sleep kernel."""

    def __init__(self, runner: Any, adapters: EngineAdapters | None, batch: ScheduledBatch):
        self.runner = runner
        self.adapters = adapters
        self.batch = batch

    def launch(self) -> Any:
        if self.adapters is not None:
            self.adapters.begin_step(self.batch)
        return self.runner.launch_greedy(self.batch)

    def host_ms(self, *, device_busy: bool = False) -> float:
        """The launch's host time, the device idle at its start or (`device_busy`) still
        running a sleep kernel, as when the engine plans a step while the last one runs:
        above the idle figure where a launch waits on the device."""
        torch.cuda.synchronize()
        if device_busy:
            torch.cuda._sleep(SLEEP_CYCLES)
        started = time.perf_counter()
        pending = self.launch()
        elapsed = time.perf_counter() - started
        pending.result()
        return elapsed * 1000.0

    def host_busy_ms(self) -> float:
        return self.host_ms(device_busy=True)

    def device_ms(self) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        pending = self.launch()
        pending.result()
        return pending.device_time_s() * 1000.0


def sample(case: Case, seconds: float, raw_path: Path, top: int) -> dict[str, Any] | str:
    """Run `case`'s launches (each step waited for) under py-spy for `seconds`; the functions
    with the most samples inside the launches, or why there are none."""
    sampler = py_spy.Sampler(raw_path)
    if not sampler.start():
        return sampler.error or "py-spy did not start"
    steps = 0
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            case.launch().result()
            steps += 1
    finally:
        sampler.stop()
    if sampler.error:
        return sampler.error
    return {"steps": steps, **py_spy.summarize(raw_path, LAUNCH_FRAME, top)}


LAUNCH_FRAME = "Case.launch (benchmarks/lora_eager_host.py)"


def median_rounds(cases: dict[str, Case], measure: Callable[[Case], float], steps: int,
                  rounds: int) -> dict[str, float]:  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            measure(case)  # warm: a first launch after another case's
            samples[name].extend(measure(case) for _ in range(steps))
    return {name: round(statistics.median(values), 2) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3-8b", help="dummy shape")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--py-spy", type=Path, default=None, help="raw stacks here (optional)")
    parser.add_argument("--spy-seconds", type=float, default=6.0)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs an NVIDIA GPU")
    from services.engine.cuda_runner import CudaModelRunner

    files = ModelFiles(
        name=f"dummy:{args.shape}", weights_dir=None, tokenizer_dir=Path("."),
        dummy_shape=args.shape,
    )  # fmt: skip
    runner = CudaModelRunner(
        files, device="cuda", dtype=torch.bfloat16, max_num_seqs=256,
        kv_cache_bytes=16 << 30, block_size=BLOCK_SIZE, lora_fold_rank=RANK,
    )  # fmt: skip
    config = runner.model_config
    batch = served_step(Blocks(runner.num_blocks), config.vocab_size)
    unbound = Case(runner, None, batch)
    unbound_host = median_rounds({"unbound": unbound}, Case.host_ms, args.steps, args.rounds)
    unbound_device = median_rounds({"unbound": unbound}, Case.device_ms, args.steps, args.rounds)
    unbound_busy = median_rounds({"unbound": unbound}, Case.host_busy_ms, 3, args.rounds)
    spies: dict[str, Any] = {}
    if args.py_spy is not None:
        spies["unbound"] = sample(unbound, args.spy_seconds, args.py_spy / "unbound.txt", args.top)

    lora_config = LoRAConfig(
        max_loras=SLOTS, max_cpu_loras=SLOTS, max_lora_rank=RANK, adapter_root="/nonexistent"
    )
    adapters = EngineAdapters(
        lora_config, config, dtype=runner.dtype, device=torch.device("cuda"),
        kernels=runner.lora_kernels, max_rows=8192,
    )  # fmt: skip
    runner.bind_lora(adapters)
    for slot in range(SLOTS):
        adapters.slots.write(slot, random_adapter(adapters, f"r{slot}", seed=slot, device="cuda"))
    torch.cuda.synchronize()
    rows = len(batch.sequences)
    cases = {
        "base_rows": Case(runner, adapters, with_slots(batch, [-1] * rows)),
        "adapters_16": Case(runner, adapters, with_slots(batch, adapter_rows(batch))),
    }
    host = {**unbound_host, **median_rounds(cases, Case.host_ms, args.steps, args.rounds)}
    device = {**unbound_device, **median_rounds(cases, Case.device_ms, args.steps, args.rounds)}
    busy = {**unbound_busy, **median_rounds(cases, Case.host_busy_ms, 3, args.rounds)}
    if args.py_spy is not None:
        for name in ("base_rows", "adapters_16"):
            spies[name] = sample(
                cases[name], args.spy_seconds, args.py_spy / f"{name}.txt", args.top
            )
    report = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m benchmarks.lora_eager_host " + " ".join(argv or sys.argv[1:]),
        "model": files.name,
        "step": {
            "prompt_chunks": PROMPTS,
            "prompt_tokens_each": PROMPT_TOKENS,
            "decode_rows": DECODES,
            "decode_context": CONTEXT,
            "adapters": SLOTS,
            "rank": RANK,
        },  # fmt: skip
        "host_ms": host,
        "host_ms_device_busy": busy,
        "device_ms": device,
        "host_over_device": {name: round(host[name] / device[name], 3) for name in host},
        "adapters_over_unbound": {
            "host": round(host["adapters_16"] / host["unbound"], 3),
            "device": round(device["adapters_16"] / device["unbound"], 3),
        },
        "py_spy": spies,
    }
    text = json.dumps(report, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
