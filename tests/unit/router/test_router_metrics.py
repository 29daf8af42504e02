"""The router's Prometheus metrics: names under `sluice_router_` and values in the exposition."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.router import metrics


def _samples() -> dict[tuple[str, tuple], float]:
    text = generate_latest(REGISTRY).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_every_router_metric_has_the_router_prefix() -> None:
    names = [value for name, value in vars(metrics).items() if name.startswith("ROUTER_")]
    assert len(names) >= 12
    for metric in names:
        assert metric._name.startswith("sluice_router_")
    assert metrics.FIRST_TOKEN_PHASE_METRIC.startswith("sluice_router_")


def test_values_set_by_the_router_appear_in_the_exposition() -> None:
    metrics.ROUTER_QUEUE_DEPTH_REQUESTS.set(7)
    metrics.ROUTER_REJECTED_REQUESTS.labels(reason="queue_full").inc(3)
    metrics.ROUTER_TIME_TO_FIRST_TOKEN.observe(0.04)
    metrics.ROUTER_FIRST_TOKEN_PHASE.labels(phase="queue").observe(0.002)
    found = _samples()
    assert found[("sluice_router_queue_depth_requests", ())] == 7
    assert found[("sluice_router_rejected_requests_total", (("reason", "queue_full"),))] >= 3
    bucket = ("sluice_router_time_to_first_token_seconds_bucket", (("le", "0.05"),))
    assert found[bucket] >= 1
    phase = (
        "sluice_router_first_token_phase_seconds_bucket",
        (("le", "0.002"), ("phase", "queue")),
    )
    assert found[phase] >= 1
