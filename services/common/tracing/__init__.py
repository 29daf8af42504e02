"""Optional OpenTelemetry tracing of Sluice's hops, switched on by configuration.

Tracing attaches at the edges of each process, never inside service code:
- a gRPC server interceptor (`start_server` adds it): a SERVER span per call of a Sluice
  method (the client's W3C trace context, from the call's metadata, is its parent), and, on the
  batched session streams, one hop span per message that carries a request's first-token hop;
- a channel wrapper (`open_channel` applies it): the client's side of the same streams, and a
  CLIENT span that injects its trace context into the metadata of each per-request call;
- a step hook that the engine loop calls after each forward step: one span per step with the
  requests it took in.

Off unless `configure` is given a config that names an exporter, and then the OpenTelemetry
packages (the `tracing` extra) are imported; with tracing off nothing here is imported beyond
this file and no message pays anything. Settings (flag, then `SLUICE_*`, then default):

- `otlp_traces_endpoint`: send the per-call spans to this OTLP/gRPC collector (as vLLM's
  `--otlp-traces-endpoint`), e.g. `http://localhost:4317`.
- `trace_dir`: write every span as one JSON line to `<dir>/<service>-<pid>.jsonl`, including the
  hop and step spans (many per second under load, so they never go to a collector):
  `benchmarks/hop_report.py` reads them.
- `trace_sample_ratio`: the fraction of calls without a sampled parent that are traced; a call
  whose client sent a sampled trace context is always traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.common.config import field, from_layers
from services.common.errors import InvalidArgumentError

if TYPE_CHECKING:
    import grpc

    from services.common.tracing.runtime import Runtime


@dataclasses.dataclass(frozen=True)
class TracingConfig:
    """Where spans go; tracing is on when at least one destination is set."""

    otlp_traces_endpoint: str = field(
        "", help="OTLP/gRPC collector for the per-call spans, e.g. http://localhost:4317"
    )
    trace_dir: str = field(
        "", help="write every span, hop spans included, as JSON lines into this directory"
    )
    trace_sample_ratio: float = field(
        1.0, help="fraction of calls without a sampled parent trace that are traced (0-1)"
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise InvalidArgumentError(
                f"trace_sample_ratio must be in 0..1, got {self.trace_sample_ratio}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_traces_endpoint or self.trace_dir)

    @classmethod
    def from_environment(cls) -> TracingConfig:
        """The `SLUICE_*` settings (and defaults) of this process."""
        return from_layers(cls)


_runtime: Runtime | None = None


def configure(config: TracingConfig, service: str) -> None:
    """Switch tracing on for this process as `config` says (nothing happens when it is off).

    `service` names the process in the spans (`service.name`), e.g. "sluice-router". Called once
    at start-up, before the server and channels are made; a second call replaces the first.
    """
    global _runtime
    if not config.enabled:
        return
    from services.common.tracing.runtime import Runtime

    if _runtime is not None:
        _runtime.shutdown()
    _runtime = Runtime(config, service)


def shutdown() -> None:
    """Flush and stop this process's exporters (also done at interpreter exit)."""
    global _runtime
    if _runtime is not None:
        _runtime.shutdown()
        _runtime = None


def enabled() -> bool:
    return _runtime is not None


def server_interceptors() -> Sequence[grpc.aio.ServerInterceptor]:
    """The tracing interceptor for a gRPC server, or none when tracing is off."""
    if _runtime is None:
        return ()
    from services.common.tracing.grpc_edges import TracingServerInterceptor

    return (TracingServerInterceptor(_runtime),)


def traced_channel(channel: Any) -> Any:
    """`channel` (a grpc.aio channel), traced on its client side when tracing is on."""
    if _runtime is None:
        return channel
    from services.common.tracing.grpc_edges import TracedChannel

    return TracedChannel(channel, _runtime)


def step_hook() -> Any:
    """The engine loop's per-step hook (see services/engine/engine_loop.py), or None when off
    or when no hop spans are written."""
    if _runtime is None or not _runtime.hops:
        return None
    from services.common.tracing.step_spans import StepSpans

    return StepSpans(_runtime)
