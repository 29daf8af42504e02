"""Prometheus metrics shared by the router and engine, and the HTTP endpoint that exposes them.

Every metric lives in prometheus_client's default registry as a module-level object, so the
service that owns a number imports the object and sets it; nothing here knows the services.
`start_metrics_server(port)` serves `/metrics` once per process (`--metrics-port`); the load
test harness (`loadtest/scrape.py`) scrapes it during a run and plots queue depth and KV use
beside latency.

Router (prefix `sluice_router_`):
- ``ROUTER_QUEUE_DEPTH_REQUESTS`` gauge `sluice_router_queue_depth_requests`: requests admitted
  and waiting for an engine.
- ``ROUTER_QUEUE_DEPTH_TOKENS`` gauge `sluice_router_queue_depth_tokens`: prompt tokens of those.
- ``ROUTER_ADMITTED_REQUESTS`` counter `sluice_router_admitted_requests_total`.
- ``ROUTER_REJECTED_REQUESTS`` counter `sluice_router_rejected_requests_total{reason}`; reasons
  are listed in ``REJECT_REASONS`` (queue_full, rate_limited, invalid, unauthenticated,
  deadline, unavailable, not_found, too_long, ...); any short snake_case reason is accepted.
- ``ROUTER_RUNNING_REQUESTS`` gauge `sluice_router_running_requests`: requests on an engine.
- ``ROUTER_FINISHED_REQUESTS`` counter `sluice_router_finished_requests_total{status}`: by final
  gRPC status name (OK, CANCELLED, ...).
- ``ROUTER_TIME_TO_FIRST_TOKEN`` histogram `sluice_router_time_to_first_token_seconds`.
- ``ROUTER_INTER_TOKEN_LATENCY`` histogram `sluice_router_inter_token_latency_seconds`.
- ``ROUTER_END_TO_END_LATENCY`` histogram `sluice_router_end_to_end_latency_seconds`.

Engine (prefix `sluice_engine_`; no labels: each engine worker is its own process and serves
its own `--metrics-port`):
- ``ENGINE_RUNNING_SEQUENCES`` / ``ENGINE_WAITING_SEQUENCES`` gauges.
- ``ENGINE_KV_BLOCKS_USED`` / ``ENGINE_KV_BLOCKS_FREE`` gauges.
- ``ENGINE_PREFIX_CACHE_QUERIES`` / ``ENGINE_PREFIX_CACHE_HITS`` counters (in blocks; hit rate =
  hits / queries).
- ``ENGINE_RESIDENT_ADAPTERS`` gauge: LoRA adapters loaded in slots.
- ``ENGINE_STEP_TIME`` histogram `sluice_engine_step_time_seconds`: one forward step.
- ``ENGINE_GENERATED_TOKENS`` counter `sluice_engine_generated_tokens_total`.
- ``ENGINE_PREEMPTIONS`` counter `sluice_engine_preemptions_total`.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from services.common.errors import InvalidArgumentError

REJECT_REASONS = (
    "queue_full",
    "rate_limited",
    "invalid",
    "unauthenticated",
    "deadline",
    "unavailable",
    "not_found",
    "too_long",
    "draining",
)

# One phase of the time to first token: a few hundred microseconds idle, tens of ms under load.
_PHASE_BUCKETS = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02,
    0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Latency buckets from 1 ms to 2 min: TTFT under load spans that whole range.
_LATENCY_BUCKETS = (
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
_INTER_TOKEN_BUCKETS = (
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

# ---- router -------------------------------------------------------------------------------
ROUTER_QUEUE_DEPTH_REQUESTS = Gauge(
    "sluice_router_queue_depth_requests", "Requests admitted and waiting for an engine."
)
ROUTER_QUEUE_DEPTH_TOKENS = Gauge(
    "sluice_router_queue_depth_tokens", "Prompt tokens of the requests waiting for an engine."
)
ROUTER_ADMITTED_REQUESTS = Counter(
    "sluice_router_admitted_requests", "Requests admitted into the router's queue."
)
ROUTER_REJECTED_REQUESTS = Counter(
    "sluice_router_rejected_requests", "Requests rejected before admission, by reason.", ["reason"]
)
ROUTER_RUNNING_REQUESTS = Gauge(
    "sluice_router_running_requests", "Requests placed on an engine and not yet finished."
)
ROUTER_STREAM_INTERVAL = Gauge(
    "sluice_router_stream_interval",
    "Tokens a streamed response gathers now (adaptive pacing: 1 below the message budget).",
)
ROUTER_STREAMED_TOKENS_PER_SECOND = Gauge(
    "sluice_router_streamed_tokens_per_second",
    "Tokens per second the router streams, as its adaptive pacing measures them.",
)
ROUTER_FINISHED_REQUESTS = Counter(
    "sluice_router_finished_requests", "Requests finished, by final gRPC status name.", ["status"]
)
ROUTER_TIME_TO_FIRST_TOKEN = Histogram(
    "sluice_router_time_to_first_token_seconds",
    "From the request's arrival at the router to its first streamed token.",
    buckets=_LATENCY_BUCKETS,
)
FIRST_TOKEN_PHASE_METRIC = "sluice_router_first_token_phase_seconds"
FIRST_TOKEN_PHASES = ("tokenize", "queue", "engine", "detokenize")  # its `phase` label
ROUTER_FIRST_TOKEN_PHASE = Histogram(
    FIRST_TOKEN_PHASE_METRIC,
    "Where time to first token went, by phase: tokenize (arrival to prompt ids; text and chat "
    "requests only), queue (to placement on an engine), engine (to the engine step with the "
    "first token), detokenize (to the first text, ready to stream).",
    ["phase"],
    buckets=_PHASE_BUCKETS,
)
ROUTER_INTER_TOKEN_LATENCY = Histogram(
    "sluice_router_inter_token_latency_seconds",
    "Between consecutive tokens streamed to a client (per token).",
    buckets=_INTER_TOKEN_BUCKETS,
)
ROUTER_END_TO_END_LATENCY = Histogram(
    "sluice_router_end_to_end_latency_seconds",
    "From the request's arrival at the router to its last response.",
    buckets=_LATENCY_BUCKETS,
)

# ---- engine -------------------------------------------------------------------------------
ENGINE_RUNNING_SEQUENCES = Gauge(
    "sluice_engine_running_sequences", "Sequences in the engine's running batch."
)
ENGINE_WAITING_SEQUENCES = Gauge(
    "sluice_engine_waiting_sequences", "Sequences waiting in the engine's scheduler."
)
ENGINE_KV_BLOCKS_USED = Gauge("sluice_engine_kv_blocks_used", "KV cache blocks held by sequences.")
ENGINE_KV_BLOCKS_FREE = Gauge("sluice_engine_kv_blocks_free", "KV cache blocks free to allocate.")
ENGINE_PREFIX_CACHE_QUERIES = Counter(
    "sluice_engine_prefix_cache_queries",
    "Prompt blocks looked up in the prefix cache.",
)
ENGINE_PREFIX_CACHE_HITS = Counter(
    "sluice_engine_prefix_cache_hits",
    "Prompt blocks found in the prefix cache (hit rate = hits / queries).",
)
ENGINE_RESIDENT_ADAPTERS = Gauge(
    "sluice_engine_resident_adapters", "LoRA adapters loaded in the engine's slots."
)
ENGINE_STEP_TIME = Histogram(
    "sluice_engine_step_time_seconds",
    "Wall time of one engine step (schedule, forward, sample).",
    buckets=_INTER_TOKEN_BUCKETS,
)
ENGINE_GENERATED_TOKENS = Counter(
    "sluice_engine_generated_tokens", "Tokens generated by the engine."
)
ENGINE_PREEMPTIONS = Counter("sluice_engine_preemptions", "Sequences preempted (recomputed later).")

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
