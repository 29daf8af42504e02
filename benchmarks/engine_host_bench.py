"""The engine's host work per step under a multi-LoRA load, with no model work at all.

A GPU engine keeps its device busy only while the host plans each step before the device ends
the one before it (services/engine/overlap.py). This drives an LLMEngine over `HostOnlyRunner`,
a runner that declares what the CUDA fast path does (`overlap_mixed` launches: steps planned
ahead across admissions, slot turns and chunked prefills) but computes nothing, and over the
real LoRA slot bookkeeping (AdapterManager and AdapterGate; slot writes land one step after
they are issued, loads at once). The manager's clock advances `--step-ms` per launch, as if
each step took that long on the device, so slot turns come as often per step as on the GPU.

`--in-flight` greedy requests (`--prompt-len` prompt tokens, `--max-tokens` output tokens, EOS
ignored) are kept live, each on one of `--adapters` adapters drawn Zipf (`--zipf-s`), refilled
as they finish. After `--warmup-steps` steps, `--steps` steps are measured; it prints, as JSON:

- `host_ms_per_step`: the engine's own time per `step()` (all of it: nothing is modelled);
- `planned_ahead_share`: the share of steps launched before the previous step's tokens were
  read, and `plain_steps_by_reason`: why each other step waited (where the engine counts it);
- running, paused and waiting sequences, slot writes and pauses per simulated second;
- `server_ms_per_step`: the engine server's conversion of each step's deltas (coalesced at
  `--pacing-tokens` tokens per update, services/engine/coalesce.py) into the session's
  `EngineStep` and its serialization, on the same thread here (the server's asyncio thread
  shares the GIL with the engine's).

`--profile FILE` writes a cProfile of the measured steps (engine and server side). `gc`: the
garbage collector's collections over the measured steps, their time per step and the longest;
the start-up heap is frozen first, as the engine server freezes it (`--no-gc-freeze`: not).

    python -m benchmarks.engine_host_bench --steps 400
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future
from types import SimpleNamespace
from typing import Any

import numpy as np

from loadtest.datasets import choose_adapters
from services.common.heap import freeze_startup_heap
from services.common.protocol.adapter_record import AdapterRecord
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine_loop import LoopOutput
from services.engine.forward_batch import ScheduledBatch
from services.engine.llm_engine import LLMEngine
from services.engine.lora.batch import LoRABatch
from services.engine.lora.config import LoRAConfig
from services.engine.lora.engine_adapters import EngineAdapters
from services.engine.lora.gate import AdapterGate
from services.engine.lora.manager import AdapterManager
from services.engine.model_runner import RunnerCapabilities
from services.engine.server import EngineServicer, _Session

SESSION = "s1"


class HostOnlyRunner:
    """A model runner that launches steps as the CUDA fast path does and computes nothing:
    each sampled row's id is a fixed function of its sequence (never an EOS: there is none).
    `on_launch(batch)`, if given, sees each step as it is launched (a modelled device clock, a
    step's price)."""

    capabilities = RunnerCapabilities(greedy_ids=True, overlap_max_batch=1024, overlap_mixed=True)

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        on_launch: Callable[[ScheduledBatch], None] | None = None,
    ) -> None:
        self.model_config = SimpleNamespace(
            vocab_size=32_000, max_model_len=max_model_len, eos_token_ids=(), name="host-only"
        )
        self.model_files = None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = "cpu"
        self.dtype = "bfloat16"
        self.execution_path = "host only"
        self.launches = 0
        self._on_launch = on_launch

    def launch_greedy(self, batch: ScheduledBatch) -> SimpleNamespace:
        if self._on_launch is not None:
            self._on_launch(batch)
        self.launches += 1
        ids = [100 + seq.seq_id % 1000 for seq in batch.sequences if seq.needs_logits]
        return SimpleNamespace(result=lambda: ids)

    def execute_greedy(self, batch: ScheduledBatch) -> list[int]:
        raise AssertionError("every step of this benchmark is launched")

    def execute(self, batch: ScheduledBatch) -> Any:
        raise AssertionError("every step of this benchmark samples greedy")


