"""`sluice bench compare A.json B.json`: two reports side by side with B/A ratios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.errors import InvalidArgumentError, NotFoundError

_LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
_RATES = ("request_throughput", "output_token_throughput", "goodput", "max_send_lag_ms")


def load_summary(path: str | Path) -> dict[str, Any]:
    """The `summary` of a report file."""
    file = Path(path)
    if not file.is_file():
        raise NotFoundError(f"report not found: {file}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{file} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        raise InvalidArgumentError(f"{file} has no `summary`: not a bench report")
    return data["summary"]


def comparison_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    """(metric, A, B, B/A) for every latency percentile and rate."""
    rows = []
    for key in _LATENCIES:
        for stat in ("mean", "p50", "p90", "p99"):
            left = (a.get(key) or {}).get(stat)
            right = (b.get(key) or {}).get(stat)
            rows.append((f"{key}.{stat}", left, right, _ratio(left, right)))
    for key in _RATES:
        rows.append((key, a.get(key), b.get(key), _ratio(a.get(key), b.get(key))))
    return rows


def _ratio(left: Any, right: Any) -> float | None:
    if not isinstance(left, (int, float)) or not isinstance(right, (int, float)) or left == 0:
        return None
    return right / left


def format_comparison(path_a: str | Path, path_b: str | Path) -> str:
    """A fixed-width table of the two summaries."""
    rows = comparison_rows(load_summary(path_a), load_summary(path_b))
    name_a, name_b = Path(path_a).name, Path(path_b).name

    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}"

    width = max(24, *(len(r[0]) for r in rows))
    lines = [f"{'metric':<{width}} {name_a:>16} {name_b:>16} {'B/A':>8}"]
    for name, left, right, ratio in rows:
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"{name:<{width}} {cell(left):>16} {cell(right):>16} {ratio_text:>8}")
    return "\n".join(lines)
