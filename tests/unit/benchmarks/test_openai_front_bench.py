"""benchmarks/openai_front_bench.py against the router and its HTTP front over in-process fakes."""

from __future__ import annotations

import math

from benchmarks.openai_front_bench import measure, parse_args
from tests.unit.router.openai_http.test_http_front import Front, run_front


def test_measures_both_paths_and_reports_their_difference() -> None:
    results: list[dict] = []

    async def check(front: Front) -> None:
        args = parse_args(["--requests", "6", "--warmup", "1", "--max-tokens", "3"])
        router = f"127.0.0.1:{front.grpc_port}"
        results.append(await measure(router, front.base + "/v1", args))

    run_front(check)
    (result,) = results
    assert result["model"] == "fake" and result["requests_each_way"] == 6
    for path in ("grpc_ttft_ms", "http_ttft_ms"):
        assert 0 < result[path]["p50"] <= result[path]["p90"] < 5000
    added = result["http_ttft_ms"]["p50"] - result["grpc_ttft_ms"]["p50"]
    assert math.isclose(result["added_ttft_ms_p50"], added)
    assert math.isclose(
        result["ttft_ratio_p50"], result["http_ttft_ms"]["p50"] / result["grpc_ttft_ms"]["p50"]
    )
