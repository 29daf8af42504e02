"""The plain CudaModelRunner (fast path off) with attention backend "cuda" against "torch" on the
same GPU and dummy weights.

Runs a batched prefill, a chunked prefill over a cached prefix and decode steps through the
runner, so the registered Triton backend is checked inside the real engine path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def runners():
    from services.common.model_files import ModelFiles
    from services.engine.cuda_runner import CudaModelRunner

    files = ModelFiles(
        name="dummy:smollm2-135m", weights_dir=None, tokenizer_dir=Path("."),
        dummy_shape="smollm2-135m",
    )  # fmt: skip
    made = {}
    for backend in ("torch", "cuda"):
        made[backend] = CudaModelRunner(
            files, device="cuda", dtype=torch.bfloat16, kv_cache_bytes=64 * 2**20,
            backend=backend, seed=3, fast_path=False,
        )  # fmt: skip
        assert made[backend].fast is None
    return made


def _steps(block_size: int):
    from services.engine.forward_batch import ScheduledBatch, ScheduledSequence

    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (70, 7, 150)]
    tables = [list(range(1, 8)), list(range(20, 22)), list(range(30, 42))]
    # Step 1: prompt 0 whole, prompt 1 whole, prompt 2's first 100 tokens.
    yield ScheduledBatch([
        ScheduledSequence(0, prompts[0], 0, tables[0], True),
        ScheduledSequence(1, prompts[1], 0, tables[1], True),
        ScheduledSequence(2, prompts[2][:100], 0, tables[2], False),
    ])  # fmt: skip
    # Step 2: two decodes first, then the rest of prompt 2 over its cached prefix.
    yield ScheduledBatch([
        ScheduledSequence(0, [11], 70, tables[0], True),
        ScheduledSequence(1, [12], 7, tables[1], True),
        ScheduledSequence(2, prompts[2][100:], 100, tables[2], True),
    ])  # fmt: skip
    for step in range(3):  # pure decode steps
        yield ScheduledBatch([
            ScheduledSequence(0, [13 + step], 71 + step, tables[0], True),
            ScheduledSequence(1, [14 + step], 8 + step, tables[1], True),
            ScheduledSequence(2, [15 + step], 150 + step, tables[2], True),
        ])  # fmt: skip


def test_cuda_backend_matches_torch_backend_in_model_runner(runners) -> None:
    for batch_index, batch in enumerate(_steps(runners["torch"].block_size)):
        expected = runners["torch"].execute(batch)
        actual = runners["cuda"].execute(batch)
        assert actual.shape == expected.shape
        error = _relative_error(actual, expected)
        assert error < 3e-2, f"step {batch_index}: relative error {error}"
