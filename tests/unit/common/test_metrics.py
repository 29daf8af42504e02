"""The shared Prometheus metrics: names, the once-per-process server, and a real scrape."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common import metrics
from services.common.errors import InvalidArgumentError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _samples() -> dict[tuple[str, tuple], float]:
    text = generate_latest(REGISTRY).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_every_metric_has_the_service_prefix() -> None:
    names = [
        value for name, value in vars(metrics).items() if name.startswith(("ROUTER_", "ENGINE_"))
    ]
    assert len(names) >= 18
    for metric in names:
        service = (
            "sluice_router_" if metric._name.startswith("sluice_router_") else "sluice_engine_"
        )
        assert metric._name.startswith(service)


def test_values_set_by_services_appear_in_the_exposition() -> None:
    metrics.ROUTER_QUEUE_DEPTH_REQUESTS.set(7)
    metrics.ROUTER_REJECTED_REQUESTS.labels(reason="queue_full").inc(3)
    metrics.ENGINE_KV_BLOCKS_FREE.set(123)
    before = _samples().get(("sluice_engine_prefix_cache_hits_total", ()), 0.0)
    metrics.ENGINE_PREFIX_CACHE_HITS.inc(2)
    metrics.ROUTER_TIME_TO_FIRST_TOKEN.observe(0.04)
    found = _samples()
    assert found[("sluice_router_queue_depth_requests", ())] == 7
    assert found[("sluice_router_rejected_requests_total", (("reason", "queue_full"),))] >= 3
    assert found[("sluice_engine_kv_blocks_free", ())] == 123
    assert found[("sluice_engine_prefix_cache_hits_total", ())] == before + 2
    bucket = ("sluice_router_time_to_first_token_seconds_bucket", (("le", "0.05"),))
    assert found[bucket] >= 1


def test_no_port_means_no_server() -> None:
    metrics.start_metrics_server(None)
    metrics.start_metrics_server(0)
    assert metrics.metrics_port() is None


def test_bad_port_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError):
        metrics.start_metrics_server(70000)


def test_server_is_scraped_and_started_once() -> None:
    # A child process: the server is once per process, and this keeps the test process clean.
    port = _free_port()
    other = _free_port()
    script = textwrap.dedent(
        f"""
        import urllib.request
        from services.common import metrics
        from services.common.errors import InvalidArgumentError
        metrics.ENGINE_RUNNING_SEQUENCES.set(5)
        metrics.ENGINE_GENERATED_TOKENS.inc(11)
        metrics.start_metrics_server({port}, addr="127.0.0.1")
        metrics.start_metrics_server({port}, addr="127.0.0.1")
        try:
            metrics.start_metrics_server({other}, addr="127.0.0.1")
            raise SystemExit("second port accepted")
        except InvalidArgumentError:
            pass
        body = urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=5).read()
        print(body.decode())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(done.stdout)
        for sample in family.samples
    }
    assert values["sluice_engine_running_sequences"] == 5
    assert values["sluice_engine_generated_tokens_total"] == 11
