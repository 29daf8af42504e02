"""Writes a run's report: JSON (`summary`, `details`, `config`, `requests`, `server_metrics`),
a Markdown summary beside it (same name, `.md`) and the PNG plots (`plots.py`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.metrics import details, summarize
from loadtest.plots import write_plots
from loadtest.records import RequestRecord
from loadtest.scrape import ScrapeLog


def build_report(
    records: Sequence[RequestRecord],
    *,
    slo: Mapping[str, float] | None = None,
    config: Mapping[str, Any] | None = None,
    scrape_log: ScrapeLog | None = None,
    start_epoch_s: float = 0.0,
    warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """The JSON document of a run."""
    report: dict[str, Any] = {
        "summary": summarize(records, slo),
        "details": details(records) | {"slo_ms": dict(slo or {}), "warnings": list(warnings)},
        "config": dict(config or {}),
        "requests": [r.to_json() for r in records],
    }
    if scrape_log is not None:
        report["server_metrics"] = scrape_log.to_json(start_epoch_s)
    return report


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def markdown(report: Mapping[str, Any]) -> str:
    """A short Markdown summary of a report."""
    summary, info = report["summary"], report.get("details", {})
    lines = ["# Load test summary", ""]
    config = report.get("config") or {}
    if config:
        shown = ", ".join(f"{k}={v}" for k, v in config.items() if v not in (None, "", ()))
        lines += [f"Config: {shown}", ""]
    lines += ["| metric (ms) | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        row = " | ".join(_cell(stats[p]) for p in ("mean", "p50", "p90", "p99"))
        lines.append(f"| {key.removesuffix('_ms').upper()} | {row} |")
    lines += [
        "",
        f"- Requests: {info.get('num_requests', '-')}, OK: {info.get('completed', '-')}, "
        f"errors: {info.get('errors') or 'none'}, retried: {info.get('retried_requests', 0)} "
        f"({info.get('retries', 0)} retries)",
        f"- Request throughput: {_cell(summary['request_throughput'])} req/s",
        f"- Output token throughput: {_cell(summary['output_token_throughput'])} tokens/s",
        f"- Goodput: {_cell(summary['goodput'])} req/s (SLO ms: {info.get('slo_ms') or 'none'})",
        f"- Worst send lag: {_cell(summary['max_send_lag_ms'])} ms "
        f"(scheduler dispatch {_cell(info.get('max_dispatch_lag_ms'))} ms, "
        f"dispatch-to-send wait incl. --max-concurrency slots "
        f"{_cell(info.get('max_slot_wait_ms'))} ms)",
        f"- Duration: {_cell(info.get('duration_s'))} s",
    ]
    for warning in info.get("warnings", []):
        lines.append(f"- {warning}")
    return "\n".join(lines) + "\n"


def write_report(
    report: Mapping[str, Any],
    out: str | Path,
    records: Sequence[RequestRecord],
    scrape_log: ScrapeLog | None = None,
    start_epoch_s: float = 0.0,
) -> list[Path]:
    """Write FILE.json, FILE.md and FILE_*.png; return every path written."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    stem = path.with_suffix("")
    markdown_path = stem.with_suffix(".md")
    markdown_path.write_text(markdown(report), encoding="utf-8")
    return [path, markdown_path, *write_plots(records, stem, scrape_log, start_epoch_s)]
