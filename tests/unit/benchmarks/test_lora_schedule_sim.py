"""The scheduling simulation runs the real engine on a modelled clock, the same way each time."""

from __future__ import annotations

from benchmarks.lora_schedule_sim import StepModel, build_parser, run
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence

SMALL = [
    *("--adapters", "12", "--max-loras", "3", "--rate", "20", "--duration-s", "3"),
    *("--max-num-seqs", "32", "--prompt-len", "32", "--max-tokens", "24"),
    *("--num-blocks", "2000", "--saturation-requests", "40"),
]


def test_both_phases_finish_every_request_and_only_the_lora_one_takes_turns() -> None:
    report = run(build_parser().parse_args(SMALL))
    base, lora = report["base"], report["lora"]
    assert report["rate_req_s"] == 20 and base["requests"] == lora["requests"] == 60
    for phase in (base, lora):
        assert phase["duration_s"] >= 3.0 * 0.8  # at least the arrivals' span (Poisson)
        assert 0 < phase["ttft_ms"]["p50"] <= phase["ttft_ms"]["p99"] <= phase["ttft_ms"]["max"]
        assert phase["preemptions"] == 0 and 0 < phase["mean_kv_used"] < 1
    assert base["mean_paused"] == 0 and "slot_writes_per_s" not in base
    assert lora["mean_paused"] > 0 and lora["slot_writes_per_s"] > 0 and lora["pauses_per_s"] > 0
    # A step with adapters costs more on the modelled clock, so the same work takes longer.
    assert lora["duration_s"] > base["duration_s"]
    assert report["lora_over_base_output_tok_s"] < 1


def test_a_run_is_a_function_of_its_settings() -> None:
    args = [*SMALL, "--duration-s", "1"]
    first = run(build_parser().parse_args(args))
    assert run(build_parser().parse_args(args)) == first
    saturation = run(build_parser().parse_args([a for a in args if a not in ("--rate", "20")]))
    assert saturation["saturation_req_s"] > 0 and "saturation_req_s" not in first


def test_swap_space_moves_paused_sequences_instead_of_preempting_them() -> None:
    """A KV cache too small for the paused sequences of 12 adapters on 2 slots: without swap
    space they are preempted (their KV recomputed); with host blocks many move out instead,
    every request still finishes, and the modelled clock charges the copies."""
    tight = [
        *("--adapters", "12", "--max-loras", "2", "--rate", "40", "--duration-s", "3"),
        *("--max-num-seqs", "32", "--prompt-len", "32", "--max-tokens", "96"),
        *("--num-blocks", "60", "--saturation-requests", "40"),
    ]
    without = run(build_parser().parse_args([*tight, "--swap-blocks", "0"]))["lora"]
    with_swap = run(build_parser().parse_args([*tight, "--swap-blocks", "200"]))["lora"]
    assert without["requests"] == with_swap["requests"] == 120
    assert without["swap_outs"] == 0 and without["mean_swapped"] == 0
    assert without["preemptions"] > 0
    assert with_swap["swap_outs"] > 0 and with_swap["mean_swapped"] > 0
    assert with_swap["preemptions"] < without["preemptions"]


def test_a_step_with_prompt_tokens_takes_at_least_the_hosts_launch_time() -> None:
    """The eager host floors: a prompt step no shorter than them (the adapters' own floor when
    it runs adapters), a decode step (a graph replay) untouched."""

    def batch(prompt_tokens: int, slot: int) -> ScheduledBatch:
        rows = [ScheduledSequence(1, [5], 40, [0, 1, 2], True, adapter_slot=slot)]
        if prompt_tokens:
            tokens = list(range(prompt_tokens))
            rows.append(ScheduledSequence(2, tokens, 0, [3], True, adapter_slot=slot))
        return ScheduledBatch(sequences=rows)

    floors = ["--eager-host-ms", "20", "--eager-host-ms-lora", "40"]
    plain = StepModel(build_parser().parse_args([]))
    floored = StepModel(build_parser().parse_args(floors))
    shared = StepModel(build_parser().parse_args(floors[:2]))
    for slot in (-1, 0):  # the base model's rows, an adapter's
        decode = batch(0, slot)
        assert floored.seconds(decode) == plain.seconds(decode) < 0.02
    prompt = batch(16, -1)
    assert plain.seconds(prompt) < 0.02 and floored.seconds(prompt) == 0.020
    assert floored.seconds(batch(16, 0)) == 0.040 and shared.seconds(batch(16, 0)) == 0.020
    long_prompt = batch(4096, 0)  # the device's work outlasts the launches
    assert floored.seconds(long_prompt) == plain.seconds(long_prompt) > 0.040


def test_first_tokens_joining_draining_slots_come_sooner() -> None:
    """Two slots turned every 50 ms among 12 adapters: a request whose adapter's slot drains
    joins it for its first token (the engine's default) rather than waiting for the next turn;
    every request still finishes."""
    sliced = [
        *("--adapters", "12", "--max-loras", "2", "--rate", "40", "--duration-s", "3"),
        *("--max-num-seqs", "32", "--prompt-len", "32", "--max-tokens", "96"),
        *("--num-blocks", "4000", "--saturation-requests", "40", "--slot-quantum-ms", "50"),
    ]
    joins = run(build_parser().parse_args(sliced))["lora"]
    waits = run(build_parser().parse_args([*sliced, "--no-first-token-joins"]))["lora"]
    assert joins["requests"] == waits["requests"] == 120
    assert joins["ttft_ms"]["p50"] < waits["ttft_ms"]["p50"]
    assert joins["ttft_ms"]["p99"] < waits["ttft_ms"]["p99"]
