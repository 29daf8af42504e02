"""Overlapped greedy steps: launch step N+1 before reading step N's sampled tokens.

Used by LLMEngine when its runner declares `overlap_max_batch` in its capabilities
(model_runner.RunnerCapabilities; the CUDA fast path does): `launch_greedy(batch)` enqueues
the forward pass and the GPU argmax and returns at once; `handle.result()` waits for that
step's token ids. While step N runs, the engine schedules step N+1 as if every
sequence of step N continues: each gets a placeholder token (sequence.PENDING_TOKEN) that the
runner fills on the device from step N's sampled ids, so the host never waits between steps.
Once step N's ids arrive the placeholders are resolved; a sequence that stopped at step N has
its step N+1 result discarded and its blocks freed (the device writes its step N+1 K/V into
them before any later step runs, as all steps share one stream).

What step N+1 may be depends on the runner. One that takes pending tokens in any step
(`overlap_mixed`: the CUDA fast path, in eager steps as in graph replays) gets any all-greedy
plan (`hold_back_ahead`): admissions, LoRA slot turns (pauses and resumes) and chunked
prefills as the plain path would schedule them, the sequences sure to stop at step N on length
left out, and no preemption of a sequence whose token is pending (the scheduler's `hold`
mode); the free blocks must cover every running sequence's next token. One such plan waits:
while step N ends prompts (the ids it samples are their first tokens) and the next plan would
take prompt rows (a request it could admit, a chunked prefill going on), step N is read first.
A step with prompt rows is launched kernel by kernel (no graph), and the ids of step N are read
only after that launch returns, so a first token would wait for the next request's prefill to
be launched (on an H100, with the kernels launched through Triton's dispatch, ~24 ms: a request
arriving ~30 ms after another got its first token ~40 ms late). Read first, the next step
starts ~1 ms later instead. Only at light load (FIRST_TOKENS_MAX_SEQUENCES running, none
paused for a LoRA slot turn): under load nearly every step ends a prompt while requests wait,
the plan of a step over hundreds of sequences takes the host milliseconds, and reading first
would leave the GPU idle that long each step (an H100 serving 100 adapters was busy 85-88 %
of the time instead of 95-99 %, 39-57 % of its steps not planned ahead). Otherwise
(`can_schedule_ahead`) step N+1 is the same running set, one token each, and only when that
cannot change what the plain path would do: every running sequence was sampled at step N,
none is certain to stop there on length, all sample plain argmax, no waiting request could be
admitted and no paused one resumed, no LoRA slot is due to change hands, and the free blocks
cover every sequence's next slot. A plan ahead that comes out empty only because it resumed
paused sequences (they run from the next plan on) is made once more, still ahead. Every step
that is not planned ahead waits for the one before it to be read; the engine counts it by one of
the reasons below (LLMEngine.plain_step_reasons, the stats line). Plain Python, no tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.errors import FailedPreconditionError
from services.engine.block_manager import BlockManager
from services.engine.outputs import FinishReason, SequenceDelta
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # the runner modules import torch; this module is plain Python
    from services.engine.forward_batch import ScheduledBatch
    from services.engine.model_runner import PendingTokens

logger = logging.getLogger(__name__)


# Why a step was not planned ahead (LLMEngine counts each plain step by one of these).
IDLE = "idle"  # nothing was in flight: the engine had nothing to run, or just started
ENDED = "ended"  # every sequence of the step in flight ended (stopped or aborted)
STEP_FAILED = "step failed"
LAUNCH_FAILED = "launch failed"
NOTHING_RUNNING = "nothing running"
NOT_RUNNING = "a sequence not running"
OVER_TOKEN_BUDGET = "over token budget"
PENDING_ELSEWHERE = "pending token off the step"
SAMPLING_RUNNING = "sampling running"
SAMPLING_QUEUED = "sampling queued"
KV_BLOCKS_SHORT = "KV blocks short"
ALL_STOP = "all stop"
EMPTY_PLAN = "empty plan"
FIRST_TOKENS = "first tokens due"  # step N ends prompts and the next takes prompt rows
# Up to this many running sequences (none paused for a LoRA slot turn) a step's first tokens are
# read before a plan with prompt rows; above it the plan goes ahead (see the module docstring).
FIRST_TOKENS_MAX_SEQUENCES = 32
RUNNING_SET_MAY_CHANGE = "running set may change"  # a runner without mixed launches


@dataclass
class LaunchedStep:
    """A step enqueued on the device whose sampled ids the host has not read yet."""

    handle: PendingTokens  # result() -> list[int], one id per sampled sequence
    scheduled: list[tuple[Sequence, int]]
    to_sample: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0
    launched_at: float = 0.0  # perf_counter when its launch began

    @property
    def all_finished(self) -> bool:
        return all(seq.status is SequenceStatus.FINISHED for seq, _ in self.scheduled)


def can_schedule_ahead(
    launched: LaunchedStep,
    scheduler: Scheduler,
    block_manager: BlockManager,
    *,
    max_batch: int,
    max_model_len: int,
    plain_greedy: Callable[[Sequence], bool],
) -> bool:
    """Whether the next step may be scheduled before `launched`'s tokens are read."""
    running = scheduler.running
    config = scheduler.config
    count = len(running)
    if not count or count != len(launched.to_sample) or count > max_batch:
        return False
    if count > config.max_num_batched_tokens:
        return False
    if scheduler.adapter_turn_due():
        # A waiting request could be admitted, a paused one resume or a LoRA slot change
        # hands: the plain path decides. Waiting and paused sequences whose adapters can get
        # no slot now stay as they are either way.
        return False
    sampled = {id(seq) for seq in launched.to_sample}
    new_blocks = 0
    for seq in running:
        if id(seq) not in sampled or seq.status is not SequenceStatus.RUNNING:
            return False
        if seq.num_pending_tokens != 1 or seq.num_uncomputed_tokens != 1:
            return False
        # The pending token is counted: the sequence stops there on length for sure.
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
            return False
        if not plain_greedy(seq):
            return False
        new_blocks += block_manager.num_new_blocks(seq, seq.num_computed_tokens + 1)
    return new_blocks <= block_manager.num_free_blocks


