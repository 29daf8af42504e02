"""Slot time-slicing in the scheduler: paused sequences keep their KV, resume after admissions,
never pause before they ran, and give their blocks back first (to lower-ranked work only)."""

from __future__ import annotations

from services.common.protocol.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence
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


def _scheduler(slots: _Slots, num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    return Scheduler(config, BlockManager(num_blocks, 4), adapter_slots=slots)


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
