"""Iteration-level scheduler: which sequences run in the next forward step, and how much of each.

Plain Python, no tensors. Each step has a token budget (`max_num_batched_tokens`) and a sequence
cap (`max_num_seqs`). Running sequences go first: decodes (one token each), then prompts still
being prefilled in chunks; then waiting requests are admitted by (priority, arrival), lower
priority values first, each taking as much of the remaining budget as it needs (chunked
prefill). When a running sequence needs a KV block and none is free, the running sequence with
the lowest priority (highest value, latest arrival) is preempted by recompute: its blocks are
freed and it waits again, to be recomputed from its prompt plus the tokens it already generated.
A request that could never fit (more blocks than the whole cache) is refused at `add`.
With LoRA adapters, a waiting sequence is admitted only once its adapter has a device slot
(`AdapterSlots.acquire`); until then it stays waiting and sequences behind it go ahead. With
slot time-slicing, when an adapter waits for a slot that running sequences have held for a
quantum (`AdapterSlots.slots_to_yield`), those sequences are paused: out of the batch, slot
unpinned, KV kept; they resume (after this step's admissions) once their adapter has a slot
again, and are the first to give their blocks back when KV blocks run out. With swap space
(`HostBlocks`, services/engine/swap_space.py) a paused sequence's blocks move to host memory
(`SchedulerOutput.swap_out`, copied by services/engine/kv_swap.py before the step runs) and
come back when it resumes (`swap_in`): a waiting request of any rank may push paused sequences
out that way, and a swapped-out sequence whose adapter has its slot again keeps the blocks it
needs from admissions until it is back. Without room there, a paused sequence is preempted
by recompute (for a waiting request, only one of lower rank than it).
With a step-time target (a `PrefillBudget`, services/engine/step_budget.py), the prompt tokens
of a step (running chunked prefills and admissions together) are further capped by what the
budget allows beside the step's decodes; without one, only the token budget counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from services.common.errors import ResourceExhaustedError
from services.engine.block_manager import BlockManager
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from services.engine.sequence import Sequence, SequenceStatus
from services.engine.swap_space import HostBlocks


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    admission_watermark: float = 0.01  # share of blocks kept free when admitting new prompts


@dataclass
class SchedulerOutput:
    """One step's plan: the batch for the model runner and how many tokens each sequence runs."""

    batch: ScheduledBatch
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # KV copies to make before this step runs: (device blocks, first host block) of each
    # sequence swapped out, (first host block, device blocks) of each one swapped back in.
    swap_out: list[tuple[list[int], int]] = field(default_factory=list)
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out or self.swap_in)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class AdapterSlots(Protocol):
    """The engine's LoRA slots as the scheduler sees them (services/engine/lora/gate.py)."""

    def acquire(self, seq: Sequence) -> bool:
        """Pin `seq`'s adapter slot (sets seq.adapter_slot); False: it must keep waiting."""
        ...

    def release(self, seq: Sequence) -> None:
        """`seq` stops running: unpin its slot (seq.adapter_slot back to -1)."""
        ...

    def drop(self, seq: Sequence) -> None:
        """`seq` is finished or aborted: unpin its slot and forget its adapter use."""
        ...

    def slots_to_yield(self) -> list[int]:
        """Slots whose running sequences should pause now."""
        ...

    def turn_due(self, sequences: Iterable[Sequence]) -> bool:
        """Whether a schedule now could change who holds the slots (besides slots_to_yield):
        a slot due to start draining, or one of these (paused or waiting) sequences able to
        get its adapter's slot."""
        ...

    def could_acquire(self, seq: Sequence) -> bool:
        """Whether `acquire(seq)` could pin its adapter's slot now (changes nothing)."""
        ...


class PrefillBudget(Protocol):
    """A step-time target as the scheduler sees it (services/engine/step_budget.py)."""

    def prefill_tokens(self, decode_rows: int) -> int:
        """Most prompt tokens a step may take beside `decode_rows` decodes."""
        ...


# Scheduling order: lower priority value first, then earlier arrival (a C-level key).
_rank = attrgetter("priority", "arrival")


