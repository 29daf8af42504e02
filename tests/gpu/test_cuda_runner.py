"""The engine's CUDA fast path: CudaModelRunner against the torch model on the same weights and
KV cache, and LLMEngine on CUDA running its decode steps through CUDA graphs (GPU only)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.common.errors import InvalidArgumentError
from services.common.model_files import ModelFiles
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence

SHAPE = "llama-3.2-1b"  # the real GQA layout (32 heads over 8 KV heads), 16 layers


def _files(shape: str = SHAPE) -> ModelFiles:
    # The runner never reads the tokenizer: no converted default model needed here.
    return ModelFiles(f"dummy:{shape}", None, Path("."), shape)


@pytest.fixture(scope="module")
def runner():
    from services.engine.cuda_runner import CudaModelRunner

    return CudaModelRunner(
        _files(), device="cuda", max_model_len=512, kv_cache_bytes=64 << 20, max_num_seqs=8
    )


def _error(fast: torch.Tensor, reference: torch.Tensor) -> float:
    assert fast.shape == reference.shape and fast.dtype == torch.float32
    assert torch.isfinite(fast).all()
    return float((fast.double() - reference.double()).norm() / reference.double().norm())


def test_prefill_and_graph_decode_match_torch_model(runner) -> None:
    generator = torch.Generator().manual_seed(3)
    lengths = [37, 80, 5]
    prompts = [torch.randint(0, 40000, (n,), generator=generator).tolist() for n in lengths]
    tables = [[1, 5, 9, 13, 17, 21, 25], [2, 6, 10, 14, 18, 22, 26], [3, 7, 11, 15, 19]]
    batch = ScheduledBatch([ScheduledSequence(i, prompts[i], 0, tables[i], True) for i in range(3)])
    assert _error(runner.execute(batch), runner.reference_execute(batch)) < 3e-2
    graphs_before = runner.graph_steps
    positions = list(lengths)
    for step in range(4):
        decode = ScheduledBatch(
            [
                ScheduledSequence(i, [prompts[i][step]], positions[i], tables[i], True)
                for i in range(3)
            ]
        )
        fast = runner.execute(decode).clone()
        # The same step again (same K/V rewritten): the graph's GPU argmax matches the logits.
        assert torch.equal(runner.execute_greedy(decode), fast.argmax(dim=-1))
        assert _error(fast, runner.reference_execute(decode)) < 3e-2
        positions = [p + 1 for p in positions]
    assert runner.graph_steps == graphs_before + 8  # 3 rows ran in the 4-row bucket


def test_an_fp8_kv_cache_holds_twice_the_blocks_and_follows_the_bf16_cache(runner) -> None:
    from services.engine.cuda_runner import CudaModelRunner

    fp8 = CudaModelRunner(
        _files(), device="cuda", max_model_len=512, kv_cache_bytes=64 << 20, max_num_seqs=8,
        kv_cache_dtype="fp8",
    )  # fmt: skip
    assert fp8.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn and fp8.fast is not None
    assert fp8.num_blocks == 2 * runner.num_blocks  # same bytes, one byte an element
    generator = torch.Generator().manual_seed(6)
    lengths = [45, 120, 9]
    prompts = [torch.randint(0, 40000, (n,), generator=generator).tolist() for n in lengths]
    tables = [[60 + 4 * j + i for j in range(8)] for i in range(3)]  # the same weights (seed 0)
    batch = ScheduledBatch([ScheduledSequence(i, prompts[i], 0, tables[i], True) for i in range(3)])
    # The same step on each runner: logits within float8's rounding of keys and values.
    errors = [_error(fp8.execute(batch), runner.execute(batch).clone())]
    positions = list(lengths)
    for step in range(3):  # decode steps through the graphs, reading the float8 cache
        decode = ScheduledBatch(
            [
                ScheduledSequence(i, [prompts[i][step]], positions[i], tables[i], True)
                for i in range(3)
            ]
        )
        errors.append(_error(fp8.execute(decode).clone(), runner.execute(decode).clone()))
        positions = [p + 1 for p in positions]
    assert all(1e-4 < error < 0.15 for error in errors), errors
    del fp8
    torch.cuda.empty_cache()


def test_chunk_without_logits_still_fills_the_cache(runner) -> None:
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 40000, (50,), generator=generator).tolist()
    table = [30, 31, 32, 33]
    first = ScheduledBatch([ScheduledSequence(0, prompt[:30], 0, table, False)])
    assert runner.execute(first).shape == (0, runner.model_config.vocab_size)
    second = ScheduledBatch([ScheduledSequence(0, prompt[30:], 30, table, True)])
    fast = runner.execute(second).clone()
    # The reference recomputes the whole prompt into other blocks: same logits expected.
    whole = ScheduledBatch([ScheduledSequence(1, prompt, 0, [40, 41, 42, 43], True)])
    assert _error(fast, runner.reference_execute(whole)) < 3e-2


def test_a_pending_token_beside_prompt_rows_is_fed_on_the_gpu(runner) -> None:
    """A mixed step launched before the last launch's ids are read: its decode row's token
    is the id that launch sampled, taken on the device; the step equals the same step with
    that id known on the host."""
    from services.engine.sequence import PENDING_TOKEN

    generator = torch.Generator().manual_seed(8)
    first, second = (torch.randint(0, 40000, (n,), generator=generator).tolist() for n in (21, 9))
    table_a, table_b, table_c = [50, 51], [52], [53]
    batch = ScheduledBatch([ScheduledSequence(0, first, 0, table_a, True)])
    runner.launch_greedy(batch)  # eager: the sampled id stays on the device
    pending = ScheduledBatch(
        [
            ScheduledSequence(0, [PENDING_TOKEN], 21, table_a, True),
            ScheduledSequence(1, second, 0, table_b, True),
        ]
    )
    handle = runner.launch_greedy(pending)
    launched = handle.result()
    assert 0.0 < handle.device_time_s() < 5.0  # the step's own time, from CUDA events
    sampled = runner.execute_greedy(batch).tolist()[0]  # the same prefill again: same K/V
    known = ScheduledBatch(
        [
            ScheduledSequence(0, [sampled], 21, table_a, True),
            ScheduledSequence(2, second, 0, table_c, True),
        ]
    )
    assert launched == runner.execute_greedy(known).tolist()
    with pytest.raises(InvalidArgumentError, match="pending token"):
        runner.launch_greedy(  # sequence 5 was not sampled by the last launch
            ScheduledBatch(
                [
                    ScheduledSequence(5, [PENDING_TOKEN], 9, table_b, True),
                    ScheduledSequence(2, second, 0, table_c, True),
                ]
            )
        )


def test_bad_decode_input_is_rejected(runner) -> None:
    vocab = runner.model_config.vocab_size
    bad = ScheduledBatch([ScheduledSequence(0, [vocab], 10, [1], True)])
    with pytest.raises(InvalidArgumentError):
        runner.execute(bad)
    short = ScheduledBatch([ScheduledSequence(0, [1], 16, [1], True)])
    with pytest.raises(InvalidArgumentError):
        runner.execute(short)


def test_factory_picks_the_fast_path_on_cuda_only(runner) -> None:
    from services.engine.config import EngineConfig
    from services.engine.cpu_runner import CpuModelRunner
    from services.engine.cuda_runner import CudaModelRunner, fast_path_unsupported
    from services.engine.runner_factory import runner_class

    assert runner_class("cuda") is CudaModelRunner and runner_class("cpu") is CpuModelRunner
    config = EngineConfig(model=f"dummy:{SHAPE}", device="cuda")
    assert fast_path_unsupported(runner.model_config) is None and runner.fast is not None
    assert runner.capabilities.greedy_ids and runner.capabilities.supports_overlap
    assert runner.capabilities.overlap_max_batch == runner.fast.graphs.max_batch_size
    assert config.resolved_device() == "cuda"
    qk_norm = dataclasses.replace(runner.model_config, qk_norm=True)
    assert fast_path_unsupported(qk_norm) == "per-head q/k norm"


def test_engine_on_cuda_uses_graphs_and_finishes(runner) -> None:
    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=f"dummy:{SHAPE}", device="cuda", max_num_seqs=16, max_model_len=512,
        kv_cache_bytes=64 << 20, enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(config, model_runner=runner)
    graphs_before = runner.graph_steps
    generator = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for index in range(6):
        prompt = torch.randint(0, 40000, (10 + 7 * index,), generator=generator).tolist()
        engine.add_request(f"r{index}", prompt, params)
    engine.abort("r5")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert all(len(tokens[f"r{index}"]) == 12 for index in range(5))
    assert runner.graph_steps >= graphs_before + 10
    load = engine.load()
    assert load.free_blocks == load.total_blocks and load.running == 0


@pytest.fixture(scope="module")
def float32_runner():
    from services.engine.cuda_runner import CudaModelRunner

    return CudaModelRunner(
        _files(), device="cuda", dtype=torch.float32, max_model_len=512,
        kv_cache_bytes=64 << 20, max_num_seqs=8,
    )  # fmt: skip


def test_overlapped_engine_matches_the_plain_path(float32_runner) -> None:
    """Steps scheduled ahead on pending tokens (fed on the GPU) give the plain path's tokens,
    stop tokens discarding the step already launched, and free every block. In float32: the
    step after a stop carries the stopped row too, so its batch (and graph bucket) differs
    from the plain path's, and bfloat16 matmuls may round a row differently at another
    batch size (a near tie then flips a greedy token)."""
    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=f"dummy:{SHAPE}", device="cuda", dtype="float32", max_num_seqs=8, max_model_len=512,
        kv_cache_bytes=64 << 20, enable_prefix_caching=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(9)
    prompts = [
        torch.randint(0, 40000, (5 + 9 * i,), generator=generator).tolist() for i in range(5)
    ]

    def run(overlap: bool, stop: list[int]) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(config, model_runner=float32_runner)
        if not overlap:
            engine._launch_greedy = None
        for index, prompt in enumerate(prompts):
            params = SamplingParams(
                max_tokens=8 + 3 * index, temperature=0.0, ignore_eos=True, stop_token_ids=stop
            )
            engine.add_request(f"r{index}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step().deltas:
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                assert delta.num_output_tokens == len(tokens[delta.request_id])
        load = engine.load()
        assert load.free_blocks == load.total_blocks and load.running == 0
        return tokens, engine

    plain, _ = run(False, [])
    stop = [plain["r1"][4], plain["r3"][2]]
    plain_stopped, _ = run(False, stop)
    overlapped, engine = run(True, stop)
    assert overlapped == plain_stopped
    assert engine.num_overlapped_steps > 5
    assert any(len(plain_stopped[r]) < len(plain[r]) for r in plain)  # a stop cut one short
