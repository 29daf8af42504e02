"""The soak's pieces that run without a stack: its load phases' flags and its check ledger."""

from __future__ import annotations

import pytest

from benchmarks.gpu_soak import ADAPTERS, Checks, bench_phases
from services.common.config import from_layers


@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_every_load_phase_is_a_valid_sluice_bench_run(scale: float) -> None:
    from loadtest.cli import run_parser
    from loadtest.config import BenchConfig

    names = [f"{prefix}-000" for prefix, _, _ in ADAPTERS]
    phases = bench_phases(scale, names, context=8192)
    assert set(phases) == {"long-prompts-sampled-cancelled", "shared-prefix-zipf-adapters", "burst"}
    for flags in phases.values():
        config = from_layers(BenchConfig, run_parser().parse_args(["--target", "t:1", *flags]))
        assert config.num_requests >= 8 and config.rate > 0
    long = from_layers(
        BenchConfig,
        run_parser().parse_args(["--target", "t:1", *phases["long-prompts-sampled-cancelled"]]),
    )
    assert long.cancel_rate == 0.3 and long.adapters == tuple(names)
    # the longest prompts stay inside the context with their output (4 sigma)
    assert long.input_mean + 4 * long.input_stdev + long.output_mean + 4 * long.output_stdev < 8192


def test_a_crashed_check_is_a_failed_one_and_the_ledger_goes_on() -> None:
    checks = Checks()
    checks.add("fine", True)
    checks.guarded("crashes", lambda: 1 / 0)
    checks.guarded("holds", lambda: (True, "detail"))
    assert checks.failed == ["crashes"]
    assert "ZeroDivisionError" in checks.results[1]["detail"]
