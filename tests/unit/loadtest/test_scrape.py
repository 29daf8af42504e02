"""Scraping Prometheus text during a run."""

from __future__ import annotations

import time

from loadtest.scrape import Scraper, parse_metrics
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
