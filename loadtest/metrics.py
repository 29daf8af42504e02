"""Latency and throughput arithmetic over the records of a run.

- TTFT: send → first chunk with a token. TPOT: (e2e - ttft) / (output_tokens - 1), only for
  requests with more than one token (the first token is excluded). ITL: per-token gaps between
  chunks, a chunk of k tokens splitting its interval evenly (see `RequestRecord`). E2E: send →
  end of stream. Each is reported in ms as mean / p50 / p90 / p99 over successful requests.
- Throughput: successful requests, and output tokens of all requests, per second of the run
  (first scheduled send to the last response).
- Goodput: successful requests per second that met every SLO given (`ttft`, `tpot`, `itl`,
  `e2e` in ms); without SLOs it equals the request throughput.
- Errors: counts by gRPC status name (``OK`` excluded).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from loadtest.records import RequestRecord
from services.common.errors import InvalidArgumentError

SUMMARY_KEYS = (
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "request_throughput",
    "output_token_throughput",
    "goodput",
    "max_send_lag_ms",
)
SLO_NAMES = ("ttft", "tpot", "itl", "e2e")


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=200,tpot=50` → {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip().lower().removesuffix("_ms")
        if not sep or name not in SLO_NAMES:
            raise InvalidArgumentError(
                f"--slo takes name=ms pairs with names {SLO_NAMES}: {part!r}"
            )
        try:
            limit = float(value)
        except ValueError as exc:
            raise InvalidArgumentError(f"--slo {name}: not a number: {value!r}") from exc
        if not limit > 0:
            raise InvalidArgumentError(f"--slo {name} must be > 0 ms, got {limit}")
        slo[name] = limit
    return slo


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 in milliseconds (None when there are no values)."""
    if not len(values_s):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    array = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(array, [50, 90, 99]).tolist()
    return {"mean": float(array.mean()), "p50": p50, "p90": p90, "p99": p99}


def meets_slo(record: RequestRecord, slo: Mapping[str, float]) -> bool:
    """True for a successful request within every SLO (a metric it lacks is not held against it)."""
    if record.status != "OK":
        return False
    checks = {
        "ttft": record.ttft_s,
        "tpot": record.tpot_s,
        "e2e": record.e2e_s,
        "itl": max(record.inter_token_latencies_s(), default=None),
    }
    for name, limit_ms in slo.items():
        value = checks[name]
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """From time 0 (the first scheduled send) to the last finished response."""
    ends = [r.finished_s for r in records if r.finished_s is not None]
    return max(ends, default=0.0)


def summarize(
    records: Sequence[RequestRecord], slo: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The report's `summary`: exactly `SUMMARY_KEYS`."""
    slo = slo or {}
    ok = [r for r in records if r.status == "OK"]
    duration = run_duration_s(records)
    lags = [r.send_lag_s for r in records if r.send_lag_s is not None]
    itl = [gap for r in ok for gap in r.inter_token_latencies_s()]

    def rate(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    return {
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": distribution_ms(itl),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "request_throughput": rate(len(ok)),
        "output_token_throughput": rate(sum(r.output_tokens for r in records)),
        "goodput": rate(sum(1 for r in ok if meets_slo(r, slo))),
        "max_send_lag_ms": max(lags) * 1000.0 if lags else 0.0,
    }


def details(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Counts and waits around the summary: errors by status, lags, token totals."""
    statuses = Counter(r.status for r in records)
    dispatch_lags = [r.dispatched_s - r.scheduled_s for r in records if r.dispatched_s is not None]
    slot_waits = [r.slot_wait_s for r in records if r.slot_wait_s is not None]
    return {
        "num_requests": len(records),
        "completed": statuses.get("OK", 0),
        "errors": {name: count for name, count in sorted(statuses.items()) if name != "OK"},
        "cancelled_by_harness": sum(1 for r in records if r.cancelled),
        # Sends again after RESOURCE_EXHAUSTED (--retries), and the requests that needed one.
        "retries": sum(r.retries for r in records),
        "retried_requests": sum(1 for r in records if r.retries),
        # Successful requests that stopped before the asked-for length (ignore_eos not honoured).
        "ok_short_of_output_length": sum(
            1 for r in records if r.status == "OK" and r.output_tokens < r.expected_output_tokens
        ),
        "duration_s": run_duration_s(records),
        "total_input_tokens": sum(r.input_tokens for r in records),
        "total_output_tokens": sum(r.output_tokens for r in records),
        "max_dispatch_lag_ms": max(dispatch_lags) * 1000.0 if dispatch_lags else 0.0,
        "p99_send_lag_ms": (
            float(np.percentile([r.send_lag_s for r in records if r.sent_s is not None], 99))
            * 1000.0
            if any(r.sent_s is not None for r in records)
            else 0.0
        ),
        "max_slot_wait_ms": max(slot_waits) * 1000.0 if slot_waits else 0.0,
        "mean_slot_wait_ms": float(np.mean(slot_waits)) * 1000.0 if slot_waits else 0.0,
    }
