"""The stack benchmark end to end on a small run: both sides stream, the report adds up.

Runs `benchmarks.stack_bench` against a stack whose engine is the model-free synthetic engine
(benchmarks/synthetic_engine.py), so it is quick; the same code path measures `dummy:tiny`.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest

from benchmarks import stack_bench
from benchmarks.stack_bench_clients import LoadShape
from services.router.metrics import FIRST_TOKEN_PHASES

pytestmark = pytest.mark.slow


def test_staggered_first_requests_spread_over_the_whole_length() -> None:
    shape = LoadShape(concurrency=4, max_tokens=8, duration_s=1.0, warmup_s=0.0)
    assert [shape.first_max_tokens(i) for i in range(4)] == [2, 4, 6, 8]
    assert LoadShape(64, 1, 1.0, 0.0).first_max_tokens(0) == 1  # never below one token


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert stack_bench.cpu_list("0,1") == {0, 1}
    assert stack_bench.cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    for bad in ("", "a", "3-1", "-1", "0,,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            stack_bench.cpu_list(bad)


def test_stack_bench_report_on_the_synthetic_engine(tmp_path, capsys, monkeypatch) -> None:
    report_path = tmp_path / "report.json"
    # --hop-trace sets these for the processes the bench starts; the test's own env is restored.
    monkeypatch.setenv("SLUICE_TRACE_DIR", "")
    monkeypatch.setenv("SLUICE_TRACE_SAMPLE_RATIO", "")
    allowed = os.sched_getaffinity(0)
    nice_before = os.nice(0)
    cpus = sorted(allowed)[:2]
    argv = [
        "--synthetic-step-ms", "2", "--concurrency", "8", "--max-tokens", "16",
        "--duration-s", "1.5", "--warmup-s", "0.3", "--idle-samples", "3",
        "--stream-interval", "2", "--cpus", ",".join(map(str, cpus)),
        "--client-cpus", ",".join(map(str, cpus)), "--json", str(report_path),
        "--hop-trace", str(tmp_path / "hops"),
    ]  # fmt: skip
    assert stack_bench.main(argv) == 0
    assert os.sched_getaffinity(0) == allowed  # given back to this process
    report = json.loads(report_path.read_text())
    assert report["cpus"] == report["client_cpus"] == cpus
    # The load ran as a process of its own at the lowest priority, on both sides; this one kept its.
    assert report["client_priority"] == "low"
    assert {side["nice"] for side in report["client_priority_applied"].values()} == {19}
    assert set(report["client_priority_applied"]) == {"engine_alone", "router"}
    assert os.nice(0) == nice_before
    engine, router = report["engine_alone"], report["router"]
    for side in (engine, router):
        assert side["tokens"] > 0 and side["requests"] > 0 and side["ttft_samples"] > 0
        assert side["tokens_per_s"] == pytest.approx(side["tokens"] / side["seconds"])
        assert side["ttft_median_ms"] <= side["ttft_p90_ms"]
        assert side["probe_samples"] > 0  # the probe process ran and answered in the window
        assert side["probe_ttft_median_ms"] <= side["probe_ttft_p90_ms"]
        assert side["engine_tokens_per_step"] is None  # the synthetic engine has no /metrics
    assert engine["tokens_per_response"] == pytest.approx(1.0)  # one token per step each
    assert router["tokens_per_response"] > 1.0  # --stream-interval 2 reached the router
    assert set(router["cpu_us_per_token"]) >= {"router", "tokenizer", "engine", "bench client"}
    assert router["cpu_us_per_token"]["router"] > 0
    assert report["ratio_router_to_engine"] == pytest.approx(
        router["tokens_per_s"] / engine["tokens_per_s"]
    )
    assert math.isfinite(report["added_ttft_median_ms_idle"])
    phases = router["first_token_phase_median_ms"]  # from the router's histogram
    assert set(phases) == set(FIRST_TOKEN_PHASES)
    assert all(phases[p] is not None and phases[p] >= 0 for p in ("tokenize", "queue", "engine"))
    # Every router probe was traced through the router, the tokenizer and back to the probe
    # (the synthetic engine records no engine hops; tests/unit/engine covers the engine's).
    hops = router["probe_hops"]
    assert hops["requests"] == router["probe_samples"]
    measured = {(h["from"], h["to"]): h for h in hops["hops"]}
    for hop in (("client_send", "arrive"), ("tokenize_in", "tokenize_out"), ("step", "detok_sent"),
                ("detok_in", "detok_out"), ("respond", "client_first")):  # fmt: skip
        assert measured[hop]["n"] == hops["requests"] and measured[hop]["median_ms"] >= 0
    assert hops["total"]["median_ms"] == pytest.approx(router["probe_ttft_median_ms"], rel=0.5)
    out = capsys.readouterr().out
    assert "ratio router / engine alone" in out and "client send -> first token" in out