def hold_back_ahead(
    launched: LaunchedStep,
    scheduler: Scheduler,
    block_manager: BlockManager,
    *,
    max_model_len: int,
    plain_greedy: Callable[[Sequence], bool],
    queued_greedy: bool = False,
) -> set[int] | str:
    """Whether any all-greedy step may be planned before `launched`'s tokens are read, for a
    runner that takes pending tokens in every step (`overlap_mixed`): the seq_ids the plan must
    leave out (sure to stop at `launched` on length), or, where it may not, why not (a short
    reason the engine counts).

    Unlike `can_schedule_ahead`, the plan may admit waiting requests (prompt rows), pause and
    resume sequences for LoRA slot turns and go on with chunked prefills: every sequence's next
    input is known on the host or sampled on the device by `launched`. It must not preempt a
    sequence whose token is pending (the scheduler's `hold` mode never does) and every
    sequence it could schedule must sample plain argmax. `queued_greedy`: the caller knows that
    every waiting and paused sequence does (with hundreds of them, their scan is skipped).
    """
    running = scheduler.running
    if not running:
        return NOTHING_RUNNING
    if len(running) > scheduler.config.max_num_batched_tokens:
        return OVER_TOKEN_BUDGET
    sampled = {id(seq) for seq in launched.to_sample}
    hold: set[int] = set()
    new_blocks = 0
    num_new_blocks = block_manager.num_new_blocks
    slots_per_block = block_manager.block_size
    first_tokens = prompt_left = False
    for seq in running:
        if seq.status is not SequenceStatus.RUNNING:
            return NOT_RUNNING
        if id(seq) in sampled:
            if seq.num_pending_tokens != 1 or seq.num_uncomputed_tokens != 1:
                return PENDING_ELSEWHERE
            first_tokens = first_tokens or seq.num_output_tokens == 1  # its pending one
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
                hold.add(seq.seq_id)  # it stops at `launched`: nothing to plan for it
                continue
        elif seq.num_pending_tokens:
            return PENDING_ELSEWHERE
        else:
            prompt_left = prompt_left or seq.num_uncomputed_tokens > 1  # a chunked prefill
        if not plain_greedy(seq):
            return SAMPLING_RUNNING
        if seq.num_computed_tokens >= len(seq.block_table) * slots_per_block:
            new_blocks += num_new_blocks(seq, seq.num_computed_tokens + 1)
    if new_blocks > block_manager.num_free_blocks:
        return KV_BLOCKS_SHORT  # a decode would need a preemption: the plain path decides
    if len(hold) == len(running):
        return ALL_STOP
    if (
        first_tokens
        and len(running) <= FIRST_TOKENS_MAX_SEQUENCES
        and not scheduler.paused
        and (prompt_left or (scheduler.waiting and len(running) < scheduler.config.max_num_seqs))
    ):
        return FIRST_TOKENS  # read the first tokens before a launch with prompt rows
    if queued_greedy:
        return hold
    # A request the plan could admit or resume must sample plain argmax too (else the plain
    # path admits it: planning ahead again and again would keep it waiting).
    if any(not plain_greedy(entry[2]) for entry in scheduler.waiting):
        return SAMPLING_QUEUED
    if any(not plain_greedy(seq) for seq in scheduler.paused):
        return SAMPLING_QUEUED
    return hold


