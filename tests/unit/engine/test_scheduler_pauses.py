"""Slot time-slicing in the scheduler: paused sequences keep their KV, resume after admissions,
never pause before they ran, and give their blocks back first (to lower-ranked work only; with
swap space, to any work, by moving them to host memory and back)."""

from __future__ import annotations

from services.common.protocol.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence
from services.engine.swap_space import HostBlocks
from tests.unit.engine.test_scheduler import complete_step, make_seq


class _Slots:
    """One slot per adapter name; `yielding` slots are handed back on the next schedule."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.slot_of: dict[str, int] = {}
        self.pins: dict[int, int] = {}
        self.yielding: list[int] = []

    def acquire(self, seq: Sequence) -> bool:
        slot = self.slot_of.get(seq.adapter)
        if slot is None:
            unpinned = [s for s, pins in self.pins.items() if pins == 0]
            if self.free:
                self.free -= 1
                slot = len(self.pins)
            elif unpinned:
                slot = unpinned[0]
                self.slot_of = {n: s for n, s in self.slot_of.items() if s != slot}
            else:
                return False
            self.slot_of[seq.adapter] = slot
        elif slot in self.yielding:
            return False
        self.pins[slot] = self.pins.get(slot, 0) + 1
        seq.adapter_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        if seq.adapter_slot >= 0:
            self.pins[seq.adapter_slot] -= 1
            seq.adapter_slot = -1

    def drop(self, seq: Sequence) -> None:
        self.release(seq)

    def slots_to_yield(self) -> list[int]:
        return [slot for slot in self.yielding if self.pins.get(slot)]

    def could_acquire(self, seq: Sequence) -> bool:
        slot = self.slot_of.get(seq.adapter)
        if slot is not None:
            return slot not in self.yielding
        return bool(self.free) or any(pins == 0 for pins in self.pins.values())


def _scheduler(slots: _Slots, num_blocks: int = 32, host_blocks: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    swap = HostBlocks(host_blocks) if host_blocks else None
    return Scheduler(config, BlockManager(num_blocks, 4), adapter_slots=slots, host_blocks=swap)


def _with_adapter(seq: Sequence, name: str) -> Sequence:
    seq.adapter = name
    return seq


def _distinct(prompt_len: int, first: int, priority: int) -> Sequence:
    """A prompt that shares no cached prefix with make_seq's."""
    seq = make_seq(prompt_len, priority=priority)
    return Sequence(
        seq.seq_id,
        seq.request_id,
        list(range(first, first + prompt_len)),
        SamplingParams(max_tokens=8),
        priority=priority,
    )


def test_a_paused_sequence_keeps_its_kv_and_resumes_after_admissions() -> None:
    slots = _Slots(free=1)
    scheduler = _scheduler(slots)
    a = _with_adapter(make_seq(6), "a")
    b = _with_adapter(make_seq(5), "b")
    scheduler.add(a)
    complete_step(scheduler, scheduler.schedule())  # a prefilled and holding the only slot
    scheduler.add(b)
    output = scheduler.schedule()
    assert [s.seq_id for s, _ in output.scheduled] == [a.seq_id]  # b waits for the slot
    complete_step(scheduler, output)
    blocks = list(a.block_table)
    slots.yielding = [a.adapter_slot]
    output = scheduler.schedule()  # a pauses; b takes the slot in the same step
    assert scheduler.paused == [a] and scheduler.num_pauses == 1
    assert [s.seq_id for s, _ in output.scheduled] == [b.seq_id]
    assert a.block_table == blocks and scheduler.num_running == 2
    complete_step(scheduler, output)
    slots.yielding = []
    scheduler.finish(b)
    slots.drop(b)
    computed = a.num_computed_tokens
    assert not scheduler.resumed_last
    output = scheduler.schedule()  # the slot is free again: a resumes (it runs from the next step)
    assert scheduler.paused == [] and a in scheduler.running
    assert output.is_empty and scheduler.resumed_last
    slots.yielding = [a.adapter_slot]  # asked to yield at once: a runs one step first
    output = scheduler.schedule()
    assert [(s.seq_id, s.start_position) for s in output.batch.sequences] == [(a.seq_id, computed)]


def test_paused_sequences_give_kv_back_only_to_higher_ranked_work() -> None:
    slots = _Slots(free=1)
    scheduler = _scheduler(slots, num_blocks=5)
    a = _with_adapter(make_seq(12, priority=5), "a")
    scheduler.add(a)
    complete_step(scheduler, scheduler.schedule())
    slots.yielding = [a.adapter_slot]
    scheduler.schedule()
    assert scheduler.paused == [a]
    slots.yielding = []
    late = _with_adapter(_distinct(12, 100, priority=9), "c")  # lower rank than a: must wait
    scheduler.add(late)
    scheduler.schedule()
    assert scheduler.paused == [] and a in scheduler.running  # a resumed; late still waits
    assert late in [entry[2] for entry in scheduler.waiting]
    slots.yielding = [a.adapter_slot]
    complete_step(scheduler, scheduler.schedule())  # resumed last step: a runs once first
    urgent = _with_adapter(_distinct(12, 200, priority=0), "d")  # higher rank: a's KV goes
    scheduler.add(urgent)
    scheduler.schedule()  # a pauses, and its blocks go to the urgent request
    assert urgent in scheduler.running and a not in scheduler.paused
    assert scheduler.num_preemptions == 1 and not a.block_table


