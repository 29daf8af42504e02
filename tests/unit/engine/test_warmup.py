"""Warm-up planning (which step shapes run before SERVING) and a warm-up through LLMEngine."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPreconditionError
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.warmup import SAMPLER_PATHS, plan_warmup, prefill_token_counts, warm_up
from tests.unit.engine.fake_runner import FakeModelRunner

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def test_prefill_counts_cover_the_budget_with_and_without_multiples_of_16():
    counts = prefill_token_counts(8192, 100_000)
    assert counts[0] == 1 and counts[-1] == 8192
    assert {16, 17, 4096, 4097, 8192} <= set(counts)
    assert any(count % 16 for count in counts if count > 16)
    assert prefill_token_counts(8192, 300)[-1] == 300  # capped by the longest prompt


def test_cuda_plan_replays_every_graph_bucket_and_every_sampler_path():
    plan = plan_warmup(
        device_type="cuda",
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        max_model_len=32768,
        num_blocks=20_000,
        block_size=16,
        decode_batches=GRAPH_BUCKETS,
    )
    assert plan.decode_batches == GRAPH_BUCKETS
    assert set(plan.sampler_paths) == set(SAMPLER_PATHS)
    names = [r.name for r in plan.rounds]
    assert "decode batch 512" in names and "mixed" in names
    chunked = [r for r in plan.rounds if r.name.startswith("chunked")]
    assert chunked and chunked[0].prompt_lengths[0] > 8192  # a prompt prefilled in chunks
    for path in SAMPLER_PATHS:
        if path != "greedy":
            assert any(r.sampler_path == path for r in plan.rounds)
    # Each decode round has exactly its bucket's number of sequences.
    for warm_round in plan.rounds:
        if warm_round.name.startswith("decode batch"):
            assert len(warm_round.prompt_lengths) == int(warm_round.name.split()[-1])


def test_cuda_plan_stays_inside_a_small_cache_and_the_sequence_cap():
    plan = plan_warmup(
        device_type="cuda",
        max_num_seqs=48,
        max_num_batched_tokens=2048,
        max_model_len=512,
        num_blocks=64,
        block_size=16,
        decode_batches=(1, 2, 4, 8, 16, 24, 32, 48, 64),
    )
    assert max(plan.decode_batches) <= 32  # 2 blocks a sequence: 64 blocks hold 32
    for warm_round in plan.rounds:
        assert sum(length + warm_round.max_tokens for length in warm_round.prompt_lengths) <= (
            64 * 16
        ) or warm_round.name.startswith("decode")
        assert max(warm_round.prompt_lengths) <= 510


def test_cpu_plan_is_one_small_step():
    plan = plan_warmup(
        device_type="cpu",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        num_blocks=1000,
        block_size=16,
        decode_batches=GRAPH_BUCKETS,
    )
    assert len(plan.rounds) <= 2
    assert sum(sum(r.prompt_lengths) for r in plan.rounds) <= 16
    assert plan.decode_batches == (1,)


def test_warm_up_runs_the_plan_and_leaves_the_engine_empty():
    runner = FakeModelRunner(vocab_size=300, num_blocks=64, block_size=4, max_model_len=64)
    engine = LLMEngine(EngineConfig(model="fake", device="cpu"), model_runner=runner)
    report = engine.warm_up()
    assert report.steps >= 2 and report.seconds >= 0
    assert not engine.has_unfinished()
    assert engine.load().free_blocks == engine.load().total_blocks  # every block back
    assert engine.rates.decode_tokens_per_s == 0.0  # warm-up steps are not serving rates
    assert "warmed in" in report.summary()
    # A real request afterwards runs as before.
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()


def test_warm_up_refuses_an_engine_with_requests():
    runner = FakeModelRunner(vocab_size=300, num_blocks=64, block_size=4, max_model_len=64)
    engine = LLMEngine(EngineConfig(model="fake", device="cpu"), model_runner=runner)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(FailedPreconditionError):
        engine.warm_up()


@pytest.mark.parametrize("max_model_len, budget", [(64, 64), (64, 256), (200, 48)])
def test_the_gpu_plan_runs_through_an_engine_within_its_context(max_model_len, budget):
    runner = FakeModelRunner(
        vocab_size=300, num_blocks=512, block_size=4, max_model_len=max_model_len
    )
    config = EngineConfig(
        model="fake", device="cpu", max_num_seqs=16, max_num_batched_tokens=budget
    )
    engine = LLMEngine(config, model_runner=runner)
    plan = plan_warmup(
        device_type="cuda",
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        num_blocks=512,
        block_size=4,
        decode_batches=(1, 2, 4, 8, 16, 24),
    )
    for warm_round in plan.rounds:
        assert max(warm_round.prompt_lengths) + warm_round.max_tokens <= max_model_len
    report = warm_up(engine, plan)
    assert report.steps >= len(plan.rounds) and not engine.has_unfinished()
    assert engine.load().free_blocks == engine.load().total_blocks


@pytest.mark.parametrize("vocab_size", [2, 64, 150])
def test_warm_up_runs_on_a_small_vocabulary(vocab_size: int) -> None:
    runner = FakeModelRunner(vocab_size=vocab_size, num_blocks=64, block_size=4, max_model_len=64)
    engine = LLMEngine(EngineConfig(model="fake", device="cpu"), model_runner=runner)
    report = engine.warm_up()
    assert report.steps > 0 and not engine.has_unfinished()
