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
