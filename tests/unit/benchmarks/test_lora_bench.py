"""lora_bench's eager A/B times each runtime setting against the same step on the base model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import lora_bench
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence


def _batch(lengths: list[int]) -> ScheduledBatch:
    return ScheduledBatch(
        [
            ScheduledSequence(index, [1] * length, 0, [index], True)
            for index, length in enumerate(lengths)
        ]
    )


def test_eager_ab_times_every_variant_and_the_base_step_and_restores_the_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer = object()
    long_runs: set[bool] = set()
    runtime = SimpleNamespace(
        write_tile_deltas=True,
        long_segment_rows=lora_bench.LONG_SEGMENT_ROWS,
        tile_consumer=None,
        consumer_takes_long_runs=True,
    )
    adapters = SimpleNamespace(runtime=runtime, begin_step=lambda batch: None)
    steps: list[tuple] = []

    def execute_greedy(batch: ScheduledBatch) -> None:
        slots = tuple(seq.adapter_slot for seq in batch.sequences)
        steps.append((slots, runtime.write_tile_deltas, runtime.long_segment_rows))
        long_runs.add(runtime.consumer_takes_long_runs)

    def modelled_ms(step, iterations: int, sync, warmup: int = 3) -> float:
        """A step's modelled cost: 100 ms on the base model; with adapter rows 10 % more,
        5 % more again where deltas are added after, 3 % less where SwiGLU takes them, 1 %
        less again where it takes the long runs' too."""
        step()
        slots, write, _ = steps[-1]
        if all(slot == -1 for slot in slots):
            return 100.0
        cost = 110.0 * (1.0 if write else 1.05)
        if runtime.tile_consumer is consumer:
            cost *= 0.97 * (0.99 if runtime.consumer_takes_long_runs else 1.0)
        return cost

    monkeypatch.setattr(lora_bench, "time_steps", modelled_ms)
    runner = SimpleNamespace(fast=SimpleNamespace(ops=consumer), execute_greedy=execute_greedy)
    batches = {"prefill": _batch([8, 8]), "mixed": _batch([8, 1, 1])}
    report = lora_bench.eager_ab(adapters, runner, batches, lambda: None, 2, rounds=3)

    assert report["base_ms"] == {"prefill": 100.0, "mixed": 100.0}
    assert set(report["variants"]) == set(lora_bench.EAGER_VARIANTS)
    for label in batches:
        ratios = report["ratio_to_base"][label]
        assert set(ratios) == set(lora_bench.EAGER_VARIANTS)
        assert ratios["deltas_first"] == 1.1
        assert ratios["fused_swiglu"] == round(1.1 * 0.97 * 0.99, 3)
        assert ratios["fused_swiglu_short_runs_only"] == round(1.1 * 0.97, 3)
        assert ratios["tiles_added_after"] == round(1.1 * 1.05, 3)
    # every step of every round ran, each prompt on an adapter of its own and decode rows on
    # the 16 slots in turn; the base steps on no adapter
    assert len(steps) == 3 * len(batches) * (1 + len(lora_bench.EAGER_VARIANTS))
    assert {slots for slots, _, _ in steps} == {(-1, -1), (0, 1), (-1, -1, -1), (0, 1, 2)}
    thresholds = {threshold for _, _, threshold in steps}
    assert thresholds == {lora_bench.LONG_SEGMENT_ROWS, 512, 1024, 4096}
    assert long_runs == {True, False}
    assert runtime.write_tile_deltas
    assert runtime.long_segment_rows == lora_bench.LONG_SEGMENT_ROWS
    assert runtime.tile_consumer is None and runtime.consumer_takes_long_runs
