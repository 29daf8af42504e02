"""The scheduler with adapters: loading adapters wait without blocking others; slots are pinned
while sequences run, released on finish and preemption; a waiting adapter drains a slot."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPreconditionError, NotFoundError
from services.common.protocol.adapter_record import AdapterRecord
from services.common.protocol.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.lora.gate import AdapterGate
from services.engine.lora.manager import AdapterManager
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, SequenceStatus
from tests.unit.engine.lora.test_manager import ManualExecutor

_ids = iter(range(10**9))


class Engine:
    """The engine's part around the scheduler: hold at arrival, poll per step, drop at the end."""

    def __init__(self, max_loras: int = 2, num_blocks: int = 64, broken: tuple = ()) -> None:
        self.executor = ManualExecutor()
        self.written: list[tuple[int, str]] = []

        def load(record: AdapterRecord) -> str:
            if record.name in broken:
                raise FailedPreconditionError(f"adapter {record.name!r} changed on disk")
            return record.name

        manager = AdapterManager(
            max_loras=max_loras,
            max_cpu_loras=4,
            load=load,
            write_slot=lambda slot, weights: self.written.append((slot, weights)),
            executor=self.executor,
        )
        for name in ("a", "b", "c"):
            manager.register(AdapterRecord(name, name, "sum", 8, ("q_proj",)))
        self.gate = AdapterGate(manager)
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
        self.scheduler = Scheduler(config, BlockManager(num_blocks, 4), self.gate)

    def add(self, adapter: str | None, prompt_len: int = 4, max_tokens: int = 4) -> Sequence:
        seq_id = next(_ids)
        seq = Sequence(
            seq_id,
            f"r{seq_id}",
            list(range(1, prompt_len + 1)),
            SamplingParams(max_tokens=max_tokens),
            adapter=adapter,
        )
        self.gate.hold(seq)
        self.scheduler.add(seq)
        return seq

    def step(self, run_loads: bool = True) -> list[tuple[int, int]]:
        """One step; (seq_id, adapter_slot) of the scheduled sequences."""
        self.gate.poll()
        if run_loads:
            self.executor.run_all()
            self.gate.poll()
        output = self.scheduler.schedule()
        for seq, count in output.scheduled:
            seq.num_computed_tokens += count
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(5)
        return [(item.seq_id, item.adapter_slot) for item in output.batch.sequences]

    def finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.gate.drop(seq)


def test_unknown_adapter_is_refused_before_queueing() -> None:
    engine = Engine()
    seq = Sequence(99, "r99", [1, 2], SamplingParams(max_tokens=2), adapter="zzz")
    with pytest.raises(NotFoundError):
        engine.gate.hold(seq)
    assert engine.scheduler.num_waiting == 0


def test_a_loading_adapter_waits_and_others_go_ahead() -> None:
    engine = Engine()
    with_adapter = engine.add("a")
    base = engine.add(None)
    assert engine.step(run_loads=False) == [(base.seq_id, -1)]
    assert with_adapter.status is SequenceStatus.WAITING and engine.scheduler.num_waiting == 1
    scheduled = engine.step()  # the load lands; the sequence is admitted with its slot
    assert (with_adapter.seq_id, 0) in scheduled and with_adapter.adapter_slot == 0
    assert engine.written == [(0, "a")]


def test_slots_are_pinned_while_running_and_released_at_the_end() -> None:
    engine = Engine(max_loras=1)
    first_a, b = engine.add("a"), engine.add("b")
    assert engine.step() == [(first_a.seq_id, 0)]  # b waits: the only slot is a's
    second_a = engine.add("a")
    engine.step()
    # b waits for the slot, so it drains: the new a request is not admitted either.
    assert b.status is SequenceStatus.WAITING and second_a.status is SequenceStatus.WAITING
    engine.finish(first_a)
    assert engine.step() == [(b.seq_id, 0)] and engine.written[-1] == (0, "b")
    engine.finish(b)
    assert engine.step() == [(second_a.seq_id, 0)] and engine.written[-1] == (0, "a")


def test_preemption_releases_the_slot() -> None:
    engine = Engine(max_loras=1, num_blocks=3)
    old = engine.add("a", prompt_len=4, max_tokens=8)
    engine.step()
    young = engine.add("a", prompt_len=4, max_tokens=8)
    engine.step()
    assert old.adapter_slot == 0 and young.adapter_slot == 0
    for _ in range(6):  # 3 blocks of 4 tokens cannot hold both as they grow
        engine.step()
        if young.num_preemptions:
            break
    assert young.num_preemptions == 1
    assert young.status is SequenceStatus.WAITING and young.adapter_slot == -1
    engine.finish(old)
    engine.step()
    assert young.status is SequenceStatus.RUNNING and young.adapter_slot == 0