class _AtOnce(Executor):
    """Runs each adapter load when it is submitted (the weights are a placeholder)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


class _SlotWrite:
    """A slot copy that lands once the runner has launched one more step."""

    def __init__(self, runner: HostOnlyRunner) -> None:
        self._runner = runner
        self._lands_at = runner.launches + 1

    def done(self) -> bool:
        return self._runner.launches >= self._lands_at

    def wait(self) -> None:
        self._lands_at = 0


class HostOnlyAdapters(EngineAdapters):
    """EngineAdapters over the real manager and gate, with no slot memory and no runtime."""

    def __init__(self, config: LoRAConfig, runner: HostOnlyRunner, clock: Any) -> None:
        self.config = config
        self.manager = AdapterManager(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            load=lambda record: record.name,
            write_slot=lambda slot, weights: _SlotWrite(runner),
            executor=_AtOnce(),
            clock=clock,
        )
        self.gate = AdapterGate(self.manager, slot_quantum_s=config.slot_quantum_ms / 1000.0)

    def begin_step(self, batch: ScheduledBatch) -> None:
        LoRABatch.from_scheduled(batch)  # the engine-side layout work of a real step


def build_engine(args: argparse.Namespace) -> tuple[LLMEngine, HostOnlyRunner, list[float]]:
    """The engine, its runner and the simulated device clock (seconds, one-item list)."""
    clock = [0.0]

    def tick(_: ScheduledBatch) -> None:
        clock[0] += args.step_ms / 1000.0

    runner = HostOnlyRunner(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        on_launch=tick,
    )

    class Engine(LLMEngine):
        def _build_adapters(self, lora_config: LoRAConfig, config: Any, _: Any) -> Any:
            return HostOnlyAdapters(lora_config, runner, lambda: clock[0])

    config = EngineConfig(
        model="host-only",
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        adapter_root="/nonexistent",  # LoRA on; the adapters above never read it
        max_loras=args.max_loras,
        max_cpu_loras=max(args.adapters, args.max_loras),
        lora_slot_quantum_ms=args.slot_quantum_ms,
        stats_log_interval_s=0,
    )
    return Engine(config, model_runner=runner), runner, clock


class ServerSide:
    """The engine server's per-step conversion for one session holding every request."""

    def __init__(self, pacing_tokens: int) -> None:
        self.servicer = EngineServicer()
        self.session = _Session(SESSION)
        self.session.coalescer.set_pacing(pacing_tokens, 250)
        self.servicer._sessions[SESSION] = self.session
        self.bytes = 0

    def submit(self, request_id: str) -> None:
        self.session.live.add(request_id)
        self.session.coalescer.allow(request_id)

    def dispatch(self, output: Any, step_index: int) -> None:
        self.servicer._dispatch(
            LoopOutput(output.deltas, [], output.load, step_index, output.step_time_s)
        )
        outbox = self.session.outbox
        while not outbox.empty():
            message = outbox.get_nowait()
            if message is not None:
                self.bytes += len(message.SerializeToString())


