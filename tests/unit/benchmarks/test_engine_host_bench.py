"""The engine host benchmark drives LLMEngine with LoRA slot turns and reports its figures."""

from __future__ import annotations

from benchmarks.engine_host_bench import build_parser, run


def test_a_short_run_plans_ahead_turns_slots_and_converts_deltas() -> None:
    args = build_parser().parse_args(
        [
            *("--adapters", "12", "--max-loras", "4", "--in-flight", "48"),
            *("--max-num-seqs", "24", "--prompt-len", "32", "--max-tokens", "16"),
            *("--warmup-steps", "20", "--steps", "40", "--num-blocks", "1000"),
        ]
    )
    figures = run(args)
    assert figures["steps"] == figures["launches"] == 40
    assert figures["host_ms_per_step"] > 0 and figures["server_ms_per_step"] > 0
    assert figures["planned_ahead_share"] == 1.0 and figures["plain_steps_by_reason"] == {}
    assert figures["mean_paused"] > 0 and figures["slot_writes_per_s"] > 0
    assert figures["finished"] > 0 and figures["server_bytes_per_step"] > 0
    assert figures["preemptions"] == 0
