"""The engine's Prometheus metrics: names under `sluice_engine_` and values in the exposition."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.engine import metrics


def _samples() -> dict[tuple[str, tuple], float]:
    text = generate_latest(REGISTRY).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_every_engine_metric_has_the_engine_prefix() -> None:
    names = [value for name, value in vars(metrics).items() if name.startswith("ENGINE_")]
    assert len(names) >= 10
    for metric in names:
        assert metric._name.startswith("sluice_engine_")


def test_values_set_by_the_engine_appear_in_the_exposition() -> None:
    metrics.ENGINE_KV_BLOCKS_FREE.set(123)
    before = _samples().get(("sluice_engine_prefix_cache_hits_total", ()), 0.0)
    metrics.ENGINE_PREFIX_CACHE_HITS.inc(2)
    metrics.ENGINE_STEP_TIME.observe(0.004)
    found = _samples()
    assert found[("sluice_engine_kv_blocks_free", ())] == 123
    assert found[("sluice_engine_prefix_cache_hits_total", ())] == before + 2
    assert found[("sluice_engine_step_time_seconds_bucket", (("le", "0.005"),))] >= 1


def test_the_recorder_sets_paused_sequences_from_the_scheduler() -> None:
    """Sequences paused for a LoRA slot turn show as their own gauge beside running (which
    counts them too), so an operator sees slot pressure; an engine without a scheduler's
    paused list (another runner's engine) reads 0."""
    from types import SimpleNamespace

    from services.engine.server_metrics import MetricsRecorder

    load = SimpleNamespace(
        running=5, waiting=2, free_blocks=10, total_blocks=40, resident_adapters=("a",)
    )
    output = SimpleNamespace(load=load, num_batched_tokens=0, deltas=[])
    engine = SimpleNamespace(scheduler=SimpleNamespace(paused=[object(), object(), object()]))
    MetricsRecorder(engine).record(output)
    found = _samples()
    assert found[("sluice_engine_paused_sequences", ())] == 3
    assert found[("sluice_engine_running_sequences", ())] == 5
    MetricsRecorder(SimpleNamespace()).record(output)
    assert _samples()[("sluice_engine_paused_sequences", ())] == 0


def test_the_recorder_counts_sequences_swapped_to_host_memory() -> None:
    """Paused sequences whose KV is in host memory (swap space) get their own gauge, and the
    moves there a counter, from the scheduler's running total."""
    from types import SimpleNamespace

    from services.engine.server_metrics import MetricsRecorder

    load = SimpleNamespace(
        running=4, waiting=0, free_blocks=1, total_blocks=40, resident_adapters=()
    )
    output = SimpleNamespace(load=load, num_batched_tokens=0, deltas=[])
    scheduler = SimpleNamespace(paused=[object()] * 3, num_swapped=2, num_swap_outs=5)
    recorder = MetricsRecorder(SimpleNamespace(scheduler=scheduler))
    before = _samples().get(("sluice_engine_kv_swap_outs_total", ()), 0.0)
    recorder.record(output)
    scheduler.num_swap_outs = 7
    recorder.record(output)
    found = _samples()
    assert found[("sluice_engine_swapped_sequences", ())] == 2
    assert found[("sluice_engine_kv_swap_outs_total", ())] == before + 7
