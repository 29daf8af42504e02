"""A span exporter that appends each span as one JSON line to `<dir>/<service>-<pid>.jsonl`.

For benchmarks: `benchmarks/hop_report.py` reads the files of all processes of a run and joins
their spans. Span times are OpenTelemetry's (`time.time_ns()`), one clock for every process of
a machine. One line:

    {"name": ..., "kind": "SERVER", "trace_id": "<32 hex>", "span_id": "<16 hex>",
     "parent_span_id": "<16 hex>" | null, "start_ns": ..., "end_ns": ...,
     "service": "sluice-router", "pid": 1234, "attributes": {...},
     "events": [{"name": ..., "time_ns": ..., "attributes": {...}}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class JsonLinesSpanExporter(SpanExporter):
    """Writes each batch of spans with one `write` (see the module docstring)."""

    def __init__(self, directory: str, service: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{service}-{os.getpid()}.jsonl")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_record(span)) + "\n" for span in spans)
        if text:
            # Opened per batch (a few times a second at most): no descriptor to close, and a
            # process that forks never shares one.
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing is held open."""


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the JSON object of a line."""
    context = span.context
    parent = span.parent
    resource = span.resource.attributes if span.resource is not None else {}
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "service": resource.get("service.name"),
        "pid": resource.get("process.pid"),
        "attributes": _plain(span.attributes),
        "events": [
            {"name": event.name, "time_ns": event.timestamp, "attributes": _plain(event.attributes)}
            for event in span.events
        ],
    }


def _plain(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in (attributes or {}).items()
    }
