"""The engine's scheduling under an open multi-LoRA load, on a modelled GPU clock.

What sets a LoRA stack's output and tail latency under a skewed adapter mix is mostly
scheduling: which adapters hold the device slots, how long sequences stay paused for a slot
turn (holding their KV blocks), what waits for blocks. This drives the real `LLMEngine`
(scheduler, block manager, AdapterManager and AdapterGate, steps planned ahead as on the CUDA
fast path) over `HostOnlyRunner` (benchmarks/engine_host_bench.py), which computes nothing;
each launched step advances a simulated clock by a modelled step time:

    fixed_ms + decode rows × row_us + decode context tokens × kv_token_us
    + prompt tokens × prompt_us, times lora_factor when the step runs adapters,
    plus lora_adapter_ms × its distinct adapters (their weights read)

and a step with prompt tokens at least `--eager-host-ms` (`--eager-host-ms-lora` with adapters):
such a step runs without a CUDA graph, and the host's kernel launches can outlast the device's
work (a decode step replays a graph: its host time is not modelled)

(defaults fitted to `dummy:llama-3-8b` bf16 on an H100: BENCHMARKS.md, "Engine steps on a GPU"
and "Multi-LoRA step cost"), and a slot write lands `--write-ms` after it is issued. Requests
arrive Poisson on that clock (`--rate`, or `--rate-fraction` of the saturation rate that a
closed-loop base-model pass finds), go straight to the engine (the router forwards at once
under this load), and each one's first-token and finish times are taken from the step that
produced them. It runs the same arrivals twice, on the base model and on adapters drawn Zipf,
and prints both phases and the ratios `benchmarks.lora_stack` reports (output tokens/s over the
phase to its last finish, p99 TTFT), plus the engine's mean running, paused and waiting
sequences and KV use. The figures are a model's: for comparing scheduling policies and
settings against each other in one run, not for quoting as GPU results.

With `--swap-blocks N` the LoRA phase has N host blocks of swap space for paused sequences'
KV (the real scheduler's moves; each block's copy charged `--swap-us-per-block` to the clock).

    python -m benchmarks.lora_schedule_sim
    python -m benchmarks.lora_schedule_sim --slot-quantum-ms 50 --num-blocks 40000
    python -m benchmarks.lora_schedule_sim --lora-factor 1.4 --swap-blocks 8192
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from benchmarks.engine_host_bench import HostOnlyRunner, _AtOnce
from loadtest.datasets import choose_adapters
from services.common.protocol.adapter_record import AdapterRecord
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.forward_batch import ScheduledBatch
from services.engine.llm_engine import LLMEngine
from services.engine.lora.batch import BASE_SLOT, LoRABatch
from services.engine.lora.config import LoRAConfig
from services.engine.lora.engine_adapters import EngineAdapters
from services.engine.lora.gate import AdapterGate
from services.engine.lora.manager import AdapterManager
from services.engine.swap_space import HostBlocks


class Clock:
    """The simulated device clock, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StepModel:
    """A step's device time from its rows (see the module docstring for the terms)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def seconds(self, batch: ScheduledBatch) -> float:
        args = self.args
        decode_rows = prompt_tokens = context = 0
        adapters: set[int] = set()
        for seq in batch.sequences:
            tokens = len(seq.token_ids)
            if tokens == 1:
                decode_rows += 1
                context += seq.start_position
            else:
                prompt_tokens += tokens
            if seq.adapter_slot != BASE_SLOT:
                adapters.add(seq.adapter_slot)
        ms = (
            args.fixed_ms
            + decode_rows * args.row_us / 1e3
            + context * args.kv_token_us / 1e3
            + prompt_tokens * args.prompt_us / 1e3
        )
        if adapters:
            ms = ms * args.lora_factor + len(adapters) * args.lora_adapter_ms
        if prompt_tokens:  # launched kernel by kernel: the host's launches may take longer
            host_ms = args.eager_host_ms
            if adapters and args.eager_host_ms_lora is not None:
                host_ms = args.eager_host_ms_lora
            ms = max(ms, host_ms)
        return ms / 1e3


class _TimedWrite:
    """A slot copy that lands `seconds` after it was issued, on the simulated clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self._clock = clock
        self._lands_at = clock.now + seconds

    def done(self) -> bool:
        return self._clock.now >= self._lands_at

    def wait(self) -> None:
        self._clock.now = max(self._clock.now, self._lands_at)


