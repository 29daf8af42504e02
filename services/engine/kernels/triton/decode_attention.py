"""Paged decode attention with split-K (flash-decoding): one query token per sequence.

Grid (sequence, kv head, split): each program loads the query rows of every head that shares
its kv head (GQA; padded to 16 rows for tensor-core dots), walks its share of the sequence's
cached tokens through the block table in tiles of BLOCK_N tokens, and writes a partial output
with its log-sum-exp. The last split of a (sequence, kv head) to finish merges them (an atomic
counter per pair, re-armed to zero by that split), or, without counters, a second small kernel
does; with one split the output is written directly. (The in-kernel merge measured slower than
the merge kernel at batch 1 on the H100 - 0.28 vs 0.24 ms per 8B step, 2026-11-22 - so the
backend passes no counters; it stays as a tested option.) The split count depends only on
the batch size, not on the context lengths, so a captured CUDA graph stays valid as sequences
grow; splits past a sequence's end do no work. Padding rows (seq_len 0) produce zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.common.errors import InvalidArgumentError
from services.engine.kernels.triton.launch import CachedLaunch, pdl_options, pdl_prologue
from services.engine.kernels.triton.paged_kv import attention_output, load_kv_tile

_LOG2E = 1.4426950408889634


# The block table's width follows the step's longest sequence: not specialised, so a width
# the warm-up did not see (a multiple of 16, or 1) compiles no new variant on a serving step.
@triton.jit(do_not_specialize=["block_table_stride"])
def _decode_split_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    counters_ptr,
    scale_log2,
    block_table_stride,
    num_heads,
    num_kv_heads,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,  # 0: partials (merge kernel after), 1: one split, 2: last split merges
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + (seq * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    max_score = tl.full([GROUP_P], float("-inf"), tl.float32)
    denominator = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    slot_stride = num_kv_heads * HEAD_DIM
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
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
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(max_score, tl.max(scores, axis=1))
        probabilities = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(max_score - new_max)
        denominator = denominator * correction + tl.sum(probabilities, axis=1)
        acc = acc * correction[:, None] + tl.dot(probabilities.to(v.dtype), v)
        max_score = new_max
    has_tokens = denominator > 0
    out = acc / tl.where(has_tokens, denominator, 1.0)[:, None]
    out_rows = (seq * num_heads + heads)[:, None] * HEAD_DIM + dims[None, :]
    if MODE == 1:
        tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        lse = tl.where(
            has_tokens, max_score + tl.log2(tl.where(has_tokens, denominator, 1.0)), -1e30
        )
        partial_base = (seq * num_heads + heads) * NUM_SPLITS
        tl.store(
            partial_out_ptr + (partial_base + split)[:, None] * HEAD_DIM + dims[None, :],
            out,
            mask=row_mask[:, None],
        )
        tl.store(partial_lse_ptr + partial_base + split, lse, mask=row_mask)
        if MODE == 2:
            # The last split of this (sequence, kv head) to finish merges all of them (the
            # atomic orders every split's stores before its loads) and re-arms the counter.
            counter = counters_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                best = tl.full([GROUP_P], -1e30, tl.float32)
                for other in tl.static_range(NUM_SPLITS):
                    other_lse = tl.load(
                        partial_lse_ptr + partial_base + other, mask=row_mask, other=-1e30,
                        cache_modifier=".cg",
                    )  # fmt: skip
                    best = tl.maximum(best, other_lse)
                total = tl.zeros([GROUP_P], tl.float32)
                merged = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
                for other in tl.static_range(NUM_SPLITS):
                    other_lse = tl.load(
                        partial_lse_ptr + partial_base + other, mask=row_mask, other=-1e30,
                        cache_modifier=".cg",
                    )  # fmt: skip
                    weight = tl.where(other_lse > -1e29, tl.exp2(other_lse - best), 0.0)
                    other_out = tl.load(
                        partial_out_ptr + (partial_base + other)[:, None] * HEAD_DIM
                        + dims[None, :],
                        mask=row_mask[:, None], other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
                    merged += other_out * weight[:, None]
                    total += weight
                merged = merged / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(
                    out_ptr + out_rows, merged.to(out_ptr.dtype.element_ty), mask=row_mask[:, None]
                )
                tl.atomic_xchg(counter, 0)


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # seq * num_heads + head
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HEAD_DIM)
    split_mask = splits < NUM_SPLITS
    lse = tl.load(partial_lse_ptr + row * NUM_SPLITS + splits, mask=split_mask, other=-1e30)
    best = tl.max(lse, axis=0)
    weights = tl.where(split_mask & (lse > -1e29), tl.exp2(lse - best), 0.0)
    total = tl.sum(weights, axis=0)
    partial = tl.load(
        partial_out_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, merged.to(out_ptr.dtype.element_ty))


def choose_num_splits(batch_size: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough (sequence, kv head, split) programs to fill the GPU about twice over."""
    wanted = triton.cdiv(2 * num_sms, max(1, batch_size * num_kv_heads))
    return int(min(32, max(1, triton.next_power_of_2(wanted))))


_launch_decode_split = CachedLaunch(_decode_split_kernel)
_launch_decode_merge = CachedLaunch(_decode_merge_kernel)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query [B, heads, head_dim] (one token each) over the paged cache -> same shape.

    seq_lens [B] int32 counts the cached tokens including this step's (already written).
    counters: zeroed int32 [>= B * kv_heads] (kept zeroed) lets the last split to finish merge
    the splits in the same kernel; without it a second kernel merges them. out: where to write
    (contiguous, query's shape and dtype; by default a new tensor).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = attention_output(query, out)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads)
    query = query.contiguous()
    # MODE 1 writes the output directly; 2 merges in the last split to finish (needs a
    # zeroed int32 counter per (sequence, kv head), left zeroed); 0 runs the merge kernel.
    mode = 1 if num_splits == 1 else (2 if counters is not None else 0)
    if mode == 2 and counters.numel() < batch * num_kv_heads:
        raise InvalidArgumentError("decode attention counters are too few for this batch")
    partial_shape = (batch, num_heads, num_splits)
    partial_out = torch.empty(
        (*partial_shape, head_dim) if mode != 1 else (1, head_dim),
        dtype=torch.float32,
        device=query.device,
    )
    partial_lse = torch.empty(
        partial_shape if mode != 1 else (1,), dtype=torch.float32, device=query.device
    )
    _launch_decode_split(
        (batch, num_kv_heads, num_splits),
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        counters if mode == 2 else partial_lse,
        scale * _LOG2E,
        block_tables.stride(0),
        num_heads,
        num_kv_heads,
        NUM_SPLITS=num_splits,
        GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        # A float8 cache's 128-byte rows: one split walks them in larger tiles (H100, 384
        # sequences of 640 tokens: 0.23 ms a layer against 0.27 at 64; bf16 alike either way).
        BLOCK_N=128 if key_cache.element_size() == 1 and num_splits == 1 else 64,
        MODE=mode,
        num_warps=4,
        num_stages=2,
        **pdl_options(out.device),
    )
    if mode == 0:
        _launch_decode_merge(
            (batch * num_heads,),
            partial_out,
            partial_lse,
            out,
            NUM_SPLITS=num_splits,
            SPLITS_P=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            num_warps=1 if head_dim <= 64 else 2,
            **pdl_options(out.device),
        )
    return out
