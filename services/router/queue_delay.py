"""Admission by time: refuse a request at once when it could not start within the bound.

Counting queued requests says nothing about waiting: 1,000 short requests drain in a second on
a GPU, 50 long ones may take a minute. So before queueing, the router estimates how long a new
request of priority p would wait before its prefill starts, from what the engines report with
every step (services/engine/load_rates.py: prompt tokens not yet prefilled, prefill tokens per
second, requests finished per second) and from its own view (requests placed on each engine and
the free sequence slots; requests in its queue that go first, i.e. priority value <= p):

- slot wait: the request needs a sequence slot after the A requests queued ahead of it; with F
  free slots now and slots freeing at the engines' summed finish rate, it gets one after
  max(0, A + 1 - F) / finished_per_s;
- prefill wait: the prompt tokens already queued at the engines plus those of the requests
  ahead, over the engines' summed prefill rate.

The estimate is the larger of the two (they overlap in time). The reported rates miss part of
the real wait, by a factor that depends on the engine and the workload, so the estimate is
multiplied by a correction learnt from the requests admitted before (delay_calibration.py: a
high quantile of observed over predicted start delay, bounded, decaying to 1 without evidence).
Over `max_queue_delay_s` the corrected estimate is refused with RESOURCE_EXHAUSTED and a
retry-after of the excess (the time until the queue ahead has shrunk to the bound). The bound
is on the start of prefill: a request's time to first token adds its own prefill and the
detokenize hop. Before an engine has measured a rate there is no basis for an estimate and
nothing is refused on time (the count and token bounds still hold). Plain Python, no gRPC:
unit-tested in milliseconds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.common.errors import ResourceExhaustedError
from services.router.delay_calibration import DelayCalibration

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 60.0
# A change of the correction by this fraction since the last one logged is logged (debug).
LOGGED_CORRECTION_CHANGE = 0.1


@dataclass(frozen=True)
class EngineLoadView:
    """One engine as the estimate sees it."""

    free_slots: int
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
        return cls(
            free_slots=capacity.free_slots,
            queued_prompt_tokens=int(load.queued_prompt_tokens),
            prefill_tokens_per_s=float(load.prefill_tokens_per_s),
            finished_per_s=float(load.finished_per_s),
        )


@dataclass(frozen=True)
class DelayEstimate:
    """Seconds until a new request would start by the engines' reports, its parts, the
    correction calibration applies, and one engine's prefill rate (for the request's own)."""

    delay_s: float
    slot_wait_s: float
    prefill_wait_s: float
    engine_prefill_tokens_per_s: float = 0.0  # mean over engines that measured one
    correction: float = 1.0

    @property
    def corrected_delay_s(self) -> float:
        """What the gate compares with its bound."""
        return self.delay_s * self.correction

    def own_prefill_s(self, prompt_tokens: int) -> float:
        """How long the request's own prompt takes to prefill on one engine (0 unmeasured)."""
        rate = self.engine_prefill_tokens_per_s
        return prompt_tokens / rate if rate > 0.0 else 0.0


def estimate_start_delay(
    engines: Iterable[EngineLoadView], ahead_requests: int, ahead_prompt_tokens: int
) -> DelayEstimate | None:
    """How long a new request waits for its prefill to start; None without measured rates."""
    free_slots = queued = prefilling_engines = 0
    prefill_rate = finish_rate = 0.0
    for engine in engines:
        free_slots += max(engine.free_slots, 0)
        queued += max(engine.queued_prompt_tokens, 0)
        prefill_rate += max(engine.prefill_tokens_per_s, 0.0)
        finish_rate += max(engine.finished_per_s, 0.0)
        prefilling_engines += engine.prefill_tokens_per_s > 0.0
    short = max(ahead_requests + 1 - free_slots, 0)
    if short and finish_rate <= 0.0:
        return None
    slot_wait = short / finish_rate if short else 0.0
    tokens = queued + max(ahead_prompt_tokens, 0)
    if tokens and prefill_rate <= 0.0:
        return None
    prefill_wait = tokens / prefill_rate if tokens else 0.0
    engine_rate = prefill_rate / prefilling_engines if prefilling_engines else 0.0
    return DelayEstimate(max(slot_wait, prefill_wait), slot_wait, prefill_wait, engine_rate)


class QueueDelayGate:
    """Refuses requests whose corrected start delay exceeds `max_delay_s` (0: off).

    With a `calibration`, the estimate is multiplied by its factor; the router tells it which
    admitted requests to follow (`track`), their first tokens (`started`) and their ends
    (`forget`)."""

    def __init__(
        self,
        max_delay_s: float,
        *,
        min_retry_after_s: float = 1.0,
        calibration: DelayCalibration | None = None,
    ) -> None:
        if max_delay_s < 0:
            raise ValueError("max_delay_s must be >= 0")
        self.max_delay_s = max_delay_s
        self.min_retry_after_s = min_retry_after_s
        self.calibration = calibration
        self.refused = 0
        self.last_estimate: DelayEstimate | None = None
        self._logged_correction = 1.0

    def check(
        self, connections: Iterable[Any], ahead_requests: int, ahead_prompt_tokens: int
    ) -> DelayEstimate | None:
        """Raise ResourceExhaustedError (with retry-after) when a request queued now behind
        `ahead_requests` requests of `ahead_prompt_tokens` prompt tokens could not start in
        time on the given engine connections; else return the estimate (None: no basis)."""
        if self.max_delay_s <= 0:
            return None
        views = [EngineLoadView.of_connection(connection) for connection in connections]
        if not views:
            return None
        estimate = estimate_start_delay(views, ahead_requests, ahead_prompt_tokens)
        if estimate is not None:
            estimate = dataclasses.replace(estimate, correction=self.correction())
        self.last_estimate = estimate
        if estimate is None:
            return None
        delay_s = estimate.corrected_delay_s
        if delay_s <= self.max_delay_s:
            return estimate
        self.refused += 1
        retry_after = min(
            max(self.min_retry_after_s, delay_s - self.max_delay_s), MAX_RETRY_AFTER_S
        )
        raise ResourceExhaustedError(
            f"the engines are busy: a new request would wait about {delay_s:.1f}s to "
            f"start (limit {self.max_delay_s:g}s); retry later",
            retry_after_s=retry_after,
        )

    def correction(self) -> float:
        """The calibration's factor now (1 without one); logged when it moved."""
        if self.calibration is None:
            return 1.0
        factor = self.calibration.refresh()
        logged = self._logged_correction
        if abs(factor - logged) > LOGGED_CORRECTION_CHANGE * logged:
            self._logged_correction = factor
            log.debug(
                "queue-delay correction %.2f (was %.2f; %d starts observed)",
                factor,
                logged,
                self.calibration.observations,
            )
        return factor

    # ---- what the calibration follows --------------------------------------------------------
    def track(
        self, key: Any, estimate: DelayEstimate | None, arrival: float, prompt_tokens: int
    ) -> None:
        """An admitted request with the estimate it was admitted on."""
        if self.calibration is not None and estimate is not None:
            own_prefill_s = estimate.own_prefill_s(prompt_tokens)
            self.calibration.track(key, estimate.delay_s, arrival, own_prefill_s)

    def started(self, key: Any, first_token_at: float) -> None:
        if self.calibration is not None:
            self.calibration.started(key, first_token_at)

    def forget(self, key: Any) -> None:
        if self.calibration is not None:
            self.calibration.forget(key)
