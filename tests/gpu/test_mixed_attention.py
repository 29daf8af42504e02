"""A mixed step's attention: leading decodes through the decode kernel, the rest through the
prefill kernel, into one output, against the plain-PyTorch reference (GPU; how the step is cut
is unit-tested on the CPU: tests/unit/engine/backends/test_mixed_attention_split.py).
"""

from __future__ import annotations

import pytest
import torch

from services.engine.backends.cuda_attention import CudaPagedAttention
from services.engine.kernels import reference
from services.engine.layers.attention_metadata import AttentionMetadata
from tests.gpu.test_kernels import paged_setup


def check_mixed_step(
    device: str,
    dtype: torch.dtype,
    seq_lens: list[int],
    query_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    num_sms: int = 132,
    block_size: int = 16,
) -> tuple[int, float]:
    """(decodes taken by the decode kernel, relative error against the reference)."""
    generator = torch.Generator().manual_seed(sum(seq_lens) * 7 + head_dim)
    query, key_cache, value_cache, tables, starts, lens = paged_setup(
        seq_lens, query_lens, heads, kv_heads, head_dim, block_size, generator, device, dtype
    )
    starts_host = starts.tolist()
    contexts = [length - q for length, q in zip(seq_lens, query_lens, strict=True)]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(starts_host[-1], dtype=torch.int64, device=device),
        query_start_loc=starts,
        seq_lens=lens,
        context_lens=tensor(contexts),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        is_pure_decode=False,
        logits_indices=torch.zeros(1, dtype=torch.int64, device=device),
        block_size=block_size,
        query_start_loc_host=starts_host,
        seq_lens_host=list(seq_lens),
        context_lens_host=contexts,
    )
    backend = CudaPagedAttention(num_sms=num_sms)
    scale = head_dim**-0.5
    out = backend.forward(query, key_cache, value_cache, metadata, scale)
    split = metadata.backend_state["mixed_split"]
    ref = reference.paged_attention_ref(
        query, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
        metadata.seq_lens, scale,
    )  # fmt: skip
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN (unwritten rows) in the mixed step's output"
    error = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    return (split.decodes if split is not None else 0), error


@pytest.mark.parametrize(
    "seq_lens,query_lens,decodes",
    [
        ([700, 33, 1000, 513, 2048], [1, 1, 1, 200, 2048], 3),  # decodes, a chunk, a prompt
        ([300, 17], [1, 17], 1),  # one decode beside one short prompt
        ([900, 400, 65, 128], [1, 64, 1, 128], 1),  # a decode after a chunk: prefill kernel
        ([50, 60], [50, 60], 0),  # prompts only: no split
    ],
)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 4, 64)])
def test_mixed_step_matches_reference(seq_lens, query_lens, decodes, heads, kv_heads, head_dim):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    taken, error = check_mixed_step(
        "cuda", torch.bfloat16, seq_lens, query_lens, heads, kv_heads, head_dim
    )
    assert taken == decodes
    assert error < 2e-2
