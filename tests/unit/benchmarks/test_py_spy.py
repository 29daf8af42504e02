"""The py-spy sampler's summary of raw stacks, and the step profile without py-spy."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import gpu_step_profile, py_spy
from benchmarks.gpu_stack import fixed_specs

ROOT = "LLMEngine.step (engine/llm_engine.py)"


def test_summarize_counts_samples_under_the_root_by_function(tmp_path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "\n".join(
            [
                # two lines of one function (collapsed into one entry), under the root
                "main (bench.py:3);LLMEngine.step (/a/services/engine/llm_engine.py:508);"
                "mm (/x/torch/f.py:10) 6",
                "main (bench.py:3);LLMEngine.step (/a/services/engine/llm_engine.py:509);"
                "mm (/x/torch/f.py:12) 2",
                # recursion: inclusive counts a stack once per function
                "LLMEngine.step (/a/services/engine/llm_engine.py:508);walk (/t/a/b.py:1);"
                "walk (/t/a/b.py:2) 2",
                # outside the root: left out
                "main (bench.py:3);sleep (<frozen time>) 90",
                "garbage line",
            ]
        )
        + "\n"
    )
    summary = py_spy.summarize(raw, ROOT)
    assert summary["samples"] == 10
    assert summary["own_share"] == {"mm (torch/f.py)": 0.8, "walk (a/b.py)": 0.2}
    assert summary["inclusive_share"][ROOT] == 1.0
    assert summary["inclusive_share"]["walk (a/b.py)"] == 0.2
    assert "main (bench.py)" not in summary["inclusive_share"]  # above the root
    assert py_spy.summarize(raw, "absent (x.py)") == {"samples": 0}


def test_short_frame_keeps_the_function_and_the_file() -> None:
    assert py_spy.short_frame("A.b (/usr/lib/pkg/mod.py:42)") == "A.b (pkg/mod.py)"
    assert py_spy.short_frame("getenv (<frozen os>:783)") == "getenv (<frozen os>)"
    assert py_spy.short_frame("process 12") == "process 12"


def test_without_py_spy_the_pass_runs_and_says_why_no_samples(tmp_path, monkeypatch) -> None:
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    monkeypatch.setattr(py_spy, "binary", lambda: None)
    engine = LLMEngine(EngineConfig(model="dummy:tiny", device="cpu"))
    specs = fixed_specs(4)
    times = np.cumsum(np.random.default_rng(1).exponential(1 / 50, len(specs))).tolist()
    result = gpu_step_profile.poisson_pass(
        engine, specs, times, 0, "s", None, None, tmp_path / "spy" / "pass.txt"
    )
    assert result["py_spy"] == "py-spy not found"
    assert result["requests"] == 4 and not engine.has_unfinished()


def test_a_sampler_that_never_started_stops_quietly(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(py_spy, "binary", lambda: None)
    sampler = py_spy.Sampler(tmp_path / "x.txt")
    assert sampler.start() is False
    sampler.stop()
    assert sampler.error == "py-spy not found"
    with pytest.raises(FileNotFoundError):
        (tmp_path / "x.txt").read_text()
