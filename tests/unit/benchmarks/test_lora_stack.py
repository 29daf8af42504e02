"""The LoRA stack benchmark's headline: ratios and goals from its Poisson phases (no GPU)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.lora_stack import _engine_log_lines, headline


def _phase(output_tok_s: float, ttft_p99_ms: float, errors: dict | None = None) -> dict:
    return {
        "output_tok_s": output_tok_s,
        "ttft_ms": {"p50": ttft_p99_ms / 2, "p99": ttft_p99_ms, "max": ttft_p99_ms * 1.2},
        "tpot_ms": {"p50": 20.0, "p99": 30.0},
        "errors": errors or {},
        "router_queue_wait": {"count": 10, "max_s_at_most": 0.005, "max_s_above": 0.002},
    }


def test_goals_follow_the_ratios_of_the_two_phases() -> None:
    report = {"phases": {"base_poisson": _phase(1000, 100), "lora_poisson": _phase(900, 250)}}
    headline(report, bound_s=2.0)
    assert report["lora_over_base_output_tok_s"] == 0.9
    assert report["lora_over_base_p99_ttft"] == 2.5
    assert report["goals"] == {
        "output_tok_s_ratio_at_least_0.85": True,
        "p99_ttft_ratio_at_most_3": True,
        "queue_wait_within_bound": "met",
    }
    assert "cut_by_budget" not in report
    report = {"phases": {"base_poisson": _phase(1000, 100), "lora_poisson": _phase(800, 400)}}
    headline(report, bound_s=2.0)
    assert report["goals"]["output_tok_s_ratio_at_least_0.85"] is False
    assert report["goals"]["p99_ttft_ratio_at_most_3"] is False


def test_requests_cut_at_the_budgets_end_leave_the_output_and_ttft_goals_undecided() -> None:
    """A phase whose last requests the budget cut counts its output to a finish that never
    came: its ratios are kept, its goals are not judged."""
    lora = _phase(950, 200, errors={"DEADLINE_EXCEEDED": 77, "RESOURCE_EXHAUSTED": 3})
    report = {"phases": {"base_poisson": _phase(1000, 100), "lora_poisson": lora}}
    headline(report, bound_s=2.0)
    assert report["cut_by_budget"] == {"lora_poisson": 77}
    for goal in ("output_tok_s_ratio_at_least_0.85", "p99_ttft_ratio_at_most_3"):
        assert report["goals"][goal].startswith("undecided: 77 requests cut")
    assert report["lora_over_base_output_tok_s"] == 0.95
    assert report["goals"]["queue_wait_within_bound"] == "met"


def test_each_ab_flag_set_adds_a_lora_phase_after_the_quanta() -> None:
    from benchmarks.lora_stack import build_parser, lora_variants

    plain = lora_variants(build_parser().parse_args([]))
    assert [(v.key, v.quantum_ms, v.engine_args, v.label) for v in plain] == [
        ("lora_poisson", None, "", "lora")
    ]
    args = build_parser().parse_args(
        ["--slot-quanta", "100,25", "--ab-engine-args=--lora-fused-swiglu",
         "--ab-engine-args", "--kv-cache-dtype fp8 --no-lora-fused-decode"]
    )  # fmt: skip
    assert [(v.key, v.quantum_ms, v.engine_args) for v in lora_variants(args)] == [
        ("lora_poisson", 100.0, ""),
        ("lora_poisson_quantum_25", 25.0, ""),
        ("lora_poisson_ab_1", 100.0, "--lora-fused-swiglu"),
        ("lora_poisson_ab_2", 100.0, "--kv-cache-dtype fp8 --no-lora-fused-decode"),
    ]
    assert lora_variants(args)[2].label == "lora_ab_1"


def test_every_lora_phase_is_compared_with_the_base_and_says_its_flags() -> None:
    ab = {**_phase(700, 300), "engine_args": "--lora-fused-swiglu", "slot_quantum_ms": None}
    report = {
        "phases": {
            "base_poisson": _phase(1000, 100),
            "lora_poisson": {**_phase(800, 400), "engine_args": "", "slot_quantum_ms": None},
            "lora_poisson_ab_1": ab,
        }
    }
    headline(report, bound_s=2.0)
    assert report["lora_over_base_output_tok_s"] == 0.8  # the headline is the first phase's
    assert [(row["phase"], row["engine_args"], row["output_tok_s_over_base"],
             row["p99_ttft_over_base"]) for row in report["quantum_sweep"]] == [
        ("lora_poisson", "", 0.8, 4.0),
        ("lora_poisson_ab_1", "--lora-fused-swiglu", 0.7, 3.0),
    ]  # fmt: skip


def test_the_report_keeps_kernel_variants_compiled_while_serving(tmp_path: Path) -> None:
    """A variant the warm-up missed stalls a serving step; its warning reaches the report."""
    stack = tmp_path / "lora"
    stack.mkdir()
    (stack / "engine-0.log").write_text(
        "INFO engine stats over 10.0s: 20 steps/s\n"
        "DEBUG something else\n"
        "WARNING compiling a kernel variant the warm-up did not cover (a request's step "
        "waits): lora_expand\n"
    )
    lines = _engine_log_lines(tmp_path)
    assert len(lines) == 2 and lines[0].startswith("lora: INFO engine stats")
    assert "lora_expand" in lines[1]
