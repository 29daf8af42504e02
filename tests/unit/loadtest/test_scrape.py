"""Scraping Prometheus text during a run."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from loadtest.scrape import Scraper, parse_metrics, scrape_histogram, window_quantile
from tests.unit.loadtest.sse_fixture_server import OpenAIFixtureServer

_TEXT = """# HELP sluice_router_queue_depth_requests q
# TYPE sluice_router_queue_depth_requests gauge
sluice_router_queue_depth_requests 3.0
# HELP sluice_router_rejected_requests_total r
# TYPE sluice_router_rejected_requests_total counter
sluice_router_rejected_requests_total{reason="queue_full"} 2.0
sluice_router_rejected_requests_total{reason="invalid"} 1.0
# HELP sluice_router_end_to_end_latency_seconds e
# TYPE sluice_router_end_to_end_latency_seconds histogram
sluice_router_end_to_end_latency_seconds_bucket{le="1.0"} 4.0
sluice_router_end_to_end_latency_seconds_count 4.0
sluice_router_end_to_end_latency_seconds_sum 1.5
"""


def test_parse_keeps_gauges_and_counters_not_histograms() -> None:
    values = parse_metrics(_TEXT)
    assert values == {
        "sluice_router_queue_depth_requests": 3.0,
        'sluice_router_rejected_requests_total{reason="invalid"}': 1.0,
        'sluice_router_rejected_requests_total{reason="queue_full"}': 2.0,
    }


def test_scraper_polls_a_live_endpoint_and_sums_series() -> None:
    with OpenAIFixtureServer() as server:
        scraper = Scraper([f"{server.url}/metrics", "http://127.0.0.1:9/metrics"], 0.05)
        start = time.time()
        scraper.start()
        time.sleep(0.3)
        log = scraper.stop()
    times, values = log.series("sluice_engine_kv_blocks_used", start)
    assert len(times) >= 3
    assert values == [0.0] * len(values)
    assert all(0 <= t < 1.0 for t in times)
    assert log.failures >= 3  # the dead URL is counted, not fatal
    data = log.to_json(start)
    assert data["scrapes"][0]["values"]["sluice_router_queue_depth_requests"] == 0.0


INF = float("inf")


def test_window_quantile_reads_only_what_was_observed_between_two_scrapes() -> None:
    before = [(0.001, 10.0), (0.002, 10.0), (0.004, 10.0), (INF, 10.0)]  # 10 fast ones earlier
    after = [(0.001, 10.0), (0.002, 14.0), (0.004, 20.0), (INF, 20.0)]  # then 4 + 6 more
    # 10 in the window: the median (rank 5) lies one sixth into the 6 of the (2, 4] ms bucket.
    assert window_quantile(before, after, 0.5) == pytest.approx(0.002 + 0.002 / 6)
    assert window_quantile(before, after, 0.2) == pytest.approx(0.0015)  # rank 2 of (1, 2]
    assert window_quantile([], [(0.001, 4.0), (INF, 4.0)], 0.5) == pytest.approx(0.0005)
    assert window_quantile(after, after, 0.5) is None  # nothing observed in the window
    assert window_quantile([], [(0.001, 0.0), (INF, 2.0)], 0.5) == pytest.approx(0.001)


def test_scrape_histogram_groups_buckets_by_label_from_a_live_endpoint() -> None:
    registry = CollectorRegistry()
    phase = Histogram("t_phase_seconds", "t", ["phase"], buckets=(0.001, 0.01), registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        before = scrape_histogram(url, "t_phase_seconds", "phase")
        for seconds in (0.0005, 0.005, 0.005, 0.5):
            phase.labels(phase="engine").observe(seconds)
        phase.labels(phase="queue").observe(0.0002)
        after = scrape_histogram(url, "t_phase_seconds", "phase")
    finally:
        server.shutdown()
        thread.join(5)
    assert before == {}
    assert after["engine"] == [(0.001, 1.0), (0.01, 3.0), (INF, 4.0)]
    assert after["queue"] == [(0.001, 1.0), (0.01, 1.0), (INF, 1.0)]
    median = window_quantile(before.get("engine", []), after["engine"], 0.5)
    assert median == pytest.approx(0.001 + 0.009 / 2)
