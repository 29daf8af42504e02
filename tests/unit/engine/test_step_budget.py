"""The step-time target: prefill tokens from fitted step costs, and the scheduler that obeys it."""

from __future__ import annotations

import itertools
import random

import pytest

from services.common.protocol.sampling_params import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.load_rates import StepCost
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence
from services.engine.step_budget import StepTimeBudget, build_step_budget

# 2 ms fixed, 0.5 ms a decode row, 0.01 ms a prefill token.
COST = StepCost(fixed_ms=2.0, per_decode_row_ms=0.5, per_prefill_token_ms=0.01)
_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int = 8, seq_id: int | None = None) -> Sequence:
    seq_id = next(_ids) if seq_id is None else seq_id
    prompt = [1 + (seq_id * 7 + i) % 50 for i in range(prompt_len)]
    return Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens))


def make_scheduler(budget=None, tokens=256, num_blocks=256) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=tokens, max_model_len=4096)
    return Scheduler(config, BlockManager(num_blocks, 4), prefill_budget=budget)


def complete_step(scheduler: Scheduler, output) -> None:
    """What the engine does after a forward: advance progress, append a token, finish."""
    for seq, count in output.scheduled:
        seq.num_computed_tokens += count
        scheduler.block_manager.register_computed_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(5)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq)


def split(output) -> tuple[int, int]:
    """(decode rows, prefill tokens) of a step."""
    decodes = sum(1 for _, count in output.scheduled if count == 1)
    return decodes, sum(count for _, count in output.scheduled if count > 1)


def with_decodes(scheduler: Scheduler, count: int) -> list[Sequence]:
    """`count` running sequences past their prefill (the next step decodes them)."""
    seqs = [make_seq(4, max_tokens=50) for _ in range(count)]
    for seq in seqs:
        scheduler.add(seq)
    complete_step(scheduler, scheduler.schedule())
    return seqs


# ---- StepTimeBudget ---------------------------------------------------------------------------
def test_prefill_tokens_keep_the_predicted_step_within_the_target():
    budget = StepTimeBudget(20.0, 8192, lambda: COST)
    # 20 ms - 2 ms - 10 rows * 0.5 ms = 13 ms of prefill at 0.01 ms a token.
    assert budget.prefill_tokens(10) == 1300
    assert COST.predict_ms(10, budget.prefill_tokens(10)) == pytest.approx(20.0)
    assert budget.prefill_tokens(20) == 800
    assert StepTimeBudget(1000.0, 8192, lambda: COST).prefill_tokens(10) == 8192  # token cap


def test_minimum_chunk_when_decodes_alone_exceed_the_target():
    budget = StepTimeBudget(20.0, 8192, lambda: COST, min_chunk_tokens=64)
    assert budget.prefill_tokens(36) == 64  # 2 + 18 ms: no time left
    assert budget.prefill_tokens(500) == 64
    assert StepTimeBudget(20.0, 32, lambda: COST).min_chunk_tokens == 32  # never above the cap


def test_token_budget_without_measurements_or_decodes():
    assert StepTimeBudget(5.0, 4096, lambda: None).prefill_tokens(100) == 4096
    free = StepCost(fixed_ms=2.0, per_decode_row_ms=0.5, per_prefill_token_ms=0.0)
    assert StepTimeBudget(5.0, 4096, lambda: free).prefill_tokens(100) == 4096
    assert StepTimeBudget(5.0, 4096, lambda: COST).prefill_tokens(0) == 4096  # no decode waits


def test_target_zero_builds_no_budget():
    config = EngineConfig(model="fake", device="cpu", max_num_batched_tokens=512)
    assert build_step_budget(config, lambda: COST) is None
    with_target = EngineConfig(
        model="fake", device="cpu", max_num_batched_tokens=512, target_step_ms=20.0
    )
    budget = build_step_budget(with_target, lambda: COST)
    assert budget.target_step_ms == 20.0 and budget.max_num_batched_tokens == 512
    with pytest.raises(Exception, match="target_step_ms"):
        EngineConfig(model="fake", device="cpu", target_step_ms=-1.0)


# ---- the scheduler under a budget -------------------------------------------------------------
def test_scheduler_caps_prefill_tokens_to_the_time_budget():
    # 10 decode rows: 2 + 5 ms, so a 10 ms target leaves 300 prefill tokens; the token budget
    # alone would give the prompts 502.
    budget = StepTimeBudget(10.0, 512, lambda: COST, min_chunk_tokens=16)
    scheduler = make_scheduler(budget, tokens=512)
    with_decodes(scheduler, 10)
    long, short = make_seq(400), make_seq(100)
    scheduler.add(long)
    scheduler.add(short)
    output = scheduler.schedule()
    assert split(output) == (10, 300)
    assert [(seq, count) for seq, count in output.scheduled if count > 1] == [(long, 300)]
    complete_step(scheduler, output)
    output = scheduler.schedule()  # the running chunk first, then the next prompt, within 300
    assert split(output) == (10, 200)
    assert [(seq, count) for seq, count in output.scheduled if count > 1] == [
        (long, 100),
        (short, 100),
    ]
    assert COST.predict_ms(*split(output)) <= 10.0