class OverlappedSteps:
    """LLMEngine's launch / collect half of an overlapped step (mixed into LLMEngine, whose
    scheduler, block manager, request table and delta helpers it uses)."""

    scheduler: Scheduler
    block_manager: BlockManager
    _launch_greedy: Callable[[ScheduledBatch], PendingTokens] | None
    _requests: dict[str, Sequence]
    _retire: Callable[[Sequence, FinishReason], None]
    _plain_greedy: Callable[[Iterable[tuple[Sequence, int]]], bool]
    # Seconds the host spent blocked reading launched steps' ids (waiting for the device).
    host_wait_s: float

    def _launch(
        self,
        plan: SchedulerOutput,
        deltas: list[SequenceDelta],
        *,
        continuation: bool = False,
        pure_decode: bool = False,
    ) -> LaunchedStep | None:
        """Enqueue a plain-greedy step; its sampled sequences get a pending token each.
        `continuation`: planned before the last launch's tokens were read (`pure_decode`: as
        `can_schedule_ahead` allows, the whole running set one token each)."""
        launched_at = time.perf_counter()
        try:
            if pure_decode and (
                plan.preempted
                or len(plan.scheduled) != len(self.scheduler.running)
                or any(count != 1 for _, count in plan.scheduled)
            ):
                raise FailedPreconditionError("a step scheduled ahead is not a pure decode step")
            if continuation and not self._plain_greedy(plan.scheduled):
                raise FailedPreconditionError("a step planned ahead samples other than argmax")
            if self._launch_greedy is None:
                raise FailedPreconditionError("the model runner cannot launch without waiting")
            handle = self._launch_greedy(plan.batch)
        except Exception as exc:
            logger.exception("launching a forward step failed")
            for seq, _ in plan.scheduled:
                deltas.append(self._fail(seq, f"the engine failed this request: {exc}"))
            return None
        launched = LaunchedStep(
            handle, plan.scheduled, num_tokens=plan.batch.num_tokens, launched_at=launched_at
        )
        register = self.block_manager.register_computed_blocks
        block_size = self.block_manager.block_size
        for seq, count in plan.scheduled:
            computed = seq.num_computed_tokens = seq.num_computed_tokens + count
            # Most steps fill no block: the prefix cache is not asked then.
            if seq.num_pending_tokens == 0 and computed // block_size > seq.num_hashed_blocks:
                register(seq)
            if computed == len(seq.token_ids):
                launched.to_sample.append(seq)
        for seq in launched.to_sample:
            seq.append_pending_token()
        return launched

    def _collect(self, launched: LaunchedStep, deltas: list[SequenceDelta]) -> bool:
        """Read a launched step's ids, resolve pending tokens, apply stop conditions."""
        try:
            waited = time.perf_counter()
            tokens = launched.handle.result()
            self.host_wait_s += time.perf_counter() - waited
            if len(tokens) != len(launched.to_sample):
                raise FailedPreconditionError(
                    f"the runner returned {len(tokens)} ids for {len(launched.to_sample)} rows"
                )
        except Exception as exc:
            logger.exception("forward step failed")
            self._fail_step(launched, deltas, str(exc))
            return False
        register = self.block_manager.register_computed_blocks
        block_size = self.block_manager.block_size
        finished = SequenceStatus.FINISHED
        for seq, token in zip(launched.to_sample, tokens, strict=True):
            if seq.status is finished:
                continue  # aborted while the step ran (already reported)
            seq.resolve_pending_token(token)
            reason = self._stop_reason(seq, token, pending=seq.num_pending_tokens)
            if reason is not None:
                seq.drop_pending_tokens()  # its step scheduled ahead is discarded
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            if seq.num_computed_tokens // block_size > seq.num_hashed_blocks:
                register(seq)
            if reason is not None:
                self._retire(seq, reason)
            deltas.append(self._delta(seq, [token], None, reason))
        return True

    def _fail_step(self, step: LaunchedStep | None, deltas: list[SequenceDelta], why: str) -> None:
        """Fail every live sequence of a launched step."""
        if step is not None:
            for seq, _ in step.scheduled:
                if seq.status is not SequenceStatus.FINISHED:
                    deltas.append(self._fail(seq, f"the engine failed this request: {why}"))
        return None
