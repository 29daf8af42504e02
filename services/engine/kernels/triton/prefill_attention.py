"""Paged prefill attention: variable-length, causal, over a cached prefix (chunked prefill).

Grid (query tile, head, sequence). Sequence b computes query rows query_start_loc[b]:[b+1],
which sit at positions context_lens[b] .. seq_lens[b] - 1; its keys and values (prefix and
this step's tokens, already written to the cache) are gathered through the block table in
tiles of BLOCK_N tokens, with flash-attention's online softmax. Tiles past the causal limit of
the query tile are never loaded. Mixed batches work too: a decode row is a query of length 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import CachedLaunch, pdl_options, pdl_prologue
from services.engine.kernels.triton.paged_kv import attention_output, load_kv_tile

_LOG2E = 1.4426950408889634


# The block table's width follows the step's longest sequence: not specialised, so a width
# the warm-up did not see (a multiple of 16, or 1) compiles no new variant on a serving step.
@triton.jit(do_not_specialize=["block_table_stride"])
def _prefill_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    block_table_stride,
    num_heads,
    num_kv_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    query_positions = context_len + rows
    dims = tl.arange(0, HEAD_DIM)
    token_rows = (query_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + (token_rows * num_heads + head)[:, None] * HEAD_DIM + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    max_score = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_end = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)
    slot_stride = num_kv_heads * HEAD_DIM
    for tile_start in range(0, kv_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < kv_end
        k, v = load_kv_tile(
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
            HEAD_DIM,
            BLOCK_SIZE,
            q.dtype,
        )
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        visible = token_mask[None, :] & (tokens[None, :] <= query_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probabilities = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(max_score - safe_max)
        denominator = denominator * correction + tl.sum(probabilities, axis=1)
        acc = acc * correction[:, None] + tl.dot(probabilities.to(v.dtype), v)
        max_score = new_max
    out = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
    tl.store(
        out_ptr + (token_rows * num_heads + head)[:, None] * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


_launch_prefill = CachedLaunch(_prefill_kernel)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, heads, head_dim] over the paged cache -> same shape.

    query_start_loc [B + 1] int32, seq_lens [B] int32 (cached tokens after this step, the
    step's own keys/values already written). max_query_len sizes the grid. out: where to
    write (contiguous, query's shape and dtype; by default a new tensor).
    """
    tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    batch = seq_lens.shape[0]
    out = attention_output(query, out)
    if tokens == 0 or batch == 0:
        return out
    query = query.contiguous()
    block_m = 64 if max_query_len > 16 else 16
    grid = (triton.cdiv(max_query_len, block_m), num_heads, batch)
    _launch_prefill(
        grid,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        block_tables.stride(0),
        num_heads,
        num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=64,
        num_warps=4,
        num_stages=2,
        **pdl_options(out.device),
    )
    return out