def test_a_failed_load_names_the_waiting_sequences() -> None:
    engine = Engine(broken=("c",))
    seq = engine.add("c")
    engine.gate.poll()
    engine.executor.run_all()
    failures = engine.gate.poll()
    assert [(seq_id, type(error)) for seq_id, error in failures] == [
        (seq.seq_id, FailedPreconditionError)
    ]
    engine.finish(seq)
    assert engine.gate.num_held == 0


class SlicedSlots:
    """One slot time-sliced at 0.5 s between adapters a and b, on a clock the test moves."""

    def __init__(self, *, first_token_joins: bool = True) -> None:
        self.now = [0.0]
        self.executor = ManualExecutor()
        self.manager = AdapterManager(
            max_loras=1,
            max_cpu_loras=2,
            load=lambda record: record.name,
            write_slot=lambda slot, weights: None,
            executor=self.executor,
            clock=lambda: self.now[0],
        )
        for name in ("a", "b"):
            self.manager.register(AdapterRecord(name, name, "sum", 8, ("q_proj",)))
        self.gate = AdapterGate(
            self.manager, slot_quantum_s=0.5, first_token_joins=first_token_joins
        )
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
        self.scheduler = Scheduler(config, BlockManager(64, 4), self.gate)

    def parts(self) -> tuple:
        """(clock, manager, scheduler, add, step)."""
        return self.now, self.manager, self.scheduler, self.add, self.step

    def add(self, adapter: str | None) -> Sequence:
        seq_id = next(_ids)
        params = SamplingParams(max_tokens=50)
        seq = Sequence(seq_id, f"r{seq_id}", [1, 2, 3, 4], params, adapter=adapter)
        self.gate.hold(seq)
        self.scheduler.add(seq)
        return seq

    def step(self) -> None:
        self.gate.poll()
        self.executor.run_all()
        self.gate.poll()
        for seq, count in self.scheduler.schedule().scheduled:
            seq.num_computed_tokens += count
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(5)


def test_a_turn_is_due_only_when_a_schedule_could_change_who_holds_the_slots() -> None:
    """What lets the engine plan a step ahead (services/engine/overlap.py) with requests paused
    or waiting for a slot: nothing a plain schedule would do for them now."""
    now, manager, scheduler, add, step = SlicedSlots().parts()

    first = add("a")
    step()
    assert first in scheduler.running and not scheduler.adapter_turn_due()
    second = add("b")
    step()  # b's weights load and find the one slot pinned by a: it starts draining
    assert manager.draining_slots == (0,) and second.status is SequenceStatus.WAITING
    assert not scheduler.adapter_turn_due()  # b waits out a's quantum: nothing to change
    now[0] += 0.6
    assert scheduler.adapter_turn_due()  # the quantum passed: a's slot is due to yield
    step()
    assert first in scheduler.paused and second in scheduler.running
    assert manager.draining_slots == (0,)  # a, paused, asked at once: b's turn is counted
    assert not scheduler.adapter_turn_due()
    step()
    assert not scheduler.adapter_turn_due() and first in scheduler.paused
    now[0] += 0.6
    assert scheduler.adapter_turn_due()  # b's quantum passed: a resumes next
    step()
    assert first in scheduler.running and second in scheduler.paused
    base = add(None)
    assert scheduler.adapter_turn_due()  # a base-model request can always be admitted
    step()
    assert base in scheduler.running


@pytest.mark.parametrize("joins", [True, False])
def test_a_new_request_of_a_draining_adapter_gets_its_first_token_before_the_turn(
    joins: bool,
) -> None:
    """With --lora-first-token-joins (the default) a request whose adapter's slot is draining
    for another adapter is prefilled beside that adapter's running sequences and paused with
    them at the turn; without it, it waits for its adapter's next turn."""
    now, manager, scheduler, add, step = SlicedSlots(first_token_joins=joins).parts()

    first = add("a")
    step()
    b = add("b")
    step()  # b's weights load; a's slot starts draining for it
    assert manager.draining_slots == (0,) and b.status is SequenceStatus.WAITING
    late = add("a")
    step()
    if joins:
        assert late in scheduler.running and late.num_output_tokens == 1
    else:
        assert late.status is SequenceStatus.WAITING and late.num_output_tokens == 0
    now[0] += 0.6
    step()  # the turn: a's sequences pause (the joiner too), b runs
    assert b in scheduler.running and first in scheduler.paused
    assert (late in scheduler.paused) is joins
    assert scheduler.num_pauses == (2 if joins else 1)
