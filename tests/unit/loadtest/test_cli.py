"""`sluice bench` end to end against the SSE fixture server: report, Markdown, plots, compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.metrics import SUMMARY_KEYS
from tests.unit.loadtest.sse_fixture_server import OpenAIFixtureServer

_RECORD_KEYS = {"scheduled_s", "sent_s", "ttft_s", "e2e_s", "output_tokens", "status"}


def bench(server: OpenAIFixtureServer, out: Path, *extra: str) -> int:
    return main(
        [
            "run",
            "--openai-url",
            server.url,
            "--arrival",
            "constant",
            "--rate",
            "40",
            "--num-requests",
            "12",
            "--output-mean",
            "4",
            "--input-mean",
            "8",
            "--out",
            str(out),
            "--metrics-url",
            f"{server.url}/metrics",
            "--scrape-interval-s",
            "0.05",
            "--no-progress",
            *extra,
        ]
    )


def test_run_writes_report_markdown_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run" / "a.json"
    with OpenAIFixtureServer(first_token_delay_s=0.05, token_delay_s=0.01) as server:
        assert bench(server, out, "--slo", "ttft=1000,tpot=500") == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == set(SUMMARY_KEYS)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report["summary"][key]) == {"mean", "p50", "p90", "p99"}
    assert report["summary"]["ttft_ms"]["p50"] >= 45
    assert report["summary"]["goodput"] == pytest.approx(report["summary"]["request_throughput"])
    assert report["summary"]["max_send_lag_ms"] < 200
    assert len(report["requests"]) == 12
    for record in report["requests"]:
        assert set(record) >= _RECORD_KEYS
        assert record["status"] == "OK"
        assert record["output_tokens"] == 4
    assert report["server_metrics"]["scrapes"]
    assert (tmp_path / "run" / "a.md").read_text().startswith("# Load test summary")
    for suffix in ("latency_cdf", "throughput", "queue", "kv"):
        png = tmp_path / "run" / f"a_{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT" in capsys.readouterr().out


def test_compare_prints_both_reports_with_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    summary = {
        key: {"mean": 10.0, "p50": 10.0, "p90": 20.0, "p99": 30.0} for key in SUMMARY_KEYS[:4]
    }
    summary |= {"request_throughput": 2.0, "output_token_throughput": 100.0, "goodput": 1.0}
    summary["max_send_lag_ms"] = 1.0
    slower = json.loads(json.dumps(summary))
    slower["ttft_ms"]["p99"] = 90.0
    slower["request_throughput"] = 1.0
    (tmp_path / "a.json").write_text(json.dumps({"summary": summary, "requests": []}))
    (tmp_path / "b.json").write_text(json.dumps({"summary": slower, "requests": []}))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "a.json" in lines[0] and "b.json" in lines[0]
    ttft_p99 = next(line for line in lines if line.startswith("ttft_ms.p99"))
    assert ttft_p99.split() == ["ttft_ms.p99", "30.000", "90.000", "3.00x"]
    throughput = next(line for line in lines if line.startswith("request_throughput"))
    assert throughput.split()[-1] == "0.50x"


def test_bad_flags_and_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--num-requests", "3"]) == 2  # no target
    assert main(["--target", "x:1", "--openai-url", "http://y"]) == 2
    assert main(["--target", "x:1", "--slo", "ttft"]) == 2
    assert main(["compare", str(tmp_path / "no.json"), str(tmp_path / "no.json")]) == 2
    assert "sluice bench:" in capsys.readouterr().err


def test_all_requests_failing_exits_1(tmp_path: Path) -> None:
    with OpenAIFixtureServer() as server:
        code = main(
            ["--openai-url", server.url, "--dataset", "sharegpt", "--dataset-path",
             str(_fail_dataset(tmp_path)), "--num-requests", "3", "--rate", "100",
             "--no-progress", "--out", str(tmp_path / "fail.json")]
        )  # fmt: skip
    assert code == 1
    report = json.loads((tmp_path / "fail.json").read_text())
    assert {r["status"] for r in report["requests"]} == {"RESOURCE_EXHAUSTED"}


def _fail_dataset(tmp_path: Path) -> Path:
    path = tmp_path / "fail.json"
    turns = [{"from": "human", "value": "FAIL429 please"}, {"from": "gpt", "value": "never"}]
    path.write_text(json.dumps([{"conversations": turns}]))
    return path
