"""The engine's Llama on the CUDA fast path against transformers' LlamaForCausalLM on the same
random weights (saved as a checkpoint and loaded by CudaModelRunner, fast path bound).

Covers batched prefill, chunked prefill over a cached prefix, eager decode and decode through
CUDA graphs (padded buckets), on a small GQA shape with llama3 rope scaling (GPU only).
"""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda"
DTYPE = torch.bfloat16
USE_GRAPHS = True
BLOCK_SIZE = 16


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.common.model_files import ModelFiles
    from services.engine.cuda_runner import CudaModelRunner

    config = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        rope_theta=500000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).to(device=DEVICE, dtype=DTYPE).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.1)
            else:
                parameter.normal_(0.0, 0.05)
    directory = tmp_path_factory.mktemp("llama-gqa")
    reference.save_pretrained(directory)
    runner = CudaModelRunner(
        ModelFiles("llama-gqa", directory, directory), device=DEVICE, dtype=DTYPE,
        block_size=BLOCK_SIZE, max_model_len=512, kv_cache_bytes=8 << 20, max_num_seqs=8,
        use_cuda_graphs=USE_GRAPHS,
    )  # fmt: skip
    assert runner.fast is not None, runner.fast_path_off_reason
    assert runner.fast.graphs.buckets == (1, 2, 4, 8)
    return reference, runner.fast


def _reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([tokens], device=DEVICE)
        return reference(ids).logits[0].float()


def _tables(lengths: list[int], first_block: int = 3) -> list[list[int]]:
    """Disjoint, non-contiguous block tables (every other block) for the given lengths."""
    tables, next_block = [], first_block
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        tables.append([next_block + 2 * index for index in range(count)])
        next_block += 2 * count
    return tables


def test_batched_and_chunked_prefill_match_transformers(models) -> None:
    from services.engine.backends.cuda_fast_path import prefill_metadata

    reference, fast = models
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (37, 70, 5)]
    tables = _tables([len(p) for p in prompts])
    positions, metadata = prefill_metadata(
        [len(p) for p in prompts], [0, 0, 0], tables, BLOCK_SIZE, DEVICE
    )
    flat = torch.tensor(sum(prompts, []), device=DEVICE)
    with torch.no_grad():
        logits = fast.forward(flat, positions, metadata)
    for row, prompt in enumerate(prompts):
        assert _relative_error(logits[row], _reference_logits(reference, prompt)[-1]) < 3e-2

    # Chunked prefill of a longer prompt in the blocks of prompt 1: 40 cached, then 50 more.
    prompt = prompts[1] + torch.randint(0, 1000, (20,), generator=generator).tolist()
    table = _tables([len(prompt)], first_block=1)[0]
    for context_len, query_len in ((0, 40), (40, 50)):
        chunk = torch.tensor(prompt[context_len : context_len + query_len], device=DEVICE)
        positions, metadata = prefill_metadata(
            [query_len], [context_len], [table], BLOCK_SIZE, DEVICE
        )
        with torch.no_grad():
            logits = fast.forward(chunk, positions, metadata)
    expected = _reference_logits(reference, prompt)[-1]
    assert _relative_error(logits[0], expected) < 3e-2


def test_greedy_decode_matches_transformers(models) -> None:
    from services.engine.backends.cuda_fast_path import prefill_metadata

    reference, fast = models
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (9, 33, 16)]
    tables = _tables([len(p) + 8 for p in prompts])
    positions, metadata = prefill_metadata(
        [len(p) for p in prompts], [0, 0, 0], tables, BLOCK_SIZE, DEVICE
    )
    with torch.no_grad():
        logits = fast.forward(torch.tensor(sum(prompts, []), device=DEVICE), positions, metadata)
    sequences = [p + [int(t)] for p, t in zip(prompts, logits.argmax(-1).tolist(), strict=True)]
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    for _ in range(5):
        ids = torch.tensor([s[-1] for s in sequences])
        step_positions = torch.tensor([len(s) - 1 for s in sequences])
        with torch.no_grad():
            if USE_GRAPHS:
                step_logits, next_tokens = fast.decode(ids, step_positions, table_tensor)
            else:
                step_metadata_positions, step_metadata = prefill_metadata(
                    [1, 1, 1], [len(s) - 1 for s in sequences], tables, BLOCK_SIZE, DEVICE
                )
                step_logits = fast.forward(ids.to(DEVICE), step_metadata_positions, step_metadata)
                next_tokens = step_logits.argmax(-1)
        for row, sequence in enumerate(sequences):
            expected = _reference_logits(reference, sequence)[-1]
            assert _relative_error(step_logits[row], expected) < 3e-2
        sequences = [s + [int(t)] for s, t in zip(sequences, next_tokens.tolist(), strict=True)]


def test_decode_next_feeds_sampled_tokens_on_the_gpu(models) -> None:
    from services.engine.backends.cuda_fast_path import prefill_metadata

    reference, fast = models
    if not USE_GRAPHS:
        pytest.skip("decode_next replays captured graphs")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (12, 40)]
    tables = _tables([len(p) + 6 for p in prompts], first_block=20)
    positions, metadata = prefill_metadata(
        [len(p) for p in prompts], [0, 0], tables, BLOCK_SIZE, DEVICE
    )
    with torch.no_grad():
        logits = fast.forward(torch.tensor(sum(prompts, []), device=DEVICE), positions, metadata)
        sequences = [p + [int(t)] for p, t in zip(prompts, logits.argmax(-1).tolist(), strict=True)]
        width = max(len(t) for t in tables)
        table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        ids = torch.tensor([s[-1] for s in sequences])
        step_positions = torch.tensor([len(s) - 1 for s in sequences])
        step_logits, next_tokens = fast.decode(ids, step_positions, table_tensor)
        for _ in range(3):
            for row, sequence in enumerate(sequences):
                expected = _reference_logits(reference, sequence)[-1]
                assert _relative_error(step_logits[row], expected) < 3e-2
            sequences = [s + [int(t)] for s, t in zip(sequences, next_tokens.tolist(), strict=True)]
            step_logits, next_tokens = fast.decode_next(len(sequences))