def _cached_one_token_last(item: tuple[Sequence, int]) -> bool:
    """Sort key that puts one-token steps of sequences with cached tokens first."""
    return not (item[1] == 1 and item[0].num_computed_tokens > 0)


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recompute."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        adapter_slots: AdapterSlots | None = None,
        prefill_budget: PrefillBudget | None = None,
        host_blocks: HostBlocks | None = None,
    ):
        self.config = config
        self.block_manager = block_manager
        self.adapter_slots = adapter_slots
        self.prefill_budget = prefill_budget
        self.host_blocks = host_blocks  # swap space for paused sequences' KV (None: none)
        self.waiting: list[tuple[tuple[int, int], int, Sequence]] = []  # heap by rank
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []  # running, KV kept, out of the batch: no adapter slot
        self._resumed: set[int] = set()  # seq_ids resumed by the last schedule: not run yet
        self._planning_ahead = False  # the schedule in progress was called with `hold`
        self.num_preemptions = 0
        self.num_pauses = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swapped = 0  # paused sequences whose KV blocks are in host memory now
        # Device blocks the highest-ranked swapped-out sequence able to resume lacked at the
        # last schedule: admissions leave them free, so it comes back before newer requests.
        self._swap_in_reserve = 0
        # Called with each plan that moves KV blocks, before it is returned (the engine's copies:
        # services/engine/kv_swap.py), so they are issued ahead of the step it launches.
        self.on_swaps: Callable[[SchedulerOutput], None] | None = None
        self._watermark_blocks = int(config.admission_watermark * block_manager.num_blocks)

    # ---- requests -------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Raise ResourceExhaustedError if `seq` could never fit in the KV cache, even alone."""
        needed = self.block_manager.blocks_needed(seq.max_total_tokens)
        if needed > self.block_manager.num_blocks:
            raise ResourceExhaustedError(
                f"request {seq.request_id!r} needs up to {seq.max_total_tokens} tokens "
                f"(prompt {seq.num_prompt_tokens} + max_tokens {seq.params.max_tokens}) = "
                f"{needed} KV blocks of {self.block_manager.block_size} tokens, but the cache "
                f"has only {self.block_manager.num_blocks} blocks"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (_rank(seq), seq.seq_id, seq))

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.paused:
            self.paused.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting = [entry for entry in self.waiting if entry[2] is not seq]
            heapq.heapify(self.waiting)
        if self.adapter_slots is not None and seq.status is not SequenceStatus.FINISHED:
            self.adapter_slots.drop(seq)
        self.block_manager.free(seq)
        self._free_host_extent(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def resumed_last(self) -> bool:
        """Whether the last schedule resumed paused sequences (they run from the next one)."""
        return bool(self._resumed)

    @property
    def num_running(self) -> int:
        """Running sequences, paused ones included (they hold KV and will go on)."""
        return len(self.running) + len(self.paused)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.paused)

    def adapter_turn_due(self) -> bool:
        """Whether a schedule now could pause, resume or admit anything: a waiting sequence
        that could be admitted, a paused one that could resume, a LoRA slot to yield or drain.
        False means the running set stays as it is (a step may be planned ahead)."""
        room = len(self.running) < self.config.max_num_seqs
        if self.adapter_slots is None:
            return bool(self.waiting) and room  # (nothing pauses without adapters)
        if not (self.waiting or self.paused):
            return False
        candidates = [entry[2] for entry in self.waiting] if room else []
        return self.adapter_slots.turn_due([*self.paused, *candidates]) or bool(
            self.adapter_slots.slots_to_yield()
        )

    # ---- one step -------------------------------------------------------------------------
    def schedule(self, *, rotate: bool = True, hold: Set[int] | None = None) -> SchedulerOutput:
        """The next step. `rotate=False` (a pure decode step planned before the last one's
        tokens are read) pauses and resumes nothing: the running set stays as it is.

        `hold` (a step planned before the last one's tokens are read, services/engine/overlap.py):
        the running sequences with these seq_ids are left out of the step, and no sequence
        whose token is still pending is preempted: a running sequence that needs a block when
        none is free just sits this step out, and only paused sequences with all their tokens
        known give their blocks back."""
        budget = self.config.max_num_batched_tokens
        output = SchedulerOutput(batch=ScheduledBatch())
        self._planning_ahead = hold is not None
        if not self.paused:
            self._swap_in_reserve = 0  # the sequence it was kept for is gone
        if rotate and self.adapter_slots is not None:
            self._pause_yielding_slots()
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int]] = []

        # Running sequences: decodes first, then chunked prefills, each group by rank.
        running_decodes: list[Sequence] = []
        running_prefills: list[Sequence] = []
        for seq in self.running:
            if len(seq.token_ids) - seq.num_computed_tokens > 1:
                running_prefills.append(seq)
            else:
                running_decodes.append(seq)
        running_decodes.sort(key=_rank)
        running_prefills.sort(key=_rank)
        candidates = running_decodes + running_prefills
        kept: list[Sequence] = []
        if hold:
            kept = [seq for seq in candidates if seq.seq_id in hold]
            candidates = [seq for seq in candidates if seq.seq_id not in hold]
        slots_per_block = self.block_manager.block_size
        uncached_decode = False  # a one-token prompt: it goes after the cached one-token steps
        # Prompt tokens the step-time target leaves (None: not asked yet, or no target). The
        # decodes come first among the candidates, so it is asked once they are all counted.
        prefill_left: int | None = None
        index = 0
        while index < len(candidates) and budget > 0:
            seq = candidates[index]
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            limit = budget
            if uncomputed > 1 and self.prefill_budget is not None:
                if prefill_left is None:
                    prefill_left = self._prefill_left(len(decodes), budget)
                if prefill_left <= 0:
                    break  # the rest are prefills too: they wait for the next step
                limit = prefill_left
            index += 1
            num_tokens = min(uncomputed, limit)
            needed_slots = seq.num_computed_tokens + num_tokens
            # Most steps need no new block (a decode inside its last block): skip the manager.
            if needed_slots > len(seq.block_table) * slots_per_block:
                while not self.block_manager.allocate(seq, needed_slots):
                    paused = self._preemptible_paused()
                    if paused:  # paused sequences give their blocks back first
                        victim = self._paused_victim(paused)
                        if not self._swap_out(victim, output):
                            self._preempt(victim, output)
                        continue
                    if self._planning_ahead:  # no preemption: it sits this step out
                        break
                    victim = max([*candidates[index:], seq], key=_rank)
                    if victim is not seq:
                        candidates.remove(victim)
                    self._preempt(victim, output)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                if needed_slots > len(seq.block_table) * slots_per_block:
                    kept.append(seq)  # planning ahead found no block for it
                    continue
            kept.append(seq)
            budget -= num_tokens
            if uncomputed == 1:
                decodes.append((seq, num_tokens))
                uncached_decode = uncached_decode or seq.num_computed_tokens == 0
            else:
                prefills.append((seq, num_tokens))
                if prefill_left is not None:
                    prefill_left -= num_tokens
        kept.extend(candidates[index:])  # not scheduled this step (budget spent), still running
        self.running = kept

        # Admit waiting requests while budget, sequence slots and blocks allow.
        if not output.preempted:
            if self.prefill_budget is not None and self.waiting:
                if prefill_left is None:
                    prefill_left = self._prefill_left(len(decodes), budget)
                budget = min(budget, prefill_left)
            self._admit(budget, prefills, output)
        if rotate and self.paused:
            self._resume_paused(output)

        # One-token steps of sequences with cached tokens (decodes, and prompts whose prefix
        # came from the cache or a previous chunk) go first: the runner relies on that order.
        planned = decodes + prefills
        if prefills or uncached_decode:
            planned.sort(key=_cached_one_token_last)
        batch_sequences = output.batch.sequences
        for seq, num_tokens in planned:
            start = seq.num_computed_tokens
            end = start + num_tokens
            batch_sequences.append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids[start:end],
                    start_position=start,
                    block_table=list(seq.block_table),
                    needs_logits=end == len(seq.token_ids),
                    adapter_slot=seq.adapter_slot,
                )
            )
        output.scheduled = planned
        if self.on_swaps is not None and output.has_swaps:
            self.on_swaps(output)
        return output

    def _prefill_left(self, decode_rows: int, budget: int) -> int:
        """Prompt tokens this step may take: the step-time target's share, within `budget`."""
        return min(budget, self.prefill_budget.prefill_tokens(decode_rows))

    def _admit(
        self, budget: int, prefills: list[tuple[Sequence, int]], output: SchedulerOutput
    ) -> None:
        manager = self.block_manager
        adapters = self.adapter_slots
        # Adapter loading or no slot, and paused sequences preempted for room: queued again
        # once the loop is done (the head must stay the sequence being admitted).
        skipped: list[tuple[tuple[int, int], int, Sequence]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0][2]
            if adapters is not None and seq.adapter is not None and not adapters.acquire(seq):
                skipped.append(heapq.heappop(self.waiting))
                continue
            if not seq.block_table:
                cached = manager.match_prefix(seq)
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            needed = manager.num_new_blocks(seq, seq.num_computed_tokens + num_tokens)
            reserve = (self._watermark_blocks if self.running else 0) + self._swap_in_reserve
            while needed + reserve > manager.num_free_blocks:
                paused = self._preemptible_paused()
                if not paused:
                    break
                victim = self._paused_victim(paused)  # paused KV of lower rank goes first
                if self._swap_out(victim, output):
                    continue  # no work lost: any rank's blocks may go to host memory
                if _rank(victim) <= _rank(seq):
                    break
                self._preempt(victim, output, requeue=False)
                skipped.append((_rank(victim), victim.seq_id, victim))  # queued after the loop
            if needed + reserve > manager.num_free_blocks or not manager.allocate(
                seq, seq.num_computed_tokens + num_tokens
            ):
                # Give back the cached prefix so the blocks stay evictable while it waits.
                manager.free(seq)
                seq.num_computed_tokens = 0
                if adapters is not None:
                    adapters.release(seq)
                break
            heapq.heappop(self.waiting)
            if seq.num_preemptions == 0:
                manager.record_lookup(seq.num_prompt_tokens, seq.num_cached_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= num_tokens
            prefills.append((seq, num_tokens))
        for entry in skipped:
            heapq.heappush(self.waiting, entry)

    def _preemptible_paused(self) -> list[Sequence]:
        """Paused sequences that may give their device blocks back now: those holding some
        (not swapped out) and, planning ahead, whose tokens are all known (one paused by this
        very plan has its token pending)."""
        if not self._planning_ahead:
            return [seq for seq in self.paused if seq.block_table]
        return [seq for seq in self.paused if seq.block_table and not seq.num_pending_tokens]

    def _paused_victim(self, paused: list[Sequence]) -> Sequence:
        """The paused sequence to give its device blocks back: the lowest-ranked one; with
        swap space, among those whose adapter could not have its slot now where there are
        any (the others may resume at this very schedule, and would only come back in)."""
        if self.host_blocks is not None and self.adapter_slots is not None:
            could_acquire = self.adapter_slots.could_acquire
            idle = [seq for seq in paused if not could_acquire(seq)]
            if idle:
                return max(idle, key=_rank)
        return max(paused, key=_rank)

    def _swap_out(self, seq: Sequence, output: SchedulerOutput) -> bool:
        """Move a paused sequence's KV blocks to host memory; False where there is no swap
        space, no extent long enough, or a token of it still pending."""
        if self.host_blocks is None or not seq.block_table or seq.num_pending_tokens:
            return False
        count = len(seq.block_table)
        start = self.host_blocks.allocate(count)
        if start is None:
            return False
        output.swap_out.append((list(seq.block_table), start))
        self.block_manager.free(seq)  # num_computed_tokens stays: the KV is only elsewhere
        seq.host_extent = (start, count)
        self.num_swap_outs += 1
        self.num_swapped += 1
        return True

    def _swap_in(self, seq: Sequence, output: SchedulerOutput) -> bool:
        """Give a swapped-out sequence device blocks again and plan the copy back; False
        where the cache lacks them (beyond the admission watermark)."""
        start, count = seq.host_extent
        manager = self.block_manager
        reserve = self._watermark_blocks if self.running else 0
        if count + reserve > manager.num_free_blocks:
            return False
        manager.allocate(seq, count * manager.block_size)
        output.swap_in.append((start, list(seq.block_table)))
        self._free_host_extent(seq)
        self.num_swap_ins += 1
        return True

    def _free_host_extent(self, seq: Sequence) -> None:
        if seq.host_extent is not None:
            self.host_blocks.free(*seq.host_extent)
            seq.host_extent = None
            self.num_swapped -= 1

    def _pause_yielding_slots(self) -> None:
        """Pause the running sequences of the slots that must change hands."""
        slots = set(self.adapter_slots.slots_to_yield())
        resumed, self._resumed = self._resumed, set()
        # A slot whose sequences were resumed by the last schedule runs them once first.
        slots -= {seq.adapter_slot for seq in self.running if seq.seq_id in resumed}
        if not slots:
            return
        for seq in [seq for seq in self.running if seq.adapter_slot in slots]:
            self.adapter_slots.release(seq)
            self.running.remove(seq)
            self.paused.append(seq)
            self.num_pauses += 1

    def _resume_paused(self, output: SchedulerOutput) -> None:
        """Paused sequences whose adapter can have a slot again run from the next step on
        (a swapped-out one once device blocks for its KV are free: they are copied back)."""
        adapters = self.adapter_slots
        room = self.config.max_num_seqs - len(self.running)
        resumed: list[Sequence] = []
        self._swap_in_reserve = 0
        for seq in sorted(self.paused, key=_rank):
            if room <= 0:
                break
            if adapters is not None and not adapters.acquire(seq):
                continue
            if seq.host_extent is not None and not self._swap_in(seq, output):
                if adapters is not None:
                    adapters.release(seq)
                if not self._swap_in_reserve:
                    self._swap_in_reserve = seq.host_extent[1]
                continue
            self.running.append(seq)
            self._resumed.add(seq.seq_id)
            resumed.append(seq)
            room -= 1
        if resumed:  # one pass over the paused list, not a removal per resumed sequence
            gone = set(map(id, resumed))
            self.paused = [seq for seq in self.paused if id(seq) not in gone]

    def _preempt(self, seq: Sequence, output: SchedulerOutput, *, requeue: bool = True) -> None:
        if seq in self.paused:
            self.paused.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        if self.adapter_slots is not None:
            self.adapter_slots.release(seq)
        self.block_manager.free(seq)
        self._free_host_extent(seq)
        seq.reset_for_recompute()
        if requeue:
            heapq.heappush(self.waiting, (_rank(seq), seq.seq_id, seq))
        output.preempted.append(seq)
        self.num_preemptions += 1
