"""LoRA-aware placement: residency first, adapter caps (the engine's adapter capacity, else its
slots), no blocking across adapters, swap cost against waiting, forced exchanges, and the fairness
bound under a Zipf mix (simulated clock)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from services.router.admission import AdmissionQueue
from services.router.dispatch import EngineCapacity
from services.router.lora_batcher import LoraAwarePolicy, fairness_bound_s
from tests.fake_clock import FakeClock
from tests.unit.router.lora_sim import clock, simulate


@dataclass(eq=False)
class Item:
    adapter: str = ""
    arrival: float = 0.0
    num_prompt_tokens: int = 10
    priority: int = 0

    def expired(self, now: float | None = None) -> bool:
        return False


def engine(
    name: str, *, slots: int = 2, capacity: int = 0, seqs: int = 8, resident=()
) -> EngineCapacity:
    return EngineCapacity(
        engine_id=name,
        ready=True,
        max_num_seqs=seqs,
        max_model_len=1024,
        total_blocks=1000,
        free_blocks=1000,
        lora_slots=slots,
        lora_adapter_capacity=capacity,
        resident_adapters=tuple(resident),
    )


def queue_of(*items: Item) -> AdmissionQueue:
    queue = AdmissionQueue(max_requests=1000, max_tokens=10**6)
    for item in items:
        queue.admit(item)
    return queue


def placed(placements) -> list[tuple[str, str]]:
    return [(p.request.adapter, p.engine_id) for p in placements]


def test_queue_keeps_one_queue_per_adapter_in_order() -> None:
    first, second, base, third = Item("a"), Item("b"), Item(""), Item("a")
    queue = queue_of(first, second, base, third)
    assert [request for _, request in queue.heads()] == [first, second, base]
    assert queue.depth_by_adapter() == {"a": 2, "b": 1, "": 1}
    queue.take(first)
    assert queue.head("a")[1] is third
    queue.remove(second)
    assert queue.depth_by_adapter() == {"a": 1, "": 1}
    assert [request for _, request in queue.heads()] == [base, third]
    assert queue.pop() is base and queue.pop() is third and len(queue) == 0
    assert queue.heads() == [] and queue.depth_by_adapter() == {}


def test_prefers_the_engine_where_the_adapter_is_resident() -> None:
    cold, warm = engine("cold"), engine("warm", resident=("a",))
    warm.inflight = 3  # busier, but it holds the adapter
    placements = LoraAwarePolicy().schedule(queue_of(Item("a")), [cold, warm])
    assert placed(placements) == [("a", "warm")]
    assert warm.adapters_inflight == {"a": 1} and cold.adapters_inflight == {}


def test_distinct_adapters_in_flight_never_exceed_the_slots() -> None:
    only = engine("e", slots=2, seqs=16)
    items = [Item(name) for name in "abcabcd"]
    queue = queue_of(*items)
    placements = LoraAwarePolicy().schedule(queue, [only])
    assert sorted(only.adapters_inflight) == ["a", "b"]
    assert only.adapters_inflight == {"a": 2, "b": 2}
    # c and d wait without blocking the later requests of a and b.
    assert [a for a, _ in placed(placements)] == ["a", "b", "a", "b"]
    assert queue.depth_by_adapter() == {"c": 2, "d": 1}


def test_an_engine_that_time_slices_its_slots_takes_adapters_up_to_its_capacity() -> None:
    sliced = engine("e", slots=2, capacity=8, seqs=32)
    names = [f"a{i}" for i in range(9)]
    queue = queue_of(*(Item(name) for name in names))
    placements = LoraAwarePolicy().schedule(queue, [sliced])
    assert [a for a, _ in placed(placements)] == names[:8]  # 8 distinct adapters at once
    assert sorted(sliced.adapters_inflight) == names[:8]
    assert queue.depth_by_adapter() == {"a8": 1}  # the ninth waits for room in the capacity


def test_an_engine_that_reports_no_capacity_is_capped_at_its_slots() -> None:
    old = engine("e", slots=2, capacity=0, seqs=16)
    assert old.adapter_cap == 2
    queue = queue_of(*(Item(name) for name in "abc"))
    placements = LoraAwarePolicy().schedule(queue, [old])
    assert [a for a, _ in placed(placements)] == ["a", "b"]
    assert queue.depth_by_adapter() == {"c": 1}


def test_the_capacity_comes_with_the_engine_adapter_report() -> None:
    capacity = engine("e", slots=0)
    capacity.note_adapters(("a",), (), 2, now=1.0, adapter_capacity=8)
    assert (capacity.lora_slots, capacity.lora_adapter_capacity, capacity.adapter_cap) == (2, 8, 8)
    capacity.note_adapters(("a",), (), 2, now=1.1)  # an engine from before the capacity
    assert capacity.adapter_cap == 2


def test_base_model_requests_take_no_slot_and_pass_a_waiting_adapter() -> None:
    only = engine("e", slots=1)
    only.adapters_inflight = {"a": 1}
    only.inflight = 1
    queue = queue_of(Item("b"), Item(""), Item(""))
    placements = LoraAwarePolicy().schedule(queue, [only])
    assert placed(placements) == [("", "e"), ("", "e")]
    assert only.adapters_inflight == {"a": 1} and len(queue) == 1


def test_an_engine_without_reported_slots_is_not_capped() -> None:
    old = engine("e", slots=0)
    placements = LoraAwarePolicy().schedule(queue_of(*(Item(n) for n in "abcd")), [old])
    assert len(placements) == 4


def test_holds_everything_when_no_engine_has_room_for_the_head() -> None:
    full = engine("e", seqs=1)
    full.inflight = 1
    queue = queue_of(Item("a"), Item(""))
    assert LoraAwarePolicy().schedule(queue, [full]) == [] and len(queue) == 2


def test_waits_for_a_busy_warm_engine_up_to_the_swap_cost_then_loads_elsewhere() -> None:
    tick = FakeClock()
    warm, cold = engine("warm", seqs=1, resident=("a",)), engine("cold")
    warm.inflight = 1  # busy
    queue = queue_of(Item("a", arrival=0.0))
    policy = LoraAwarePolicy(swap_cost_s=0.5, clock=tick)
    tick.now = 0.2
    assert policy.schedule(queue, [warm, cold]) == []
    cold.adapter_load_s = 0.1  # measured: loading there is cheap, so waiting longer won't pay
    assert placed(policy.schedule(queue, [warm, cold])) == [("a", "cold")]


def test_measures_adapter_load_time_from_the_engine_reports() -> None:
    capacity = engine("e")
    capacity.note_adapters((), ("a",), 2, now=1.0)
    capacity.note_adapters((), ("a",), 2, now=1.1)
    assert capacity.warm("a") and capacity.adapter_load_s == 0
    capacity.note_adapters(("a",), (), 2, now=1.3)
    assert capacity.adapter_load_s == pytest.approx(0.3)
    assert capacity.resident_adapters == ("a",) and capacity.loading_adapters == ()


def test_a_starving_adapter_forces_the_longest_holder_to_drain() -> None:
    tick = FakeClock()
    only = engine("e", slots=2, seqs=32)
    policy = LoraAwarePolicy(max_wait_s=1.0, clock=tick)
    queue = queue_of(Item("a"), Item("b"))
    assert len(policy.schedule(queue, [only])) == 2  # a and b hold both slots from t=0
    tick.now = 0.5
    queue.admit(Item("b", arrival=0.5))
    queue.admit(Item("c", arrival=0.5))
    assert placed(policy.schedule(queue, [only])) == [("b", "e")]  # c has no slot yet
    tick.now = 1.6  # c has starved past max_wait; a and b have held their slots >= 1 s
    queue.admit(Item("a", arrival=1.6))
    queue.admit(Item("b", arrival=1.6))
    placements = policy.schedule(queue, [only])
    assert policy.exchanges == {"c": "e"}
    victim = next(iter(policy.victims["e"]))
    assert victim == "a"  # fewer requests in flight among the equally long holders
    assert placed(placements) == [("b", "e")]  # b still served; a gets nothing new
    only.release_adapter("a")  # a drains
    tick.now = 1.7
    assert placed(policy.schedule(queue, [only])) == [("c", "e")]
    assert policy.exchanges == {} and "e" not in policy.victims
    assert sorted(only.adapters_inflight) == ["b", "c"]


def test_a_free_slot_goes_to_the_starving_adapter_first() -> None:
    tick = FakeClock()
    only = engine("e", slots=1)
    policy = LoraAwarePolicy(max_wait_s=1.0, clock=tick)
    queue = queue_of(Item("old", arrival=0.0))
    only.adapters_inflight = {"x": 1}
    only.inflight = 1
    tick.now = 2.0
    policy.schedule(queue, [only])
    assert policy.exchanges == {"old": "e"}
    only.release_adapter("x")
    only.inflight = 0
    queue.admit(Item("urgent", arrival=2.0, priority=-1))  # ahead in queue order
    assert placed(policy.schedule(queue, [only])) == [("old", "e")]
    assert queue.depth_by_adapter() == {"urgent": 1}


def test_no_exchange_while_the_capacity_has_room_though_the_slots_are_taken() -> None:
    tick = FakeClock()
    sliced = engine("e", slots=2, capacity=3, seqs=32)
    policy = LoraAwarePolicy(max_wait_s=1.0, clock=tick)
    queue = queue_of(Item("a"), Item("b"))
    assert len(policy.schedule(queue, [sliced])) == 2  # a and b fill the device slots
    tick.now = 1.6
    queue.admit(Item("c", arrival=0.0))  # old enough to starve, but there is room for it
    assert placed(policy.schedule(queue, [sliced])) == [("c", "e")]
    assert policy.exchanges == {} and policy.victims == {}
    tick.now = 3.0
    queue.admit(Item("d", arrival=1.0))  # now the capacity is exhausted: d reserves
    assert policy.schedule(queue, [sliced]) == []
    assert policy.exchanges == {"d": "e"} and len(policy.victims["e"]) == 1


@pytest.mark.parametrize("rate_per_s", [10.0, 20.0])
def test_zipf_mix_on_two_slots_waits_within_the_fairness_bound(rate_per_s: float) -> None:
    """8 adapters, 2 slots, 1 engine, Zipf(1.1) mix at a load the slots can barely carry."""
    max_wait_s, service_s, load_s, tick_s = 1.0, (0.5, 1.5), 0.02, 0.01
    policy = LoraAwarePolicy(max_wait_s=max_wait_s, swap_cost_s=load_s, clock=clock)
    result = simulate(
        policy,
        adapters=8,
        slots=2,
        max_num_seqs=32,
        rate_per_s=rate_per_s,
        duration_s=60.0,
        service_s=service_s,
        load_s=load_s,
        tick_s=tick_s,
    )
    bound = fairness_bound_s(
        max_wait_s=max_wait_s,
        adapters=8,
        engines=1,
        capacity_per_engine=2,
        load_s=load_s,
        service_s=service_s[1],
    )
    assert result.unplaced == 0 and len(result.requests) > 500
    assert result.max_distinct_inflight == 2
    assert len(result.longest_wait_by_adapter()) == 8  # the rarest adapter was served too
    assert max(result.waits) <= bound + tick_s


def test_without_exchanges_rare_adapters_starve_past_the_bound() -> None:
    """The same mix with forced exchanges off: the popular adapters keep the slots."""
    policy = LoraAwarePolicy(max_wait_s=math.inf, swap_cost_s=0.02, clock=clock)
    result = simulate(
        policy, rate_per_s=20.0, duration_s=60.0, service_s=(0.5, 1.5), max_num_seqs=32
    )
    bound = fairness_bound_s(
        max_wait_s=1.0, adapters=8, engines=1, capacity_per_engine=2, load_s=0.02, service_s=1.5
    )
    assert max(result.waits) > bound
