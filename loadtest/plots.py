"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- ``*_latency_cdf.png``: CDFs of TTFT, TPOT, ITL and E2E.
- ``*_throughput.png``: output tokens/s and finished requests/s over time (1 s bins).
- ``*_queue.png``: send lag per request and requests in flight (client side) over time, with
  the router's queue depth and running requests when `/metrics` was scraped.
- ``*_kv.png`` (only when scraped): KV blocks used/free and engine running/waiting sequences,
  beside the TTFT of requests sent at that time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.records import RequestRecord  # noqa: E402
from loadtest.scrape import ScrapeLog  # noqa: E402

_SERVER_QUEUE_SERIES = (
    "sluice_router_queue_depth_requests",
    "sluice_router_running_requests",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
)
_SERVER_KV_SERIES = (
    "sluice_engine_kv_blocks_used",
    "sluice_engine_kv_blocks_free",
    "sluice_engine_running_sequences",
    "sluice_engine_waiting_sequences",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
)


def write_plots(
    records: Sequence[RequestRecord],
    stem: Path,
    scrape_log: ScrapeLog | None = None,
    start_epoch_s: float = 0.0,
) -> list[Path]:
    """Write the PNGs next to `stem` (a path without suffix); return their paths."""
    paths = [_latency_cdfs(records, stem), _throughput(records, stem)]
    paths.append(_queue(records, stem, scrape_log, start_epoch_s))
    if scrape_log is not None and _has_any(scrape_log, _SERVER_KV_SERIES):
        paths.append(_kv(records, stem, scrape_log, start_epoch_s))
    return paths


def _save(figure: plt.Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _latency_cdfs(records: Sequence[RequestRecord], stem: Path) -> Path:
    ok = [r for r in records if r.status == "OK"]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [r.tpot_s for r in ok if r.tpot_s is not None],
        "ITL": [gap for r in ok for gap in r.inter_token_latencies_s()],
        "E2E": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for axis, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            data = np.sort(np.asarray(values) * 1000.0)
            axis.step(data, np.arange(1, len(data) + 1) / len(data), where="post")
        axis.set_title(f"{name} CDF ({len(values)} samples)")
        axis.set_xlabel("ms")
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
    return _save(figure, stem.with_name(stem.name + "_latency_cdf.png"))


def _throughput(records: Sequence[RequestRecord], stem: Path) -> Path:
    token_times = np.asarray(
        [
            t
            for r in records
            for t, k in zip(r.chunk_times_s, r.chunk_tokens, strict=True)
            for _ in range(k)
        ]
    )
    ends = np.asarray([r.finished_s for r in records if r.status == "OK" and r.finished_s])
    horizon = max([1.0, *token_times.tolist(), *ends.tolist()])
    bins = np.arange(0.0, np.ceil(horizon) + 1.0, 1.0)
    figure, axis = plt.subplots(figsize=(9, 3.6))
    tokens, _ = np.histogram(token_times, bins=bins)
    done, _ = np.histogram(ends, bins=bins)
    axis.plot(bins[:-1], tokens, label="output tokens/s", color="tab:blue")
    axis.set_xlabel("time since start (s)")
    axis.set_ylabel("tokens/s")
    other = axis.twinx()
    other.plot(bins[:-1], done, label="finished requests/s", color="tab:orange")
    other.set_ylabel("requests/s")
    axis.set_title("Throughput over time")
    figure.legend(loc="upper right")
    return _save(figure, stem.with_name(stem.name + "_throughput.png"))


def _in_flight(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    events = [(r.sent_s, 1) for r in records if r.sent_s is not None]
    events += [(r.finished_s, -1) for r in records if r.sent_s is not None and r.finished_s]
    events.sort()
    times = np.asarray([t for t, _ in events])
    return times, np.cumsum([d for _, d in events])


def _queue(
    records: Sequence[RequestRecord], stem: Path, log: ScrapeLog | None, start: float
) -> Path:
    figure, (lag_axis, queue_axis) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    sent = [r for r in records if r.sent_s is not None]
    lag_axis.scatter(
        [r.scheduled_s for r in sent], [r.send_lag_s * 1000.0 for r in sent], s=6, label="send lag"
    )
    lag_axis.set_ylabel("send lag (ms)")
    lag_axis.set_title("Send lag (actual - scheduled) and queue depth")
    lag_axis.grid(alpha=0.3)
    times, in_flight = _in_flight(records)
    if len(times):
        queue_axis.step(times, in_flight, where="post", label="in flight (client)")
    if log is not None:
        for name in _SERVER_QUEUE_SERIES:
            series_times, values = log.series(name, start)
            if series_times:
                queue_axis.plot(series_times, values, label=name)
    queue_axis.set_xlabel("time since start (s)")
    queue_axis.set_ylabel("requests")
    queue_axis.legend(loc="upper right", fontsize=8)
    queue_axis.grid(alpha=0.3)
    return _save(figure, stem.with_name(stem.name + "_queue.png"))


def _kv(records: Sequence[RequestRecord], stem: Path, log: ScrapeLog, start: float) -> Path:
    figure, (kv_axis, latency_axis) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name in _SERVER_KV_SERIES:
        times, values = log.series(name, start)
        if times:
            kv_axis.plot(times, values, label=name)
    kv_axis.set_title("Engine KV cache and sequences beside latency")
    kv_axis.legend(loc="upper right", fontsize=8)
    kv_axis.grid(alpha=0.3)
    ok = [r for r in records if r.ttft_s is not None and r.sent_s is not None]
    latency_axis.scatter([r.sent_s for r in ok], [r.ttft_s * 1000.0 for r in ok], s=6)
    latency_axis.set_ylabel("TTFT (ms)")
    latency_axis.set_xlabel("time since start (s)")
    latency_axis.grid(alpha=0.3)
    return _save(figure, stem.with_name(stem.name + "_kv.png"))


def _has_any(log: ScrapeLog, names: Sequence[str]) -> bool:
    return any(log.series(name)[0] for name in names)
