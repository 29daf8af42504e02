"""The step profile's open-loop pass on a CPU engine: what it counts adds up."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import gpu_step_profile
from benchmarks.gpu_stack import RequestSpec, fixed_specs
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine


def _specs(count: int, prompt: int, output: int) -> list[RequestSpec]:
    return [
        RequestSpec(spec.index, prompt, output, spec.prompt_token_ids[:prompt])
        for spec in fixed_specs(count)
    ]


def test_poisson_pass_counts_every_token_and_the_drain(tmp_path) -> None:
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu"))
    specs = _specs(12, prompt=24, output=6)
    times = np.cumsum(np.random.default_rng(0).exponential(1 / 40, len(specs))).tolist()
    cprofile = tmp_path / "pass.txt"
    result = gpu_step_profile.poisson_pass(engine, specs, times, 4, "t", None, cprofile)

    assert not engine.has_unfinished()
    assert result["requests"] == 12
    assert result["ttft_ms"]["max"] >= result["ttft_ms"]["p50"] > 0
    # every output token is counted once: by the steps, and by the output rate over the wall
    decoded = result["output_tok_s"] * result["seconds"]
    assert abs(decoded - 12 * 6) < 0.5
    drain = result["drain"]
    assert 0 <= drain["decoded_tokens"] <= 12 * 6
    assert drain["steps"] <= result["steps"]
    assert 0.0 <= result["planned_ahead_share"] <= 1.0
    assert result["step_span_s"] > 0
    # the profiled window: four steps from the middle of the arrivals, the host profile kept
    assert result["profile"]["steps"] == 4
    assert "function calls" in cprofile.read_text()
    # the engine's launch-ahead method is its own again
    assert "_launch_ahead" not in vars(engine)


def test_launch_host_bench_times_a_baseline_beside_the_current_launch(capsys) -> None:
    from benchmarks import launch_host_bench
    from services.engine.kernels.triton import launch

    driver = launch.driver
    args = ["--baseline", launch.__file__, "--launches", "200", "--rounds", "1"]
    assert launch_host_bench.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    base, current = report["us_per_launch"]["baseline"], report["us_per_launch"]["current"]
    assert base > 0 and current > 0
    assert report["current_over_baseline"] == pytest.approx(current / base, abs=0.01)
    assert launch.driver is driver  # the real driver is back for every later launch
