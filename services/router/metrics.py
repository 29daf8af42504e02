"""The router's Prometheus metrics (prefix `sluice_router_`).

Module-level objects in prometheus_client's default registry, set by the router's core, servicer
and streaming code and served by `services.common.metrics.start_metrics_server`.

- ``ROUTER_QUEUE_DEPTH_REQUESTS`` gauge `sluice_router_queue_depth_requests`: requests admitted
  and waiting for an engine.
- ``ROUTER_QUEUE_DEPTH_TOKENS`` gauge `sluice_router_queue_depth_tokens`: prompt tokens of those.
- ``ROUTER_ADMITTED_REQUESTS`` counter `sluice_router_admitted_requests_total`.
- ``ROUTER_REJECTED_REQUESTS`` counter `sluice_router_rejected_requests_total{reason}`; reasons
  are listed in ``REJECT_REASONS`` (queue_full, rate_limited, invalid, unauthenticated,
  deadline, unavailable, not_found, too_long, ...); any short snake_case reason is accepted.
- ``ROUTER_RUNNING_REQUESTS`` gauge `sluice_router_running_requests`: requests on an engine.
- ``ROUTER_ESTIMATED_START_DELAY`` gauge `sluice_router_estimated_start_delay_seconds`: with
  admission by time (`--max-queue-delay-s`), how long the last request checked would wait for
  its prefill to start (queue_delay.py), admitted or refused.
- ``ROUTER_STREAM_INTERVAL`` / ``ROUTER_STREAMED_TOKENS_PER_SECOND`` gauges: adaptive pacing.
- ``ROUTER_FINISHED_REQUESTS`` counter `sluice_router_finished_requests_total{status}`: by final
  gRPC status name (OK, CANCELLED, ...).
- ``ROUTER_TIME_TO_FIRST_TOKEN`` histogram `sluice_router_time_to_first_token_seconds`.
- ``ROUTER_FIRST_TOKEN_PHASE`` histogram `sluice_router_first_token_phase_seconds{phase}`, the
  phases in ``FIRST_TOKEN_PHASES``.
- ``ROUTER_INTER_TOKEN_LATENCY`` histogram `sluice_router_inter_token_latency_seconds`.
- ``ROUTER_END_TO_END_LATENCY`` histogram `sluice_router_end_to_end_latency_seconds`.
- ``ADAPTER_GAUGES`` (`AdapterGauges`, computed at scrape time) gauges
  `sluice_router_adapter_queue_depth_requests{adapter}` and
  `sluice_router_adapter_resident_engines{adapter}`: per registered LoRA adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from services.common.metrics import INTER_TOKEN_BUCKETS_S, LATENCY_BUCKETS_S

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
_PHASE_BUCKETS_S = (
    0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02,
    0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

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
ROUTER_ESTIMATED_START_DELAY = Gauge(
    "sluice_router_estimated_start_delay_seconds",
    "Seconds the last request checked by admission by time would wait for its prefill to start.",
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
    buckets=LATENCY_BUCKETS_S,
)
FIRST_TOKEN_PHASE_METRIC = "sluice_router_first_token_phase_seconds"
FIRST_TOKEN_PHASES = ("tokenize", "queue", "engine", "detokenize")  # its `phase` label
ROUTER_FIRST_TOKEN_PHASE = Histogram(
    FIRST_TOKEN_PHASE_METRIC,
    "Where time to first token went, by phase: tokenize (arrival to prompt ids; text and chat "
    "requests only), queue (to placement on an engine), engine (to the engine step with the "
    "first token), detokenize (to the first text, ready to stream).",
    ["phase"],
    buckets=_PHASE_BUCKETS_S,
)
ROUTER_INTER_TOKEN_LATENCY = Histogram(
    "sluice_router_inter_token_latency_seconds",
    "Between consecutive tokens streamed to a client (per token).",
    buckets=INTER_TOKEN_BUCKETS_S,
)
ROUTER_END_TO_END_LATENCY = Histogram(
    "sluice_router_end_to_end_latency_seconds",
    "From the request's arrival at the router to its last response.",
    buckets=LATENCY_BUCKETS_S,
)


@dataclass(frozen=True)
class AdapterReport:
    """What the adapter gauges show: registered names, queued requests and resident engines."""

    adapters: list[str]
    queued: dict[str, int]
    resident_engines: dict[str, int]


class AdapterGauges:
    """Per-adapter gauges computed when Prometheus scrapes, so requests pay nothing for them.

    `sluice_router_adapter_queue_depth_requests{adapter}`: requests of the adapter waiting in
    the router; `sluice_router_adapter_resident_engines{adapter}`: engines holding it in a device
    slot. One series per registered adapter; a removed adapter's series go with it.
    """

    def __init__(self) -> None:
        self._source: Callable[[], AdapterReport] | None = None

    def bind(self, source: Callable[[], AdapterReport]) -> None:
        self._source = source

    def unbind(self, source: Callable[[], AdapterReport]) -> None:
        if self._source == source:
            self._source = None

    def describe(self) -> list[GaugeMetricFamily]:
        return self._families(None)

    def collect(self) -> list[GaugeMetricFamily]:
        source = self._source
        report = None
        if source is not None:
            try:
                report = source()
            except RuntimeError:  # the router changed a table while this thread read it
                report = None
        return self._families(report)

    @staticmethod
    def _families(report: AdapterReport | None) -> list[GaugeMetricFamily]:
        depth = GaugeMetricFamily(
            "sluice_router_adapter_queue_depth_requests",
            "Requests of a LoRA adapter waiting in the router for an engine.",
            labels=["adapter"],
        )
        resident = GaugeMetricFamily(
            "sluice_router_adapter_resident_engines",
            "Engines where a LoRA adapter is resident in a device slot.",
            labels=["adapter"],
        )
        if report is not None:
            for name in report.adapters:
                depth.add_metric([name], report.queued.get(name, 0))
                resident.add_metric([name], report.resident_engines.get(name, 0))
        return [depth, resident]


ADAPTER_GAUGES = AdapterGauges()
REGISTRY.register(ADAPTER_GAUGES)
