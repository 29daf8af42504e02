"""Scheduler policy in plain Python: budget, decodes first, priority, preemption, refusal."""

from __future__ import annotations

import pytest

from services.common.errors import ResourceExhaustedError
from services.common.protocol.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, SequenceStatus

_ids = iter(range(10**9))


def make_scheduler(num_blocks=32, block_size=4, max_num_seqs=8, budget=32) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


def make_seq(prompt_len: int, priority: int = 0, max_tokens: int = 8) -> Sequence:
    seq_id = next(_ids)
    return Sequence(
        seq_id,
        f"r{seq_id}",
        list(range(1, prompt_len + 1)),
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
    )


def complete_step(scheduler: Scheduler, output) -> None:
    """What the engine does after a forward: advance progress and append a sampled token."""
    for seq, count in output.scheduled:
        seq.num_computed_tokens += count
        scheduler.block_manager.register_computed_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(5)


def test_budget_chunks_long_prompts():
    scheduler = make_scheduler(budget=10)
    seq = make_seq(25)
    scheduler.add(seq)
    chunks = []
    for _ in range(3):
        output = scheduler.schedule()
        assert output.batch.num_tokens <= 10
        scheduled = output.batch.sequences[0]
        chunks.append((scheduled.start_position, len(scheduled.token_ids), scheduled.needs_logits))
        complete_step(scheduler, output)
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]
    output = scheduler.schedule()  # now a decode of the sampled token
    assert [(s.start_position, s.token_ids) for s in output.batch.sequences] == [(25, [5])]


def test_decodes_come_first_and_respect_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2, budget=64)
    first, second, third = make_seq(3), make_seq(4), make_seq(5)
    scheduler.add(first)
    complete_step(scheduler, scheduler.schedule())
    scheduler.add(second)
    scheduler.add(third)
    output = scheduler.schedule()
    ids = [s.seq_id for s in output.batch.sequences]
    assert ids == [first.seq_id, second.seq_id]  # decode first; third waits for a slot
    assert output.batch.sequences[0].token_ids == [5]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1


def test_priority_then_arrival_order_for_admission():
    scheduler = make_scheduler(max_num_seqs=1)
    low, high, high_later = make_seq(3, priority=2), make_seq(3, priority=1), make_seq(3, 1)
    for seq in (low, high_later, high):
        scheduler.add(seq)
    assert scheduler.schedule().batch.sequences[0].seq_id == high.seq_id


def test_preemption_takes_lowest_priority_latest_arrival():
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    keep, victim = make_seq(8, priority=0, max_tokens=10), make_seq(8, priority=3, max_tokens=10)
    other = make_seq(7, priority=0, max_tokens=10)
    for seq in (keep, other, victim):
        scheduler.add(seq)
    output = scheduler.schedule()
    assert len(output.scheduled) == 3  # 2 + 2 + 2 blocks
    complete_step(scheduler, output)
    # keep and victim need a 3rd block for their decode; none is free -> victim is preempted.
    output = scheduler.schedule()
    assert output.preempted == [victim]
    assert victim.status is SequenceStatus.WAITING and victim.block_table == []
    assert victim.num_computed_tokens == 0 and victim.output_token_ids == [5]
    assert {s.seq_id for s in output.batch.sequences} == {keep.seq_id, other.seq_id}
    assert scheduler.num_preemptions == 1


def test_preempted_sequence_is_recomputed_with_its_output():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, max_num_seqs=1)
    seq = make_seq(6)
    scheduler.add(seq)
    output = scheduler.schedule()
    complete_step(scheduler, output)
    scheduler._preempt(seq, output)
    output = scheduler.schedule()
    scheduled = output.batch.sequences[0]
    # The first full block comes back from the prefix cache; the rest, including the token
    # generated before the preemption, is recomputed and sampled from.
    assert scheduled.start_position == 4
    assert scheduled.token_ids == [5, 6, 5]
    assert scheduled.needs_logits


def test_request_that_can_never_fit_is_refused():
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ResourceExhaustedError, match="only 4 blocks"):
        scheduler.add(make_seq(10, max_tokens=7))  # 17 tokens = 5 blocks
    scheduler.add(make_seq(10, max_tokens=6))  # 16 tokens = 4 blocks: fits alone
    assert scheduler.num_waiting == 1


def test_finish_frees_blocks_in_any_state():
    scheduler = make_scheduler(num_blocks=8, budget=4)
    running, waiting = make_seq(10), make_seq(10)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    scheduler.finish(running)
    scheduler.finish(waiting)
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 8


def test_decodes_get_a_new_block_only_at_a_block_boundary():
    scheduler = make_scheduler(block_size=4)
    seq = make_seq(3, max_tokens=8)
    scheduler.add(seq)
    tables = []
    for _ in range(4):
        output = scheduler.schedule()
        assert output.batch.sequences[0].block_table == seq.block_table
        tables.append(len(seq.block_table))
        complete_step(scheduler, output)
    # prompt 3 tokens (1 block), decodes at positions 3 (same block), 4, 5 (second block)
    assert tables == [1, 1, 2, 2]
    batch_seq = scheduler.schedule().batch.sequences[0]
    assert batch_seq.start_position == 6 and batch_seq.needs_logits


def test_one_token_prompt_goes_after_cached_decodes():
    scheduler = make_scheduler()
    decoding = make_seq(2)
    scheduler.add(decoding)
    complete_step(scheduler, scheduler.schedule())
    single = make_seq(1, priority=-1)  # ranks first, but has nothing cached
    scheduler.add(single)
    output = scheduler.schedule()
    assert [seq for seq, _ in output.scheduled] == [decoding, single]
    assert [len(s.token_ids) for s in output.batch.sequences] == [1, 1]
    # next step both are cached one-token decodes, in rank order
    complete_step(scheduler, output)
    assert [seq for seq, _ in scheduler.schedule().scheduled] == [single, decoding]