def test_scheduler_keeps_a_minimum_chunk_when_decodes_fill_the_target():
    budget = StepTimeBudget(4.0, 256, lambda: COST, min_chunk_tokens=16)
    scheduler = make_scheduler(budget)
    with_decodes(scheduler, 8)  # 2 + 4 ms > 4 ms
    seq = make_seq(100)
    scheduler.add(seq)
    for start in (0, 16, 32):
        output = scheduler.schedule()
        assert split(output) == (8, 16)
        assert output.batch.sequences[-1].start_position == start
        complete_step(scheduler, output)


def test_scheduler_uses_the_token_budget_before_any_measurement():
    def plans(budget):
        scheduler = make_scheduler(budget, tokens=128)
        with_decodes(scheduler, 4)
        scheduler.add(make_seq(300))
        return [split(scheduler.schedule())]

    assert plans(StepTimeBudget(1.0, 128, lambda: None)) == plans(None) == [(4, 124)]


class _Recording:
    """A budget that never binds, and the decode rows it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def prefill_tokens(self, decode_rows: int) -> int:
        self.asked.append(decode_rows)
        return 10**9


def test_a_budget_that_never_binds_schedules_exactly_as_none():
    """The same random workload (chunking, admission, preemption) with and without a budget."""

    preemptions = []

    def run(budget) -> list[list[tuple[int, int, int]]]:
        rng, ids = random.Random(7), itertools.count()
        scheduler = make_scheduler(budget, tokens=48, num_blocks=24)
        plans = []
        for step in range(120):
            if step < 60 and rng.random() < 0.4:
                prompt_len, max_tokens = rng.randint(2, 50), rng.randint(1, 40)
                scheduler.add(make_seq(prompt_len, max_tokens, seq_id=next(ids)))
            output = scheduler.schedule()
            plans.append(
                [(s.seq_id, s.start_position, len(s.token_ids)) for s in output.batch.sequences]
            )
            complete_step(scheduler, output)
        preemptions.append(scheduler.num_preemptions)
        return plans

    recording = _Recording()
    without = run(None)
    assert run(recording) == without
    assert recording.asked and any(rows > 0 for rows in recording.asked)
    assert sum(1 for plan in without if plan) > 50 and preemptions[0] > 0


# ---- through LLMEngine on a real (tiny) model -------------------------------------------------
def _run_engine(target_step_ms: float) -> tuple[dict[str, list[int]], list[tuple[int, int]], int]:
    """Greedy outputs, each step's (decode rows, prefill tokens), and the steps the cost fit saw;
    with a target, the costs are fixed (COST) so the steps' sizes do not depend on the clock."""
    from services.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="dummy:tiny",
        device="cpu",
        dtype="float32",
        cpu_kernels=False,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        target_step_ms=target_step_ms,
    )
    engine = LLMEngine(config)
    budget = engine.scheduler.prefill_budget
    engine.warm_up()  # runs its planned shapes without the target, which it then gets back
    assert engine.scheduler.prefill_budget is budget and engine.rates.costs.num_steps == 0
    assert (budget is None) == (target_step_ms == 0)
    if target_step_ms:
        engine.rates.step_cost = lambda: COST
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        output = schedule()
        prefills = [n for seq, n in output.scheduled if seq.num_uncomputed_tokens > 1]
        steps.append((len(output.scheduled) - len(prefills), sum(prefills)))
        return output

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    engine.add_request("first", list(range(1, 9)), params)
    while engine.has_unfinished():
        if len(steps) == 1:  # one sequence decodes when the long prompts arrive
            for index in range(6):
                prompt = [(index * 13 + i) % 900 + 1 for i in range(300)]
                engine.add_request(f"r{index}", prompt, params)
        for delta in engine.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return outputs, steps, engine.rates.costs.num_steps


def test_engine_steps_stay_within_the_target_and_outputs_are_unchanged():
    plain_outputs, plain_steps, _ = _run_engine(0.0)
    outputs, steps, fitted_steps = _run_engine(5.0)
    assert outputs == plain_outputs and len(outputs) == 7
    assert all(len(tokens) == 16 for tokens in outputs.values())
    # With decodes running, a step's prefill stays within 5 ms (or the minimum chunk): 250
    # tokens beside one decode, 64 from six decodes on; the token budget alone gives 511.
    for rows, tokens in steps:
        if rows:
            assert tokens <= max(64, int((5.0 - 2.0 - 0.5 * rows) / 0.01)), (rows, tokens)
    assert max(tokens for rows, tokens in plain_steps if rows) > 500
    assert max(tokens for rows, tokens in steps if rows) == 250
    assert 64 in [tokens for rows, tokens in steps if rows >= 6]
    assert len(steps) > len(plain_steps)
    assert fitted_steps > 0  # the engine's own measurements still feed the fit
