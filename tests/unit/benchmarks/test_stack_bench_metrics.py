"""The stack bench's mean engine batch, read from the engine's Prometheus endpoint."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server


def test_engine_batch_reads_the_step_and_token_counters_between_two_scrapes() -> None:
    """The stack bench's mean engine batch: tokens over steps, from a histogram's `_count` and
    a counter, counting only what happened between the window's two edges."""
    from prometheus_client import Counter

    from benchmarks.stack_bench import ENGINE_STEPS_METRIC, EngineBatch

    registry = CollectorRegistry()
    steps = Histogram("sluice_engine_step_time_seconds", "s", buckets=(0.01,), registry=registry)
    tokens = Counter("sluice_engine_generated_tokens", "t", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        batch = EngineBatch(f"http://127.0.0.1:{server.server_port}/metrics")
        for _ in range(5):  # before the window: must not count
            steps.observe(0.001)
            tokens.inc(1)
        batch.snapshot()
        assert batch.tokens_per_step() is None  # one edge only
        for _ in range(4):
            steps.observe(0.002)
            tokens.inc(60)
        batch.snapshot()
    finally:
        server.shutdown()
        thread.join(5)
    assert batch.snapshots[-1][ENGINE_STEPS_METRIC] == 9.0
    assert batch.tokens_per_step() == pytest.approx(60.0)
    batch.snapshots.append(dict(batch.snapshots[-1]))  # no step in between: no batch to give
    assert batch.tokens_per_step() is None
    batch.snapshot()  # the endpoint is gone: a warning and no figure, never a wrong one
    assert batch.snapshots[-1] == {} and batch.tokens_per_step() is None


def test_engine_batch_reads_the_names_the_engine_exports() -> None:
    from benchmarks.stack_bench import ENGINE_STEPS_METRIC, ENGINE_TOKENS_METRIC
    from services.engine import metrics

    exported = {
        sample.name
        for metric in (metrics.ENGINE_STEP_TIME, metrics.ENGINE_GENERATED_TOKENS)
        for family in metric.collect()
        for sample in family.samples
    }
    assert {ENGINE_STEPS_METRIC, ENGINE_TOKENS_METRIC} <= exported
