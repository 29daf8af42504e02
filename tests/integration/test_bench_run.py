"""`sluice bench` against the real local stack (router + tokenizer + engine on loopback)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loadtest.cli import main
from loadtest.grpc_client import served_model
from services.common.ports import free_port


def _bench(router_address: str, out: Path, *extra: str) -> dict:
    code = main(
        [
            "--target",
            router_address,
            "--arrival",
            "constant",
            "--rate",
            "4",
            "--input-mean",
            "16",
            "--input-stdev",
            "4",
            "--output-mean",
            "8",
            "--out",
            str(out),
            "--no-progress",
            "--timeout-s",
            "120",
            *extra,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_short_run_all_ok_small_lag_files_written(router_address: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    report = _bench(router_address, out, "--num-requests", "8", "--slo", "ttft=60000")
    statuses = [r["status"] for r in report["requests"]]
    assert statuses == ["OK"] * 8, report["details"]["errors"]
    # ignore_eos + max_tokens: every request streams exactly the asked-for length.
    assert [r["output_tokens"] for r in report["requests"]] == [8] * 8
    summary = report["summary"]
    assert summary["max_send_lag_ms"] < 200
    assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert summary["tpot_ms"]["mean"] > 0
    assert summary["output_token_throughput"] > 0
    assert summary["goodput"] == summary["request_throughput"] > 0
    scheduled = [r["scheduled_s"] for r in report["requests"]]
    assert scheduled == [i * 0.25 for i in range(8)]
    assert (tmp_path / "bench.md").exists()
    for suffix in ("latency_cdf", "throughput", "queue"):
        assert (tmp_path / f"bench_{suffix}.png").stat().st_size > 1000
    # The harness asks the router for the vocabulary to keep synthetic ids inside it.
    model = served_model(router_address)
    assert model is not None and model.vocab_size > 100


def test_cancelled_streams_are_recorded_and_the_stack_keeps_serving(
    router_address: str, tmp_path: Path
) -> None:
    report = _bench(
        router_address,
        tmp_path / "cancel.json",
        "--num-requests",
        "6",
        "--output-mean",
        "24",
        "--cancel-rate",
        "0.5",
        "--seed",
        "3",
    )
    statuses = {r["status"] for r in report["requests"]}
    assert statuses <= {"OK", "CANCELLED"}
    assert "CANCELLED" in statuses
    cancelled = [r for r in report["requests"] if r["status"] == "CANCELLED"]
    assert all(0 < r["output_tokens"] < 24 for r in cancelled)
    # Two load-generator processes share the schedule; their records merge in order.
    after = _bench(router_address, tmp_path / "after.json", "--num-requests", "4", "--workers", "2")
    assert [r["status"] for r in after["requests"]] == ["OK"] * 4
    assert [r["worker"] for r in after["requests"]] == [0, 1, 0, 1]


@pytest.mark.slow
def test_router_and_engine_metrics_are_scraped_and_plotted(
    stack_factory: Callable[..., Any], tmp_path: Path
) -> None:
    router_port, engine_port = free_port(), free_port()
    stack = stack_factory(
        router_args=("--metrics-port", str(router_port)),
        engine_args=(
            "--kv-cache-bytes", str(64 * 1024 * 1024), "--max-num-seqs", "16",
            "--metrics-port", str(engine_port),
        ),
    )  # fmt: skip
    urls = f"http://127.0.0.1:{router_port}/metrics,http://127.0.0.1:{engine_port}/metrics"
    report = _bench(
        stack.router_address,
        tmp_path / "scraped.json",
        "--num-requests",
        "10",
        "--rate",
        "10",
        "--output-mean",
        "16",
        "--metrics-url",
        urls,
        "--scrape-interval-s",
        "0.2",
    )
    assert {r["status"] for r in report["requests"]} == {"OK"}
    scrapes = report["server_metrics"]["scrapes"]
    router_values = [s["values"] for s in scrapes if str(router_port) in s["url"]]
    engine_values = [s["values"] for s in scrapes if str(engine_port) in s["url"]]
    assert router_values and engine_values
    assert router_values[-1]["sluice_router_admitted_requests_total"] >= 10
    assert "sluice_router_queue_depth_requests" in router_values[-1]
    assert max(v["sluice_engine_kv_blocks_used"] for v in engine_values) > 0
    assert (tmp_path / "scraped_kv.png").stat().st_size > 1000
