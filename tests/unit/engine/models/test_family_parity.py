"""Our Llama-family model vs transformers (fp32): prefill, chunked prefill, decode and a
prefix-cache hit over the paged cache, sequences of different lengths in one flat batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.cpu_runner import CpuModelRunner
from services.engine.forward_batch import ScheduledBatch, ScheduledSequence
from tests.unit.engine.models.helpers import (
    BlockAllocator,
    files_for,
    hf_config,
    save_random_model,
    step,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
FAMILIES = {
    "llama3-scaled-gqa": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 50000.0}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": False}),
    "qwen3-qk-norm": ("qwen3", {"tie_word_embeddings": True}),
}
BLOCK_SIZE = 4
TOLERANCE = {"atol": 2e-4, "rtol": 1e-4}
VOCAB = 128


def _last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    family, overrides = FAMILIES[case]
    reference = save_random_model(hf_config(family, **overrides), tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # really sharded
    runner = CpuModelRunner(
        files_for(tmp_path), dtype=torch.float32, block_size=BLOCK_SIZE, kv_cache_bytes=1 << 20
    )
    assert runner.model_config.architecture == reference.config.architectures[0]
    allocator = BlockAllocator(runner.num_blocks, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(1)
    prompts = {
        seq: torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        for seq, length in ((0, 5), (1, 11), (2, 1), (3, 17))
    }
    chunks_of_3 = [(0, 6), (6, 11), (11, 17)]  # chunked prefill of sequence 3

    # Step 1: sequences 0-2 prefill whole, sequence 3 its first chunk (logits asked anyway).
    pieces = [(seq, prompts[seq], 0, True) for seq in (0, 1, 2)]
    pieces.append((3, prompts[3][:6], 0, True))
    logits = runner.execute(step(allocator, pieces))
    assert logits.dtype == torch.float32 and logits.shape == (4, VOCAB)
    for row, seq in enumerate((0, 1, 2)):
        torch.testing.assert_close(logits[row], _last_logits(reference, prompts[seq]), **TOLERANCE)
    torch.testing.assert_close(logits[3], _last_logits(reference, prompts[3][:6]), **TOLERANCE)

    # Steps 2-5: decodes first, then sequence 3's remaining chunks; it decodes once complete.
    histories = {seq: list(prompts[seq]) for seq in (0, 1, 2)}
    for step_index in range(4):
        pieces, expected = [], []
        for seq, history in histories.items():
            next_token = int(_last_logits(reference, history).argmax())
            pieces.append((seq, [next_token], len(history), True))
            history.append(next_token)
            expected.append(_last_logits(reference, history))
        if step_index < 2:
            start, end = chunks_of_3[step_index + 1]
            last = end == len(prompts[3])
            pieces.append((3, prompts[3][start:end], start, last))
            if last:
                expected.append(_last_logits(reference, prompts[3]))
                histories[3] = list(prompts[3])
        logits = runner.execute(step(allocator, pieces))
        assert logits.shape == (len(expected), VOCAB)
        for row, want in enumerate(expected):
            torch.testing.assert_close(logits[row], want, **TOLERANCE)

    # A prefix-cache hit: sequence 4 shares sequence 1's first two full blocks (8 tokens).
    shared = allocator.tables[1][:2]
    suffix = torch.randint(0, VOCAB, (5,), generator=generator).tolist()
    fresh = [allocator.free.pop() for _ in range(2)]
    hit = ScheduledSequence(4, suffix, 8, shared + fresh, True)
    logits = runner.execute(ScheduledBatch([hit]))
    expected = _last_logits(reference, prompts[1][:8] + suffix)
    torch.testing.assert_close(logits[0], expected, **TOLERANCE)
