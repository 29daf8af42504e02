"""LoRA-aware batching and placement: the router's default `DispatchPolicy`.

Every adapter (and the base model) has its own queue in the `AdmissionQueue`; each `schedule`
call serves the queues' heads in queue order (priority, then arrival):
- A request goes to an engine that can take it (free sequence slot, KV room) and that admits its
  adapter: the distinct adapters in flight on an engine never exceed the engine's adapter
  capacity (`EngineCapacity.adapter_cap`; base-model requests don't count; an engine that
  reports neither capacity nor slots is not capped). The capacity is the engine's
  `lora_adapter_capacity`: its device slots, or, when the engine time-slices its slots, its
  host cache of adapters, among which the slots rotate every quantum. An engine that predates
  the field counts its slots. Among the engines that admit it, a request prefers one where its
  adapter is warm (resident in a device slot, loading, or in flight), so an adapter's requests
  batch together on engines that hold it.
- Swap cost against waiting: when the adapter is warm only on engines that are busy now, the
  request waits for them up to the cost of loading it elsewhere (the engine's measured load time,
  else `swap_cost_s`), then pays the load (the ski-rental rule: never worse than twice the
  better of the two choices).
- A head that only lacks room in an adapter capacity does not block other adapters. A head that
  no engine can take at all (sequence slots or KV) stops dispatch, as in `LeastLoadedPolicy`, so
  a long prompt is never overtaken forever.
- Forced exchange: a head that has waited `max_wait_s` without room in any engine's adapter
  capacity reserves an engine (the one with the fewest reservations). For each reservation that
  no free place in the capacity covers, one of the engine's in-flight adapters that has held its
  place for `max_wait_s` or more (the longest holder) becomes a victim: it gets no new requests
  there, so it drains and frees its place, which only a reserved adapter may take; then all the
  reserved adapter's queued requests go at once and the reservation ends. The other adapters
  keep being served, and a place changes hands by force at most once per `max_wait_s`, so
  exchanges cannot eat the throughput. An engine holds at most as many reservations as its
  capacity; starving adapters reserve in arrival order.

Fairness bound (docs/lora.md): with E engines of capacity C each (C = S, the slots, without
time-slicing) and N adapters, a request that waits only for room in an adapter capacity is
dispatched within `max_wait_s + ceil(N / (E*C)) * (max_wait_s + T_load + T_service)` of
arriving, where T_load is an adapter's load time and T_service the longest time a placed request
stays on its engine (with time-slicing, paused turns included).
Plain Python: no gRPC, no torch; tested in milliseconds with a simulated clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from services.router.admission import AdmissionQueue
from services.router.dispatch import EngineCapacity, Placement
from services.router.prefix_affinity import PrefixAffinity

_HOLD = "hold"  # no engine can take this request at all: stop dispatching
_SKIP = "skip"  # this adapter must wait; others may go


def fairness_bound_s(
    *,
    max_wait_s: float,
    adapters: int,
    engines: int,
    capacity_per_engine: int,
    load_s: float,
    service_s: float,
) -> float:
    """The longest a request waits in the router's queue (module docstring; docs/lora.md);
    `capacity_per_engine` is an engine's adapter capacity (its slots without time-slicing)."""
    rounds = math.ceil(adapters / max(engines * capacity_per_engine, 1))
    return max_wait_s + rounds * (max_wait_s + load_s + service_s)


