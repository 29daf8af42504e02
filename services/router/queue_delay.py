"""Admission by time: refuse a request at once when it could not start within the bound.

Counting queued requests says nothing about waiting: 1,000 short requests drain in a second on
a GPU, 50 long ones may take a minute. So before queueing, the router estimates how long a new
request of priority p would wait before its prefill starts, from what the engines report with
every step (services/engine/load_rates.py: prompt tokens not yet prefilled, prefill tokens per
second, requests finished per second) and from its own view (requests placed on each engine and
the free sequence slots; requests in its queue that go first, i.e. priority value <= p):

- slot wait: the request needs a sequence slot of an engine's running batch after the A
  requests queued ahead of it in the router and the W that wait inside the engines (an engine
  that time-slices LoRA slots takes several batches in flight; what it has not admitted into
  its batch waits there as surely as in the router's queue); with F free batch slots now and
  slots freeing at the engines' summed finish rate, it gets one after
  max(0, A + W + 1 - F) / finished_per_s. Where an engine has sequences paused for a LoRA slot
  turn, turns free batch room too, at a rate it does not report: there only the requests the
  router placed beyond its in-flight cap count, as for an engine that runs all it takes;
- prefill wait: the prompt tokens already queued at the engines (as their last reports say,
  plus those of the requests sent to them since: each step says how many of the router's
  submits its load counts, EngineStep.submits_taken) plus those of the requests ahead, over the
  engines' summed prefill rate.

The estimate is the larger of the two (they overlap in time). Over `max_queue_delay_s` the
request is refused with RESOURCE_EXHAUSTED and a retry-after of the excess (the time until the
queue ahead has shrunk to the bound). Before an engine has measured a rate there is no basis
for an estimate and nothing is refused on time (the count and token bounds still hold). Plain
Python, no gRPC: unit-tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.common.errors import ResourceExhaustedError

MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True)
class EngineLoadView:
    """One engine as the estimate sees it."""

    free_slots: int  # free slots of its running batch; negative: requests waiting for one
    queued_prompt_tokens: int
    prefill_tokens_per_s: float
    finished_per_s: float

    @classmethod
    def of_connection(cls, connection: Any) -> EngineLoadView:
        """From an engine_pool.EngineConnection: its capacity and its last reported load."""
        load = getattr(connection, "last_load", None)
        capacity = connection.capacity
        if load is None:
            return cls(capacity.free_slots, 0, 0.0, 0.0)
        # Sent to the engine after the load it reported: queued there, not in the report.
        unreported = getattr(connection, "unreported", (0, 0))
        free_slots = capacity.free_slots
        batch = min(capacity.slot_limit, capacity.max_num_seqs or capacity.slot_limit)
        if load.running <= batch:  # nothing paused for a slot turn: room comes by finishes
            inside = max(int(load.waiting) + unreported[0], capacity.inflight - int(load.running))
            free_slots = batch - int(load.running) - inside
        return cls(
            free_slots=free_slots,
            queued_prompt_tokens=int(load.queued_prompt_tokens) + unreported[1],
            prefill_tokens_per_s=float(load.prefill_tokens_per_s),
            finished_per_s=float(load.finished_per_s),
        )


@dataclass(frozen=True)
class DelayEstimate:
    """Seconds until a new request would start, and its parts."""

    delay_s: float
    slot_wait_s: float
    prefill_wait_s: float


def estimate_start_delay(
    engines: Iterable[EngineLoadView], ahead_requests: int, ahead_prompt_tokens: int
) -> DelayEstimate | None:
    """How long a new request waits for its prefill to start; None without measured rates."""
    free_slots = waiting = queued = 0
    prefill_rate = finish_rate = 0.0
    for engine in engines:
        free_slots += max(engine.free_slots, 0)
        waiting += max(-engine.free_slots, 0)
        queued += max(engine.queued_prompt_tokens, 0)
        prefill_rate += max(engine.prefill_tokens_per_s, 0.0)
        finish_rate += max(engine.finished_per_s, 0.0)
    short = max(ahead_requests + waiting + 1 - free_slots, 0)
    if short and finish_rate <= 0.0:
        return None
    slot_wait = short / finish_rate if short else 0.0
    tokens = queued + max(ahead_prompt_tokens, 0)
    if tokens and prefill_rate <= 0.0:
        return None
    prefill_wait = tokens / prefill_rate if tokens else 0.0
    return DelayEstimate(max(slot_wait, prefill_wait), slot_wait, prefill_wait)


class QueueDelayGate:
    """Refuses requests whose estimated start delay exceeds `max_delay_s` (0: off)."""

    def __init__(self, max_delay_s: float, *, min_retry_after_s: float = 1.0) -> None:
        if max_delay_s < 0:
            raise ValueError("max_delay_s must be >= 0")
        self.max_delay_s = max_delay_s
        self.min_retry_after_s = min_retry_after_s
        self.refused = 0
        self.last_estimate: DelayEstimate | None = None

    def check(
        self, connections: Iterable[Any], ahead_requests: int, ahead_prompt_tokens: int
    ) -> None:
        """Raise ResourceExhaustedError (with retry-after) when a request queued now behind
        `ahead_requests` requests of `ahead_prompt_tokens` prompt tokens could not start in
        time on the given engine connections."""
        if self.max_delay_s <= 0:
            return
        views = [EngineLoadView.of_connection(connection) for connection in connections]
        if not views:
            return
        estimate = estimate_start_delay(views, ahead_requests, ahead_prompt_tokens)
        self.last_estimate = estimate
        if estimate is None or estimate.delay_s <= self.max_delay_s:
            return
        self.refused += 1
        retry_after = min(
            max(self.min_retry_after_s, estimate.delay_s - self.max_delay_s), MAX_RETRY_AFTER_S
        )
        raise ResourceExhaustedError(
            f"the engines are busy: a new request would wait about {estimate.delay_s:.1f}s to "
            f"start (limit {self.max_delay_s:g}s); retry later",
            retry_after_s=retry_after,
        )