class SimAdapters(EngineAdapters):
    """EngineAdapters over the real manager and gate, with timed slot writes and no memory."""

    def __init__(self, config: LoRAConfig, clock: Clock, write_s: float) -> None:
        self.config = config
        self.manager = AdapterManager(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            load=lambda record: record.name,
            write_slot=lambda slot, weights: _TimedWrite(clock, write_s),
            executor=_AtOnce(),
            clock=clock,
        )
        self.gate = AdapterGate(
            self.manager,
            slot_quantum_s=config.slot_quantum_ms / 1000.0,
            first_token_joins=config.first_token_joins,
        )

    def begin_step(self, batch: ScheduledBatch) -> None:
        LoRABatch.from_scheduled(batch)


def build_engine(args: argparse.Namespace, clock: Clock, *, lora: bool) -> LLMEngine:
    model = StepModel(args)

    def advance(batch: ScheduledBatch) -> None:
        clock.now += model.seconds(batch)

    runner = HostOnlyRunner(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        on_launch=advance,
    )

    class Engine(LLMEngine):
        def _build_adapters(self, lora_config: LoRAConfig, config: Any, _: Any) -> Any:
            return SimAdapters(lora_config, clock, args.write_ms / 1e3)

    config = EngineConfig(
        model="host-only",
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        adapter_root="/nonexistent" if lora else None,
        max_loras=args.max_loras,
        max_cpu_loras=max(args.adapters, args.max_loras),
        lora_slot_quantum_ms=args.slot_quantum_ms,
        lora_first_token_joins=args.first_token_joins,
        stats_log_interval_s=0,
    )
    engine = Engine(config, model_runner=runner)
    if lora and args.swap_blocks:
        # Swap space for paused sequences' KV: the real scheduler's moves, each block's copy
        # charged to the device clock (the engine issues them on the step's stream).
        scheduler = engine.scheduler
        scheduler.host_blocks = HostBlocks(args.swap_blocks)

        def copies(plan: Any) -> None:
            moved = sum(len(blocks) for blocks, _ in plan.swap_out)
            moved += sum(len(blocks) for _, blocks in plan.swap_in)
            clock.now += moved * args.swap_us_per_block / 1e6

        scheduler.on_swaps = copies
    if lora:
        for index in range(args.adapters):
            name = f"adapter-{index}"
            engine.register_adapter(
                AdapterRecord(name=name, path=name, sha256=f"{index:064x}", rank=16)
            )
    return engine


