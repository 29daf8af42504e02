"""The Prometheus endpoint every service shares, and the histogram buckets both services use.

Each service declares its own metric objects beside its code (`services/router/metrics.py`,
`services/engine/metrics.py`) in prometheus_client's default registry; this module knows none
of them. `start_metrics_server(port)` serves that registry at `/metrics` once per process
(`--metrics-port`); the load test harness (`loadtest/scrape.py`) scrapes it during a run and
plots queue depth and KV use beside latency.
"""

from __future__ import annotations

import threading

from prometheus_client import start_http_server

from services.common.errors import InvalidArgumentError

# Latency buckets from 1 ms to 2 min: time to first token under load spans that whole range.
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
# Buckets from 0.5 ms to 2.5 s: the gap between two tokens, or one engine step.
INTER_TOKEN_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
)

_server_lock = threading.Lock()
_server_port: int | None = None


def start_metrics_server(port: int | None, addr: str = "0.0.0.0") -> None:
    """Serve `/metrics` on `port` once per process; None or 0 does nothing.

    A second call with the same port is a no-op; a second call with another port is refused,
    because one registry is served once.
    """
    global _server_port
    if not port:
        return
    if not 0 < port < 65536:
        raise InvalidArgumentError(f"metrics port must be in 1..65535, got {port}")
    with _server_lock:
        if _server_port is not None:
            if _server_port != port:
                raise InvalidArgumentError(
                    f"metrics server already serving on port {_server_port}, not {port}"
                )
            return
        start_http_server(port, addr=addr)
        _server_port = port


def metrics_port() -> int | None:
    """The port this process serves metrics on, or None."""
    return _server_port