class LoraAwarePolicy:
    """Per-adapter queues, residency-first placement, adapter caps, forced exchanges (module
    doc)."""

    def __init__(
        self,
        *,
        max_wait_s: float = 2.0,
        swap_cost_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_wait_s = max_wait_s
        self.swap_cost_s = swap_cost_s
        self._clock = clock
        self.exchanges: dict[str, str] = {}  # starving adapter -> the engine reserved for it
        self.victims: dict[str, set[str]] = {}  # engine -> adapters draining there for them
        self._holding_since: dict[tuple[str, str], float] = {}  # (engine, adapter) -> when
        self.affinity = PrefixAffinity()  # among equal choices, where the prompt's prefix went

    def schedule(self, queue: AdmissionQueue, engines: list[EngineCapacity]) -> list[Placement]:
        now = self._clock()
        placements: list[Placement] = []
        self._plan_exchanges(queue, engines, now)
        heads = queue.heads()
        while heads:
            _, request = heads.pop(0)
            adapter = getattr(request, "adapter", "") or ""
            target = self._place(request, adapter, engines, now)
            if isinstance(target, str):
                if target == _HOLD:
                    break
                continue  # _SKIP: this adapter waits, the others go on
            queue.take(request)
            if adapter:
                self._holding_since.setdefault((target.engine_id, adapter), now)
            target.take(request.num_prompt_tokens, adapter)
            placements.append(Placement(request, target.engine_id))
            self.exchanges.pop(adapter, None)
            following = queue.head(adapter)
            if following is not None:
                _insert_in_order(heads, following)
        return placements

    def reserved_on(self, engine_id: str) -> set[str]:
        return {adapter for adapter, eid in self.exchanges.items() if eid == engine_id}

    def admits(self, engine: EngineCapacity, adapter: str) -> bool:
        """Whether a request of `adapter` may be placed on `engine` as far as its adapter
        capacity goes."""
        cap = engine.adapter_cap
        if not adapter or cap <= 0:
            return True
        if adapter in self.victims.get(engine.engine_id, ()):
            return False  # draining to free its place for a starving adapter
        if engine.adapters_inflight.get(adapter):
            return True
        free = cap - len(engine.adapters_inflight)
        reserved = self.reserved_on(engine.engine_id)
        if adapter not in reserved and free <= len(reserved):
            return False  # the free places are promised to starving adapters
        return free > 0

    def swap_cost(self, engine: EngineCapacity) -> float:
        return engine.adapter_load_s if engine.adapter_load_s > 0 else self.swap_cost_s

    def _place(
        self, request: Any, adapter: str, engines: list[EngineCapacity], now: float
    ) -> EngineCapacity | str:
        fits = [e for e in engines if e.can_accept(request.num_prompt_tokens)]
        if not fits:
            return _HOLD
        if not adapter:
            return self._affine(request, adapter, fits)
        allowed = [e for e in fits if self.admits(e, adapter)]
        if not allowed:
            return _SKIP
        warm = [e for e in allowed if e.warm(adapter)]
        if warm:
            return self._affine(request, adapter, warm)
        waited = now - request.arrival
        busy_warm = any(e.ready and e.warm(adapter) for e in engines)
        patience = min(min(self.swap_cost(e) for e in allowed), self.max_wait_s)
        if busy_warm and waited < patience:
            return _SKIP
        return max(allowed, key=lambda e: (-self.swap_cost(e), *_capacity_order(e)))

    def _affine(
        self, request: Any, adapter: str, candidates: list[EngineCapacity]
    ) -> EngineCapacity:
        """The engine with the most free capacity, or the one that holds the prompt's prefix
        when it has nearly as much (prefix_affinity.py); remembers the choice."""
        prompt = getattr(request, "prompt_token_ids", None) or ()
        key = self.affinity.key(prompt, candidates[0].block_size, adapter)
        chosen = self.affinity.choose(candidates, key, max(candidates, key=_capacity_order))
        self.affinity.record(key, chosen.engine_id)
        return chosen

    def _plan_exchanges(
        self, queue: AdmissionQueue, engines: list[EngineCapacity], now: float
    ) -> None:
        ready = {e.engine_id: e for e in engines if e.ready}
        held = {(e.engine_id, a) for e in ready.values() for a in e.adapters_inflight}
        for key in list(self._holding_since):
            if key not in held:
                del self._holding_since[key]
        for key in held:
            self._holding_since.setdefault(key, now)
        for adapter, engine_id in list(self.exchanges.items()):
            if engine_id not in ready or queue.head(adapter) is None:
                del self.exchanges[adapter]
        starving = [
            request
            for _, request in queue.heads()
            if getattr(request, "adapter", "") and now - request.arrival >= self.max_wait_s
        ]
        starving.sort(key=lambda request: request.arrival)
        for request in starving:
            adapter = request.adapter
            if adapter in self.exchanges:
                continue
            if any(self.admits(e, adapter) for e in ready.values()):
                continue  # it has room somewhere; it only waits for sequence or KV room
            candidates = [
                e
                for e in ready.values()
                if e.adapter_cap > 0 and len(self.reserved_on(e.engine_id)) < e.adapter_cap
            ]
            if not candidates:
                continue  # every place is promised; it reserves in a later round

            def draining_cost(engine: EngineCapacity) -> tuple:
                reserved = len(self.reserved_on(engine.engine_id))
                return (reserved, -engine.score(), engine.engine_id)

            self.exchanges[adapter] = min(candidates, key=draining_cost).engine_id
        for engine in ready.values():
            self._choose_victims(engine, now)
        for engine_id in list(self.victims):
            if engine_id not in ready:
                del self.victims[engine_id]

    def _choose_victims(self, engine: EngineCapacity, now: float) -> None:
        """Enough long-held adapters to drain that every reservation here gets a place."""
        engine_id = engine.engine_id
        reserved = self.reserved_on(engine_id)
        inflight = engine.adapters_inflight
        needed = len(reserved) - max(engine.adapter_cap - len(inflight), 0)
        victims = {a for a in self.victims.get(engine_id, ()) if a in inflight}
        while len(victims) > max(needed, 0):
            victims.remove(max(victims, key=lambda a: (inflight[a], a)))
        since = self._holding_since
        candidates = sorted(
            (since.get((engine_id, a), now), inflight[a], a)
            for a in inflight
            if a not in reserved
            and a not in victims
            and now - since.get((engine_id, a), now) >= self.max_wait_s
        )
        while len(victims) < needed and candidates:
            victims.add(candidates.pop(0)[2])
        if victims:
            self.victims[engine.engine_id] = victims
        else:
            self.victims.pop(engine.engine_id, None)


def _capacity_order(engine: EngineCapacity) -> tuple:
    return (engine.score(), -engine.inflight, engine.engine_id)


def _insert_in_order(heads: list, item: tuple) -> None:
    key = item[0]
    index = 0
    while index < len(heads) and heads[index][0] < key:
        index += 1
    heads.insert(index, item)
