"""The shared /metrics endpoint: served once per process, scraped for real; no service metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from services.common import metrics
from services.common.errors import InvalidArgumentError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_common_declares_no_service_metric() -> None:
    # Router and engine metrics live with their service (services/router|engine/metrics.py).
    declared = [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]
    assert declared == []


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
        from services.engine import metrics as engine_metrics
        engine_metrics.ENGINE_RUNNING_SEQUENCES.set(5)
        engine_metrics.ENGINE_GENERATED_TOKENS.inc(11)
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
