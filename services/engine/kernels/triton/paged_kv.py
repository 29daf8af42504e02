"""The paged-KV tile load shared by the decode and prefill attention kernels (and the check of
an output buffer they are given).

A tile is BLOCK_N consecutive token positions of one sequence; each position is found through
the sequence's block table (slot = block * BLOCK_SIZE + offset) in caches laid out
[num_blocks, block_size, num_kv_heads, head_dim]. Positions past `token_mask` read zeros.
Tiles come back as COMPUTE (the query's type): a float8 cache (kv_cache_dtype fp8) is widened
as it is loaded, so the dots run in the model's dtype on half the bytes read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.common.errors import InvalidArgumentError


def attention_output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked against query, or a new tensor like it."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise InvalidArgumentError("attention out must be contiguous, of query's shape and dtype")
    return out


@triton.jit
def load_kv_tile(
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq,
    block_table_stride,
    kv_head,
    slot_stride,
    tokens,
    token_mask,
    dims,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    blocks = tl.load(
        block_tables_ptr + seq * block_table_stride + tokens // BLOCK_SIZE,
        mask=token_mask,
        other=0,
    ).to(tl.int64)
    slots = blocks * BLOCK_SIZE + tokens % BLOCK_SIZE
    offsets = slots[:, None] * slot_stride + kv_head * HEAD_DIM + dims[None, :]
    k = tl.load(key_cache_ptr + offsets, mask=token_mask[:, None], other=0.0)
    v = tl.load(value_cache_ptr + offsets, mask=token_mask[:, None], other=0.0)
    return k.to(COMPUTE), v.to(COMPUTE)
