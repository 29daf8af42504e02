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
  its batch waits there as surely as in the router's queue); with F free batch slots now it
  waits for the K = A + W + 1 - F-th slot to free. When that is: each engine reports the steps
  until each running sequence reaches its token limit (a sampled profile:
  services/common/protocol/finish_profile.py), how often a sequence stops earlier (stop
  tokens, aborts: a hazard per generated token) and its rates, from which a step's time is its
  batch over its decode tokens/s. By t seconds an engine has freed the slots of the sequences
  whose limit falls within t / step and, of the others, the share 1 - (1 - hazard)^(t / step)
  that stopped early; the wait is the t at which the engines' freed slots reach K (found by
  bisection), and past the last limit, the rest at the summed finish rate. Where outputs end
  at their limits (lengths set by max_tokens, as in load tests) this follows the waves in
  which requests that started together finish together, which a rate cannot; where most stop
  early it comes to K / finished_per_s. An engine that reports no profile (older engines), or
  one with sequences paused for a LoRA slot turn (turns free batch room at a rate it does not
  report; there only the requests the router placed beyond its in-flight cap count), gives
  K / finished_per_s over all engines;
- prefill wait: the prompt tokens already queued at the engines (as their last reports say,
  plus those of the requests sent to them since: each step says how many of the router's
  submits its load counts, EngineStep.submits_taken) plus those of the requests ahead, over the
  engines' summed prefill rate.

The estimate is the larger of the two (they overlap in time). Over `max_queue_delay_s` the
request is refused with RESOURCE_EXHAUSTED and a retry-after of the excess (the time until the
queue ahead has shrunk to the bound); every estimate is the gauge
`sluice_router_estimated_start_delay_seconds`. Before an engine has measured a rate there is
no basis for an estimate and nothing is refused on time (the count and token bounds still
hold); nor while no request has finished yet: the limits are upper bounds, and how often
sequences stop before them is not known until some have ended. Plain Python, no gRPC:
unit-tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import ResourceExhaustedError
from services.common.protocol import finish_profile
from services.router import metrics

MAX_RETRY_AFTER_S = 60.0


# Bisection steps for the time the K-th slot frees: the bracket (up to the last limit) shrinks
# 2^20-fold, a millisecond or less for waits up to 15 minutes.
BISECTION_STEPS = 20


@dataclass(frozen=True)
class EngineLoadView:
    """One engine as the estimate sees it."""

    free_slots: int  # free slots of its running batch; negative: requests waiting for one
    queued_prompt_tokens: int
    prefill_tokens_per_s: float
    finished_per_s: float
    # When its batch slots free (finish_profile): steps until each running sequence reaches its
    # token limit, sampled, and how many sequences that describes; the seconds a step takes;
    # the chance a running sequence stops early at a step. `profiled` False: no profile to go
    # by (an older engine, or sequences paused for slot turns): the finish rate decides.
    finish_steps: tuple[int, ...] = ()
    finish_steps_of: int = 0
    step_s: float = 0.0
    stop_hazard: float = 0.0
    profiled: bool = False
    finish_ranks: tuple[int, ...] = field(init=False, default=())  # the profile's ranks

    def __post_init__(self) -> None:
        ranks = finish_profile.profile_ranks(self.finish_steps_of, len(self.finish_steps))
        object.__setattr__(self, "finish_ranks", tuple(ranks))

    def freed_by(self, seconds: float) -> float:
        """Slots of the running batch expected free `seconds` from now."""
        count = self.finish_steps_of
        if count <= 0:
            return 0.0
        steps = seconds / self.step_s
        reached = finish_profile.reached_by(self.finish_steps, count, steps, self.finish_ranks)
        if self.stop_hazard <= 0.0:
            return reached
        stopped = 1.0 - (1.0 - min(self.stop_hazard, 1.0)) ** steps
        return reached + (count - reached) * stopped

    @property
    def last_limit_s(self) -> float:
        """Seconds until every running sequence has reached its token limit."""
        return self.finish_steps[-1] * self.step_s if self.finish_steps_of > 0 else 0.0

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
        profile: dict[str, Any] = {}
        if load.running <= batch:  # nothing paused for a slot turn: room comes by finishes
            inside = max(int(load.waiting) + unreported[0], capacity.inflight - int(load.running))
            free_slots = batch - int(load.running) - inside
            profile = _profile_of(load)
        return cls(
            free_slots=free_slots,
            queued_prompt_tokens=int(load.queued_prompt_tokens) + unreported[1],
            prefill_tokens_per_s=float(load.prefill_tokens_per_s),
            finished_per_s=float(load.finished_per_s),
            **profile,
        )


def _profile_of(load: Any) -> dict[str, Any]:
    """The finish-profile fields of a reported load, or none where it cannot be used."""
    count = int(load.finish_steps_of)
    if count <= 0:  # profiled only when nothing runs (an older engine reports no profile)
        return {"profiled": True} if int(load.running) == 0 else {}
    decode_rate = float(load.decode_tokens_per_s)
    if decode_rate <= 0.0:
        return {}
    values = tuple(int(value) for value in load.finish_steps)
    return {
        "finish_steps": values,
        "finish_steps_of": count,
        "step_s": count / decode_rate,
        "stop_hazard": max(float(load.stop_hazard), 0.0),
        "profiled": True,
    }


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
    views = list(engines)
    free_slots = waiting = queued = 0
    prefill_rate = finish_rate = 0.0
    for engine in views:
        free_slots += max(engine.free_slots, 0)
        waiting += max(-engine.free_slots, 0)
        queued += max(engine.queued_prompt_tokens, 0)
        prefill_rate += max(engine.prefill_tokens_per_s, 0.0)
        finish_rate += max(engine.finished_per_s, 0.0)
    short = max(ahead_requests + waiting + 1 - free_slots, 0)
    slot_wait = 0.0
    if short:
        if finish_rate <= 0.0:  # nothing finished yet: no basis for the hazard either
            return None
        profiled = profile_wait(views, short, finish_rate)
        slot_wait = short / finish_rate if profiled is None else profiled
    tokens = queued + max(ahead_prompt_tokens, 0)
    if tokens and prefill_rate <= 0.0:
        return None
    prefill_wait = tokens / prefill_rate if tokens else 0.0
    return DelayEstimate(max(slot_wait, prefill_wait), slot_wait, prefill_wait)


def profile_wait(engines: list[EngineLoadView], slots: int, finish_rate: float) -> float | None:
    """Seconds until `slots` batch slots have freed on `engines` by their finish profiles;
    None when an engine has none (or the wait runs past every limit with no finish rate)."""
    if not engines or not all(engine.profiled for engine in engines):
        return None
    running = sum(engine.finish_steps_of for engine in engines)
    last_s = max(engine.last_limit_s for engine in engines)
    if slots > running:  # more than the batches hold: the rest at the rate they finish
        return last_s + (slots - running) / finish_rate if finish_rate > 0.0 else None
    low, high = 0.0, last_s
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if sum(engine.freed_by(middle) for engine in engines) >= slots:
            high = middle
        else:
            low = middle
    return high


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
        if estimate is not None:
            metrics.ROUTER_ESTIMATED_START_DELAY.set(estimate.delay_s)
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
