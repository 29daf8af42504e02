"""The engine step benchmark drives a real LLMEngine and reports consistent figures."""

from __future__ import annotations

from benchmarks.engine_step_bench import build_parser, run


def test_a_short_run_reports_tokens_and_step_times() -> None:
    args = build_parser().parse_args(
        ["--model", "dummy:tiny", "--concurrency", "4", "--duration-s", "0.5", "--max-tokens", "8"]
    )
    figures = run(args)
    assert figures["steps"] > 0 and figures["tokens_per_s"] > 0
    assert 0 <= figures["host_ms_per_step"] <= figures["mean_step_ms"]