def run_phase(
    args: argparse.Namespace,
    arrivals: list[float],
    adapters: list[str | None],
    *,
    lora: bool,
    max_in_flight: int | None = None,
) -> dict[str, Any]:
    """Run the requests (arrival times in seconds) to their end; the phase's figures.
    `max_in_flight`: a closed loop of that many streams instead (arrivals ignored)."""
    clock = Clock()
    engine = build_engine(args, clock, lora=lora)
    rng = np.random.default_rng(args.seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    count = len(arrivals)
    first = [float("nan")] * count
    done = [float("nan")] * count
    sent = [0.0] * count
    next_index = live = 0
    running = paused = swapped = waiting = used = steps = 0
    total_blocks = args.num_blocks

    def submit(index: int) -> None:
        nonlocal live
        prompt = rng.integers(1000, 30_000, size=args.prompt_len).tolist()
        sent[index] = clock.now
        engine.add_request(f"r{index}", prompt, params, adapter=adapters[index])
        live += 1

    while next_index < count or engine.has_unfinished():
        if max_in_flight is not None:
            while next_index < count and live < max_in_flight:
                submit(next_index)
                next_index += 1
        else:
            if not engine.has_unfinished() and next_index < count:
                clock.now = max(clock.now, arrivals[next_index])
            while next_index < count and arrivals[next_index] <= clock.now:
                submit(next_index)
                sent[next_index] = arrivals[next_index]
                next_index += 1
        output = engine.step()
        steps += 1
        scheduler = engine.scheduler
        running += len(scheduler.running)
        paused += len(scheduler.paused)
        swapped += scheduler.num_swapped
        waiting += scheduler.num_waiting
        used += total_blocks - engine.scheduler.block_manager.num_free_blocks
        for delta in output.deltas:
            index = int(delta.request_id[1:])
            if delta.new_token_ids and first[index] != first[index]:
                first[index] = clock.now
            if delta.finished:
                done[index] = clock.now
                live -= 1
    engine.shutdown()
    ttft = np.array(first) - np.array(sent)
    tpot = (np.array(done) - np.array(first)) / max(args.max_tokens - 1, 1)
    start = min(sent)
    span = max(done) - start
    result: dict[str, Any] = {
        "requests": count,
        "duration_s": round(span, 2),
        "output_tok_s": round(count * args.max_tokens / span, 1),
        "ttft_ms": {
            "p50": round(float(np.percentile(ttft, 50)) * 1e3, 1),
            "p99": round(float(np.percentile(ttft, 99)) * 1e3, 1),
            "max": round(float(ttft.max()) * 1e3, 1),
        },
        "tpot_ms": {
            "p50": round(float(np.percentile(tpot, 50)) * 1e3, 1),
            "p99": round(float(np.percentile(tpot, 99)) * 1e3, 1),
        },
        "latency_max_s": round(float(np.nanmax(np.array(done) - np.array(sent))), 2),
        "mean_running": round(running / steps, 1),
        "mean_paused": round(paused / steps, 1),
        "mean_waiting": round(waiting / steps, 1),
        "mean_kv_used": round(used / steps / total_blocks, 3),
        "steps": steps,
        "preemptions": engine.scheduler.num_preemptions,
    }
    if lora:
        manager = engine.adapters.manager
        result["slot_writes_per_s"] = round(manager.num_slot_writes / span, 1)
        result["pauses_per_s"] = round(engine.scheduler.num_pauses / span, 1)
        result["swap_outs"] = engine.scheduler.num_swap_outs
        result["mean_swapped"] = round(swapped / steps, 1)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"settings": vars(args).copy()}
    rate = args.rate
    if rate is None:
        closed = run_phase(
            args,
            [0.0] * args.saturation_requests,
            [None] * args.saturation_requests,
            lora=False,
            max_in_flight=args.max_num_seqs,
        )
        saturation = closed["output_tok_s"] / args.max_tokens
        report["saturation_req_s"] = round(saturation, 2)
        rate = args.rate_fraction * saturation
    report["rate_req_s"] = round(rate, 2)
    rng = np.random.default_rng(args.seed)
    count = int(rate * args.duration_s)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count)).tolist()
    names = [f"adapter-{index}" for index in range(args.adapters)]
    drawn = choose_adapters(np.random.default_rng(args.seed + 2), names, "zipf", args.zipf_s, count)
    base = run_phase(args, arrivals, [None] * count, lora=False)
    with_lora = run_phase(args, arrivals, [name or None for name in drawn], lora=True)
    report["base"] = base
    report["lora"] = with_lora
    report["lora_over_base_output_tok_s"] = round(
        with_lora["output_tok_s"] / base["output_tok_s"], 3
    )
    report["lora_over_base_p99_ttft"] = round(
        with_lora["ttft_ms"]["p99"] / max(base["ttft_ms"]["p99"], 1e-9), 2
    )
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lora_schedule_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--adapters", type=int, default=100, help="adapters the requests are drawn over")
    add("--zipf-s", type=float, default=1.1, help="Zipf exponent of the adapter draw")
    add("--max-loras", type=int, default=16, help="LoRA device slots")
    add("--slot-quantum-ms", type=float, default=100.0, help="slot time-slice")
    add("--rate", type=float, default=None, help="arrivals/s (default: --rate-fraction)")
    add("--rate-fraction", type=float, default=0.8, help="share of the saturation rate")
    add("--saturation-requests", type=int, default=800, help="closed-loop base requests")
    add("--duration-s", type=float, default=60.0, help="seconds of arrivals")
    add("--prompt-len", type=int, default=512, help="prompt tokens per request")
    add("--max-tokens", type=int, default=256, help="output tokens per request")
    add("--max-num-seqs", type=int, default=384, help="running-batch cap")
    add("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    add("--block-size", type=int, default=16, help="KV block size, tokens")
    add("--num-blocks", type=int, default=26_480, help="KV blocks")
    add("--fixed-ms", type=float, default=5.0, help="model: fixed time of a step")
    add("--row-us", type=float, default=16.8, help="model: per decode row")
    add("--kv-token-us", type=float, default=0.0437, help="model: per context token read")
    add("--prompt-us", type=float, default=26.0, help="model: per prompt token")
    add("--lora-factor", type=float, default=1.2, help="model: a step with adapters, × base")
    add("--lora-adapter-ms", type=float, default=0.03, help="model: per adapter in a step")
    add(
        "--eager-host-ms",
        type=float,
        default=0.0,
        help="model: the host's time to launch a step with prompt tokens (kernel by kernel, no "
        "graph), the least such a step takes (0: none)",
    )
    add(
        "--eager-host-ms-lora",
        type=float,
        default=None,
        help="model: the same for a step that runs adapters (default: --eager-host-ms)",
    )
    add(
        "--first-token-joins",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a request yet to give its first token may join its adapter's draining slot "
        "(the engine's --lora-first-token-joins)",
    )
    add("--write-ms", type=float, default=3.0, help="a slot write's copy time")
    add("--swap-blocks", type=int, default=0, help="host swap space for paused KV, blocks")
    add(
        "--swap-us-per-block",
        type=float,
        default=40.0,
        help="model: one KV block's copy to or from host memory (2 MB at ~50 GB/s)",
    )
    add("--seed", type=int, default=0, help="arrivals, prompts and adapter draw")
    add("--out", default=None, help="also write the report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
