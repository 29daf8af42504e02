"""Prometheus metrics of the engine worker, set after every forward-loop turn.

Runs on the engine thread (the only one that may read the engine). The metric objects live in
services/engine/metrics.py; running totals the engine keeps (preemptions, prefix-cache lookups)
become counter increments here.
"""

from __future__ import annotations

from typing import Any

from services.engine import metrics
from services.engine.engine_loop import LoopOutput


class MetricsRecorder:
    """Sets the ENGINE_* metrics after each loop turn (on the engine thread, which may read the
    engine). Counters the engine keeps as running totals are turned into increments."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._last: dict[str, int] = {}

    def record(self, output: LoopOutput) -> None:
        load = output.load
        metrics.ENGINE_RUNNING_SEQUENCES.set(load.running)
        metrics.ENGINE_WAITING_SEQUENCES.set(load.waiting)
        scheduler = getattr(self._engine, "scheduler", None)
        metrics.ENGINE_PAUSED_SEQUENCES.set(len(getattr(scheduler, "paused", ())))
        metrics.ENGINE_SWAPPED_SEQUENCES.set(getattr(scheduler, "num_swapped", 0))
        metrics.ENGINE_KV_BLOCKS_FREE.set(load.free_blocks)
        metrics.ENGINE_KV_BLOCKS_USED.set(load.total_blocks - load.free_blocks)
        metrics.ENGINE_RESIDENT_ADAPTERS.set(len(load.resident_adapters))
        if output.num_batched_tokens:
            metrics.ENGINE_STEP_TIME.observe(output.step_time_s)
        generated = sum(len(delta.new_token_ids) for delta in output.deltas)
        if generated:
            metrics.ENGINE_GENERATED_TOKENS.inc(generated)
        block_manager = getattr(self._engine, "block_manager", None)
        self._increment(metrics.ENGINE_PREEMPTIONS, "preemptions", self._engine, "num_preemptions")
        self._increment(metrics.ENGINE_SWAP_OUTS, "swap_outs", scheduler, "num_swap_outs")
        self._increment(
            metrics.ENGINE_PREFIX_CACHE_QUERIES, "queries", block_manager, "prefix_cache_queries"
        )
        self._increment(
            metrics.ENGINE_PREFIX_CACHE_HITS, "hits", block_manager, "prefix_cache_hits"
        )

    def _increment(self, counter: Any, key: str, owner: Any, attribute: str) -> None:
        total = getattr(owner, attribute, None)
        if not isinstance(total, int):
            return
        delta = total - self._last.get(key, 0)
        self._last[key] = total
        if delta > 0:
            counter.inc(delta)
