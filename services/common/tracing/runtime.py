"""The OpenTelemetry side of tracing: tracer providers, sampler and exporters of one process.

Imported only when tracing is switched on (services/common/tracing/__init__.py), so the
OpenTelemetry packages stay an optional extra (`pip install 'sluice[tracing]'`).

Two tracers:
- `calls`: one span per call (router Generate, Info, ...), sampled parent-based (a call whose
  client sent a sampled W3C trace context is traced; one without is traced with
  `trace_sample_ratio`), exported to the OTLP collector and to the JSON-lines directory.
- `hops` (only with `trace_dir`): the hop spans of the batched streams and the engine's step
  spans, always recorded, written to the JSON-lines directory only: they come at hundreds per
  second, one trace each, and would swamp a collector.
"""

from __future__ import annotations

import os

from services.common.errors import FailedPreconditionError
from services.common.tracing import TracingConfig

try:
    from opentelemetry import trace
    from opentelemetry.propagators.textmap import DefaultGetter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise FailedPreconditionError(
        "tracing is switched on but OpenTelemetry is not installed: pip install 'sluice[tracing]'"
    ) from exc

from services.common.tracing.jsonl import JsonLinesSpanExporter

# A span waits at most this long in memory before it is written: a process killed without its
# exit handlers loses at most this much.
EXPORT_DELAY_MS = 200
INSTRUMENTATION = "sluice"


class Runtime:
    """The tracers of this process and their exporters."""

    def __init__(
        self,
        config: TracingConfig,
        service: str,
        *,
        exporters: tuple[SpanExporter, ...] = (),
        hop_exporters: tuple[SpanExporter, ...] = (),
    ) -> None:
        """`exporters` / `hop_exporters` replace the configured ones (tests pass in-memory
        exporters; a hop exporter switches the hop spans on)."""
        self.config = config
        self.service = service
        resource = Resource.create({"service.name": service, "process.pid": os.getpid()})
        self.propagator = TraceContextTextMapPropagator()
        self.getter = DefaultGetter()
        if not exporters and not hop_exporters:
            exporters, hop_exporters = _configured_exporters(config, service)
        sampler = ParentBased(TraceIdRatioBased(config.trace_sample_ratio))
        self._calls_provider = TracerProvider(sampler=sampler, resource=resource)
        for exporter in exporters:
            self._calls_provider.add_span_processor(_processor(exporter))
        self.calls = self._calls_provider.get_tracer(INSTRUMENTATION)
        self._hops_provider: TracerProvider | None = None
        self.hops: trace.Tracer | None = None
        if hop_exporters:
            self._hops_provider = TracerProvider(sampler=ALWAYS_ON, resource=resource)
            for exporter in hop_exporters:
                self._hops_provider.add_span_processor(_processor(exporter))
            self.hops = self._hops_provider.get_tracer(INSTRUMENTATION)

    def force_flush(self) -> None:
        for provider in (self._calls_provider, self._hops_provider):
            if provider is not None:
                provider.force_flush()

    def shutdown(self) -> None:
        for provider in (self._calls_provider, self._hops_provider):
            if provider is not None:
                provider.shutdown()


def _processor(exporter: SpanExporter) -> BatchSpanProcessor:
    return BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS)


def _configured_exporters(
    config: TracingConfig, service: str
) -> tuple[tuple[SpanExporter, ...], tuple[SpanExporter, ...]]:
    calls: list[SpanExporter] = []
    hops: list[SpanExporter] = []
    if config.otlp_traces_endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise FailedPreconditionError(
                "otlp_traces_endpoint needs the OTLP exporter: pip install 'sluice[tracing]'"
            ) from exc
        calls.append(OTLPSpanExporter(endpoint=config.otlp_traces_endpoint))
    if config.trace_dir:
        # One file per process, shared by both tracers (each write is one whole batch).
        files = JsonLinesSpanExporter(config.trace_dir, service)
        calls.append(files)
        hops.append(files)
    return tuple(calls), tuple(hops)
