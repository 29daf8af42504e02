"""The torch attention backend against a float64 reference over a paged cache.

Decodes of mixed lengths and prefill chunks (first prefills and prefix-cache hits, short ones
on the SDPA path and long ones on the CPU matmul path) in one flat batch; both CPU decode
layouts (all heads over whole blocks for few KV heads, per-head gather for more), and the
native CPU kernels (KV write and decodes straight from the paged cache) in the same batches.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.backends import torch_backend
from services.engine.backends.torch_backend import TorchAttentionBackend
from services.engine.kernels.cpu.cpu_native import cpu_kernels
from services.engine.layers.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# (tokens already cached, tokens computed this step): decodes first, as the scheduler orders.
SEQUENCES = [(0, 1), (16, 1), (39, 1), (70, 1), (0, 5), (0, 60), (40, 50), (9, 4)]


def _metadata(generator: torch.Generator) -> tuple[AttentionMetadata, list[list[int]]]:
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables, slots, starts, seq_lens, contexts = [], [], [0], [], []
    for context, count in SEQUENCES:
        end = context + count
        table = [free.pop() for _ in range(-(-end // BLOCK_SIZE))]
        tables.append(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context, end)]
        starts.append(starts[-1] + count)
        seq_lens.append(end)
        contexts.append(context)
    width = max(len(table) for table in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(count for _, count in SEQUENCES),
        max_seq_len=max(seq_lens),
        is_pure_decode=False,
        logits_indices=torch.tensor([end - 1 for end in starts[1:]]),
        block_size=BLOCK_SIZE,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
        context_lens_host=contexts,
    )
    return metadata, tables


def _reference(query, keys, values, context, num_heads, scale):
    """float64 causal attention of one sequence: query [Q, H, D], keys/values [K, KVH, D]."""
    group = num_heads // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    values = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = query.double().transpose(0, 1) @ keys.transpose(1, 2) * scale  # [H, Q, K]
    allowed = torch.arange(keys.shape[1])[None] <= torch.arange(query.shape[0])[:, None] + context
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (8, 8), (4, 1)])
@pytest.mark.parametrize(
    "matmul_prefill, side_by_side, native, head_dim",
    [
        (True, True, False, 32),
        (True, False, False, 32),
        (False, True, False, 32),
        (True, True, True, 64),
        (True, False, True, 32),
    ],
)
def test_matches_reference_over_the_paged_cache(
    dtype,
    tolerance,
    num_heads,
    num_kv_heads,
    matmul_prefill,
    side_by_side,
    native,
    head_dim,
    monkeypatch,
) -> None:
    HEAD_DIM = head_dim  # noqa: N806 - reads as the constant it was
    if not matmul_prefill:
        monkeypatch.setattr(torch_backend, "MATMUL_PREFILL_MIN_QUERIES", 10**9)
    generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    metadata, tables = _metadata(generator)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    tokens = metadata.query_start_loc_host[-1]
    if side_by_side:  # query and key as strided views of one tensor, as the CPU model passes them
        both = torch.randn(tokens, num_heads + num_kv_heads, HEAD_DIM, generator=generator)
        both = both.to(dtype)
        query, key = both[:, :num_heads], both[:, num_heads:]
    else:
        query = torch.randn(tokens, num_heads, HEAD_DIM, generator=generator).to(dtype)
        key = torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    value = torch.randn(tokens, num_kv_heads, HEAD_DIM, generator=generator).to(dtype)
    scale = HEAD_DIM**-0.5
    backend = TorchAttentionBackend(num_heads, num_kv_heads, HEAD_DIM, scale)
    if native:
        backend.cpu_kernels = cpu_kernels()
        assert backend.cpu_kernels is not None, "the native CPU kernels did not build"
    backend.prepare(metadata)
    output = backend.forward(query, key, value, key_cache, value_cache, metadata)

    assert output.shape == query.shape and output.dtype == dtype
    flat_keys = key_cache.view(-1, num_kv_heads, HEAD_DIM)
    flat_values = value_cache.view(-1, num_kv_heads, HEAD_DIM)
    torch.testing.assert_close(flat_keys[metadata.slot_mapping], key, atol=0, rtol=0)
    starts = metadata.query_start_loc_host
    for index, ((context, count), table) in enumerate(zip(SEQUENCES, tables, strict=True)):
        end = context + count
        cached = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(end)]
        rows = slice(starts[index], starts[index + 1])
        expected = _reference(
            query[rows], flat_keys[cached], flat_values[cached], context, num_heads, scale
        )
        torch.testing.assert_close(output[rows].double(), expected, atol=tolerance, rtol=tolerance)


def test_decodes_planned_for_the_native_kernel_still_run_on_pytorch_ops() -> None:
    """A step planned with the native kernels bound (no gather indices) but run where they do
    not apply (e.g. a dtype they lack) re-plans and gives the same output."""
    generator = torch.Generator().manual_seed(5)
    metadata, _ = _metadata(generator)
    shape = (NUM_BLOCKS, BLOCK_SIZE, 2, 32)
    key_cache, value_cache = torch.randn(shape, generator=generator), torch.randn(shape)
    tokens = metadata.query_start_loc_host[-1]
    query = torch.randn(tokens, 4, 32, generator=generator)
    key, value = torch.randn(tokens, 2, 32), torch.randn(tokens, 2, 32)
    plain = TorchAttentionBackend(4, 2, 32, 32**-0.5)
    plain.prepare(metadata)
    expected = plain.forward(query, key, value, key_cache.clone(), value_cache.clone(), metadata)

    metadata.backend_state.clear()
    mixed = TorchAttentionBackend(4, 2, 32, 32**-0.5)
    mixed.cpu_kernels = cpu_kernels()
    mixed.prepare(metadata)  # planned for the native decode path
    mixed.cpu_kernels = None
    output = mixed.forward(query, key, value, key_cache, value_cache, metadata)
    torch.testing.assert_close(output, expected)
