"""Least-loaded placement: most free capacity wins, head of line is never overtaken."""

from __future__ import annotations

from dataclasses import dataclass

from services.router.admission import AdmissionQueue
from services.router.dispatch import EngineCapacity, LeastLoadedPolicy


@dataclass(eq=False)
class Item:
    num_prompt_tokens: int
    priority: int = 0

    def expired(self, now: float | None = None) -> bool:
        return False


def engine(name: str, *, slots: int = 4, free: int = 100, total: int = 100) -> EngineCapacity:
    return EngineCapacity(
        engine_id=name,
        ready=True,
        max_num_seqs=slots,
        max_model_len=1024,
        block_size=16,
        total_blocks=total,
        free_blocks=free,
    )


def queue_of(*items: Item) -> AdmissionQueue:
    queue = AdmissionQueue(max_requests=100, max_tokens=10**6)
    for item in items:
        queue.admit(item)
    return queue


def test_places_on_engine_with_most_free_capacity() -> None:
    busy, idle = engine("busy", free=20), engine("idle", free=90)
    busy.inflight = 1
    placements = LeastLoadedPolicy().schedule(queue_of(Item(10)), [busy, idle])
    assert [p.engine_id for p in placements] == ["idle"]
    assert idle.inflight == 1 and idle.reserved_blocks == 1


def test_spreads_a_burst_across_engines() -> None:
    engines = [engine("a"), engine("b")]
    queue = queue_of(*(Item(16) for _ in range(6)))
    placements = LeastLoadedPolicy().schedule(queue, engines)
    counts = {name: sum(p.engine_id == name for p in placements) for name in ("a", "b")}
    assert counts == {"a": 3, "b": 3}
    assert len(queue) == 0


def test_holds_requests_when_slots_are_full() -> None:
    only = engine("a", slots=2)
    queue = queue_of(Item(1), Item(1), Item(1))
    placements = LeastLoadedPolicy().schedule(queue, [only])
    assert len(placements) == 2 and len(queue) == 1
    only.inflight -= 1
    assert len(LeastLoadedPolicy().schedule(queue, [only])) == 1


def test_head_of_line_is_not_overtaken_when_blocks_are_short() -> None:
    small = engine("a", free=5, total=100)
    small.inflight = 1  # busy engine: block check applies
    big, tiny = Item(16 * 10), Item(4)
    queue = queue_of(big, tiny)
    assert LeastLoadedPolicy().schedule(queue, [small]) == []
    assert list(queue.ordered()) == [big, tiny]


def test_idle_engine_takes_any_request_and_not_ready_engines_take_none() -> None:
    idle = engine("a", free=1, total=100)
    down = engine("b")
    down.ready = False
    placements = LeastLoadedPolicy().schedule(queue_of(Item(500)), [down, idle])
    assert [p.engine_id for p in placements] == ["a"]


def test_the_engine_reported_inflight_capacity_bounds_placement_unless_overridden() -> None:
    reported = engine("a", slots=2)
    reported.engine_max_inflight = 3  # e.g. an engine that time-slices its LoRA slots
    placements = LeastLoadedPolicy().schedule(queue_of(*(Item(1) for _ in range(5))), [reported])
    assert len(placements) == 3 and reported.free_slots == 0
    capped = engine("b", slots=2)
    capped.engine_max_inflight, capped.max_inflight = 3, 1  # --max-inflight-per-engine wins
    assert len(LeastLoadedPolicy().schedule(queue_of(Item(1), Item(1)), [capped])) == 1


def test_max_inflight_overrides_engine_slots() -> None:
    capped = engine("a", slots=256)
    capped.max_inflight = 1
    placements = LeastLoadedPolicy().schedule(queue_of(Item(1), Item(1)), [capped])
    assert len(placements) == 1