def _paused_holding_the_cache(host_blocks: int) -> tuple[_Slots, Scheduler, Sequence]:
    """A paused sequence (priority 0, 12 tokens) holding 3 of the cache's 5 blocks."""
    slots = _Slots(free=1)
    scheduler = _scheduler(slots, num_blocks=5, host_blocks=host_blocks)
    a = _with_adapter(make_seq(12), "a")
    scheduler.add(a)
    complete_step(scheduler, scheduler.schedule())
    slots.yielding = [a.adapter_slot]
    scheduler.schedule()
    slots.yielding = []
    assert scheduler.paused == [a] and len(a.block_table) == 3
    return slots, scheduler, a


def test_with_swap_space_a_paused_sequence_moves_to_host_memory_for_any_request() -> None:
    slots, scheduler, a = _paused_holding_the_cache(host_blocks=8)
    blocks, computed = list(a.block_table), a.num_computed_tokens
    slots.slot_of.clear()  # a's slot went to another adapter's sequence: a cannot resume yet
    slots.pins = {0: 1}
    slots.free = 0
    late = _distinct(12, 100, priority=9)  # a base-model request of lower rank than a
    scheduler.add(late)
    output = scheduler.schedule()
    # a's 3 blocks go to host blocks 0-2 before the step that reuses them; nothing recomputes
    assert output.swap_out == [(blocks, 0)] and output.swap_in == []
    assert late in scheduler.running and a in scheduler.paused
    assert a.host_extent == (0, 3) and not a.block_table
    assert a.num_computed_tokens == computed and scheduler.num_preemptions == 0
    assert scheduler.num_swapped == 1 and scheduler.host_blocks.num_free == 5
    complete_step(scheduler, output)
    # Its adapter can have the slot again, but the cache is short: it waits, and admissions
    # leave the blocks it needs from now on.
    slots.pins = {0: 0}
    output = scheduler.schedule()
    assert a in scheduler.paused and output.swap_in == [] and scheduler._swap_in_reserve == 3
    scheduler.add(_distinct(4, 300, priority=9))  # fits the 2 free blocks, but they are kept
    output = scheduler.schedule()
    assert [s.seq_id for s, _ in output.scheduled] == [late.seq_id]
    scheduler.finish(late)
    output = scheduler.schedule()  # blocks free again: a comes back, its KV copied in first
    assert a in scheduler.running and a.host_extent is None
    assert output.swap_in == [(0, a.block_table)] and len(a.block_table) == 3
    assert scheduler.num_swap_ins == 1 and scheduler.host_blocks.num_free == 8
    complete_step(scheduler, output)
    output = scheduler.schedule()
    assert (a.seq_id, computed) in [(s.seq_id, s.start_position) for s in output.batch.sequences]


def test_without_room_in_host_memory_a_paused_sequence_is_preempted_as_before() -> None:
    slots, scheduler, a = _paused_holding_the_cache(host_blocks=2)  # a needs 3 in a row
    urgent = _distinct(12, 200, priority=-1)
    scheduler.add(urgent)
    output = scheduler.schedule()
    assert output.swap_out == [] and scheduler.num_preemptions == 1 and a.host_extent is None
    assert urgent in scheduler.running and scheduler.host_blocks.num_free == 2


def test_a_swapped_out_sequence_that_ends_gives_its_host_blocks_back() -> None:
    slots, scheduler, a = _paused_holding_the_cache(host_blocks=8)
    scheduler.add(_distinct(12, 100, priority=9))
    scheduler.schedule()
    assert a.host_extent == (0, 3) and scheduler.host_blocks.num_free == 5
    slots.pins = {0: 0}  # its adapter could resume, but the cache is short: blocks are kept
    scheduler.schedule()
    assert a in scheduler.paused and scheduler._swap_in_reserve == 3
    scheduler.finish(a)  # aborted while in host memory
    assert a.host_extent is None and scheduler.host_blocks.num_free == 8
    assert scheduler.num_swapped == 0 and a not in scheduler.paused
    scheduler.schedule()
    assert scheduler._swap_in_reserve == 0  # nothing is kept for it any more


def test_swap_space_takes_first_the_paused_sequences_whose_turn_is_not_now() -> None:
    slots = _Slots(free=2)
    scheduler = _scheduler(slots, num_blocks=8, host_blocks=8)
    a = _with_adapter(make_seq(8, priority=5), "a")  # ranked last: preempted first without swap
    b = _with_adapter(_distinct(8, 100, priority=0), "b")
    scheduler.add(a)
    scheduler.add(b)
    complete_step(scheduler, scheduler.schedule())
    slots.yielding = [a.adapter_slot, b.adapter_slot]
    scheduler.schedule()
    assert sorted(s.seq_id for s in scheduler.paused) == sorted([a.seq_id, b.seq_id])
    b_blocks = list(b.block_table)
    slots.yielding = [slots.slot_of["b"]]  # a's adapter may have its slot back now, b's not
    scheduler.add(_distinct(20, 200, priority=9))  # 5 blocks, 4 free
    output = scheduler.schedule()
    assert [blocks for blocks, _ in output.swap_out] == [b_blocks]
    assert b.host_extent is not None and a in scheduler.running and a.host_extent is None