class GcPauses:
    """A gc callback: the garbage collector's pauses while it is installed."""

    def __init__(self) -> None:
        self.pauses_s: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses_s.append(time.perf_counter() - self._started)

    def summary(self, steps: int) -> dict[str, float]:
        pauses = self.pauses_s
        return {
            "collections": len(pauses),
            "ms_per_step": round(sum(pauses) * 1e3 / max(steps, 1), 3),
            "longest_ms": round(max(pauses, default=0.0) * 1e3, 2),
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine, runner, clock = build_engine(args)
    names = [f"adapter-{index}" for index in range(args.adapters)]
    for name in names:
        engine.register_adapter(
            AdapterRecord(name=name, path=name, sha256=f"{len(name):064x}", rank=16)
        )
    total = args.in_flight + 4 * args.in_flight  # enough draws for the whole run
    drawn = choose_adapters(np.random.default_rng(4), names, "zipf", args.zipf_s, total)
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    server = ServerSide(args.pacing_tokens)
    if not args.no_gc_freeze:  # as the engine server does before it serves
        freeze_startup_heap()
    counter = 0

    def submit() -> None:
        nonlocal counter
        request_id = f"r{counter}"
        prompt = rng.integers(1000, 30_000, size=args.prompt_len).tolist()
        adapter = drawn[counter % len(drawn)] or None
        engine.add_request(f"{SESSION}/{request_id}", prompt, params, adapter=adapter)
        server.submit(request_id)
        counter += 1

    def one_step(index: int) -> tuple[float, float, int]:
        started = time.perf_counter()
        output = engine.step()
        stepped = time.perf_counter()
        server.dispatch(output, index)
        finished = 0
        for delta in output.deltas:
            if delta.finished:
                finished += 1
                submit()
        return stepped - started, time.perf_counter() - stepped, finished

    for _ in range(args.in_flight):
        submit()
    for index in range(args.warmup_steps):
        one_step(index)

    scheduler, manager = engine.scheduler, engine.adapters.manager
    overlapped0, writes0, pauses0 = (
        engine.num_overlapped_steps,
        manager.num_slot_writes,
        scheduler.num_pauses,
    )
    reasons0 = Counter(getattr(engine, "plain_step_reasons", {}))
    clock0, launches0, bytes0 = clock[0], runner.launches, server.bytes
    engine_s = server_s = 0.0
    finished = 0
    running = paused = waiting = 0
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    collections = GcPauses()
    gc.callbacks.append(collections)
    for index in range(args.steps):
        step_s, dispatch_s, done = one_step(args.warmup_steps + index)
        engine_s += step_s
        server_s += dispatch_s
        finished += done
        running += len(scheduler.running)
        paused += len(scheduler.paused)
        waiting += scheduler.num_waiting
    gc.callbacks.remove(collections)
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    steps = args.steps
    launches = runner.launches - launches0
    simulated_s = max(clock[0] - clock0, 1e-9)
    result: dict[str, Any] = {
        "steps": steps,
        "launches": launches,
        "host_ms_per_step": round(1e3 * engine_s / steps, 3),
        "server_ms_per_step": round(1e3 * server_s / steps, 3),
        "planned_ahead_share": round((engine.num_overlapped_steps - overlapped0) / steps, 3),
        "mean_running": round(running / steps, 1),
        "mean_paused": round(paused / steps, 1),
        "mean_waiting": round(waiting / steps, 1),
        "finished": finished,
        "slot_writes_per_s": round((manager.num_slot_writes - writes0) / simulated_s, 1),
        "pauses_per_s": round((scheduler.num_pauses - pauses0) / simulated_s, 1),
        "server_bytes_per_step": round((server.bytes - bytes0) / steps),
        "preemptions": scheduler.num_preemptions,
        "gc": collections.summary(steps),
    }
    if hasattr(engine, "plain_step_reasons"):
        reasons = Counter(engine.plain_step_reasons)
        reasons.subtract(reasons0)
        result["plain_steps_by_reason"] = {key: count for key, count in reasons.items() if count}
    engine.shutdown()
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_host_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--adapters", type=int, default=100, help="adapters the requests are drawn over")
    add("--zipf-s", type=float, default=1.0, help="Zipf exponent of the adapter draw")
    add("--max-loras", type=int, default=16, help="LoRA device slots")
    add("--slot-quantum-ms", type=float, default=100.0, help="slot time-slice (simulated ms)")
    add("--in-flight", type=int, default=600, help="live requests, refilled as they finish")
    add("--prompt-len", type=int, default=512, help="prompt tokens per request")
    add("--max-tokens", type=int, default=256, help="output tokens per request")
    add("--max-num-seqs", type=int, default=256, help="running-batch cap")
    add("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    add("--block-size", type=int, default=16, help="KV block size, tokens")
    add("--num-blocks", type=int, default=60_000, help="KV blocks")
    add("--step-ms", type=float, default=27.0, help="simulated device time per step")
    add("--pacing-tokens", type=int, default=8, help="tokens per update the router asks for")
    add("--warmup-steps", type=int, default=300, help="steps before measuring")
    add("--steps", type=int, default=600, help="steps measured")
    add("--profile", default=None, help="write a cProfile of the measured steps here")
    add(
        "--no-gc-freeze",
        action="store_true",
        help="leave the start-up heap to the garbage collector (the engine server freezes it)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    print(json.dumps(run(build_parser().parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
