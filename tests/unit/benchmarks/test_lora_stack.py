"""The LoRA stack benchmark's headline: ratios and goals from its Poisson phases (no GPU)."""

from __future__ import annotations

from benchmarks.lora_stack import headline


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
