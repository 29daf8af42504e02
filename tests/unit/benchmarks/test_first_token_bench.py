"""The first-token benchmark drives a real engine through its three arrival patterns."""

from __future__ import annotations

from benchmarks.first_token_bench import build_parser, run


def test_a_cpu_run_times_each_arrival_pattern() -> None:
    args = build_parser().parse_args(
        ["--model", "dummy:tiny", "--device", "cpu", "--prompt-len", "24", "--trials", "2"]
    )
    report = run(args)
    figures = report["first_token_ms"]
    assert figures["alone"] > 0 and figures["together"] > 0
    assert figures["second_after"]["first"] > 0 and figures["second_after"]["second"] > 0
    assert len(report["latency_ms"]) == 2 * 5  # alone, first, second and the pair, per trial
    # every arrival's prompt ran in a step with prompt rows (24 tokens beside 5 decodes)
    assert report["prompt_steps"] and all(s["tokens"] >= 24 for s in report["prompt_steps"])
    assert report["settings"]["background"] == 5
