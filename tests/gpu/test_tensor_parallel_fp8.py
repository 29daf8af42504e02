"""Tensor parallelism over a float8 KV cache (2+ GPUs): each rank keeps its own KV heads in
float8, and a TP=2 engine follows a TP=1 engine with the same cache, step by step.

Its own module: test_tensor_parallel.py's engines hold the process's tensor-parallel group until
that module ends, and one process holds one group at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from services.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="tensor parallelism needs 2 GPUs",
)

SETTINGS = dict(
    model="dummy:llama-3.2-1b",  # 32 heads over 8 KV heads: 4 KV heads a rank at TP=2
    device="cuda",
    kv_cache_dtype="fp8",
    kv_cache_bytes=256 << 20,
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=512,
)


@pytest.fixture(scope="module")
def fp8_pair() -> Iterator[tuple[LLMEngine, LLMEngine]]:
    single = LLMEngine(EngineConfig(**SETTINGS))
    pair = LLMEngine(EngineConfig(tensor_parallel_size=2, **SETTINGS))
    yield single, pair
    pair.runner.tensor_parallel.close()


def _error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    assert torch.isfinite(ours).all()
    return float((ours.double() - reference.double()).norm() / reference.double().norm())


def test_each_rank_keeps_its_kv_heads_in_float8(fp8_pair) -> None:
    single, pair = fp8_pair
    assert single.runner.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn
    cache = pair.runner.kv_cache.layers[0][0]
    assert cache.dtype == torch.float8_e4m3fn and cache.shape[2] == 4
    # kv_cache_bytes is each rank's: half the heads a block, twice the blocks. The ranks agree
    # on the smallest count, so a rank with a bf16 cache would leave it at TP=1's.
    assert pair.runner.num_blocks == 2 * single.runner.num_blocks
    assert pair.runner.fast is not None, pair.runner.fast_path_off_reason
    assert pair.runner.capabilities.graph_batch_sizes


def test_tp2_steps_follow_tp1_on_the_same_float8_cache(fp8_pair) -> None:
    single, pair = fp8_pair
    generator = torch.Generator().manual_seed(8)
    lengths = [60, 9, 130]
    prompts = [torch.randint(0, 40000, (n,), generator=generator).tolist() for n in lengths]
    tables = [[3 * j + i for j in range(12)] for i in range(3)]
    batch = ScheduledBatch([ScheduledSequence(i, prompts[i], 0, tables[i], True) for i in range(3)])
    errors = [_error(pair.runner.execute(batch).clone(), single.runner.execute(batch).clone())]
    positions = list(lengths)
    for step in range(3):  # decode steps, through the graphs on both
        decode = ScheduledBatch(
            [
                ScheduledSequence(i, [prompts[i][step]], positions[i], tables[i], True)
                for i in range(3)
            ]
        )
        ours = pair.runner.execute(decode).clone()
        errors.append(_error(ours, single.runner.execute(decode).clone()))
        positions = [p + 1 for p in positions]
    # bf16 partial sums in another order can move a key across a float8 rounding step: the
    # logits agree within less than the cache's own rounding (test_cuda_runner.py allows 0.15
    # between a float8 and a bf16 cache).
    assert all(error < 0.08 for error in errors), errors


def test_tp2_generates_through_the_graphs_on_a_float8_cache(fp8_pair) -> None:
    _, pair = fp8_pair
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for index, length in enumerate((40, 7, 200)):
        pair.add_request(f"r{index}", list(range(500, 500 + length)), params)
    counts: dict[str, int] = {}
    graph_steps = pair.runner.graph_steps
    while pair.has_unfinished():
        for delta in pair.step().deltas:
            counts[delta.request_id] = counts.get(delta.request_id, 0) + len(delta.new_token_ids)
    assert counts == {"r0": 12, "r1": 12, "r2": 12}
    assert pair.runner.graph_steps > graph_steps
    assert pair.block_manager.num_free_blocks == pair.block_manager.num_blocks
