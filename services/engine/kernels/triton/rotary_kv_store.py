"""Rotary embedding of q and k fused with the paged KV-cache write, one program per token.

Reads q, k, v of a token once (views into the fused QKV projection output are fine: only the
token stride is taken), rotates q and k by the token's position (Llama's rotate-half
convention, float32 cos/sin tables) and writes rotated q to a contiguous [T, heads, head_dim]
tensor and rotated k plus v into the cache slot `slot_mapping[t]` (slot < 0: padding, skipped).
With `rotate=False` it is the plain KV-cache store. Into a float8 cache (kv_cache_dtype fp8)
keys and values are clamped to float8 e4m3's range (+-448) before they are rounded. With a
`LoRAEpilogue` (kernels/triton/lora_epilogue.py) q, k and v first get each token's adapter
delta (slices 0, 1 and 2 of u; Bᵀ over the whole QKV output); with `LoRADeltas`, the deltas
the LoRA kernels wrote beside the matmul (laid out as the QKV output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import CachedLaunch, pdl_options, pdl_prologue
from services.engine.kernels.triton.lora_epilogue import (
    LoRADeltas,
    LoRAEpilogue,
    block_options,
    block_ranks,
    check,
    delta_args,
    epilogue_args,
    lora_block_delta,
    lora_delta,
    row_rank,
    split_deltas,
)

FP8_MAX = tl.constexpr(448.0)  # float8 e4m3 (fn)'s largest finite value


@triton.jit
def _rotary_kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_stride,
    kv_stride,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    q_out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    num_heads,
    num_kv_heads,
    u_ptr,
    u_stride,
    bt_ptr,
    rows_on_ptr,
    rank_ptr,
    delta_ptr,
    delta_stride,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    ROTATE: tl.constexpr,
    HAS_LORA: tl.constexpr,
    SLICE_WIDTH: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, half)
    heads = tl.arange(0, HEADS_P)
    kv_heads = tl.arange(0, KV_HEADS_P)
    q_mask = (heads < num_heads)[:, None]
    kv_mask = (kv_heads < num_kv_heads)[:, None]
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * half + dims)[None, :]
    sin = tl.load(sin_ptr + position * half + dims)[None, :]

    q_offsets = heads[:, None] * HEAD_DIM + dims[None, :]
    q1 = tl.load(q_ptr + token * q_stride + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + token * q_stride + q_offsets + half, mask=q_mask, other=0.0)
    q2 = q2.to(tl.float32)
    q_size = num_heads * HEAD_DIM
    kv_size = num_kv_heads * HEAD_DIM
    if HAS_LORA:
        rank = row_rank(rows_on_ptr, rank_ptr, token)
        u_row = u_ptr + token * u_stride
        width = q_size + 2 * kv_size
        q1 += lora_delta(u_row, bt_ptr, width, q_offsets, q_mask, rank, SLICE_WIDTH)
        q2 += lora_delta(u_row, bt_ptr, width, q_offsets + half, q_mask, rank, SLICE_WIDTH)
    delta_row = delta_ptr + token * delta_stride  # [q | k | v] as the QKV output
    if HAS_DELTA:
        q1 += tl.load(delta_row + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
        q2 += tl.load(delta_row + q_offsets + half, mask=q_mask, other=0.0).to(tl.float32)
    if ROTATE:
        q1, q2 = q1 * cos - q2 * sin, q2 * cos + q1 * sin
    out_base = q_out_ptr + token * num_heads * HEAD_DIM + q_offsets
    tl.store(out_base, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(out_base + half, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        kv_offsets = kv_heads[:, None] * HEAD_DIM + dims[None, :]
        k1 = tl.load(k_ptr + token * kv_stride + kv_offsets, mask=kv_mask, other=0.0)
        k2 = tl.load(k_ptr + token * kv_stride + kv_offsets + half, mask=kv_mask, other=0.0)
        k1 = k1.to(tl.float32)
        k2 = k2.to(tl.float32)
        if HAS_LORA:
            u_k = u_row + SLICE_WIDTH
            k_columns = q_size + kv_offsets
            k1 += lora_delta(u_k, bt_ptr, width, k_columns, kv_mask, rank, SLICE_WIDTH)
            k2 += lora_delta(u_k, bt_ptr, width, k_columns + half, kv_mask, rank, SLICE_WIDTH)
        if HAS_DELTA:
            k_delta = delta_row + q_size + kv_offsets
            k1 += tl.load(k_delta, mask=kv_mask, other=0.0).to(tl.float32)
            k2 += tl.load(k_delta + half, mask=kv_mask, other=0.0).to(tl.float32)
        if ROTATE:
            k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        v1 = tl.load(v_ptr + token * kv_stride + kv_offsets, mask=kv_mask, other=0.0)
        v2 = tl.load(v_ptr + token * kv_stride + kv_offsets + half, mask=kv_mask, other=0.0)
        if HAS_LORA:
            u_v = u_row + 2 * SLICE_WIDTH
            v_columns = q_size + kv_size + kv_offsets
            v1 = v1.to(tl.float32)
            v2 = v2.to(tl.float32)
            v1 += lora_delta(u_v, bt_ptr, width, v_columns, kv_mask, rank, SLICE_WIDTH)
            v2 += lora_delta(u_v, bt_ptr, width, v_columns + half, kv_mask, rank, SLICE_WIDTH)
        if HAS_DELTA:
            v_delta = delta_row + q_size + kv_size + kv_offsets
            v1 = v1.to(tl.float32) + tl.load(v_delta, mask=kv_mask, other=0.0).to(tl.float32)
            v2 = v2.to(tl.float32) + tl.load(v_delta + half, mask=kv_mask, other=0.0).to(tl.float32)
        cache_base = slot * num_kv_heads * HEAD_DIM + kv_offsets
        element = key_cache_ptr.dtype.element_ty
        if element == tl.float8e4nv:  # kv_cache_dtype fp8: saturate, never NaN past its range
            k1 = tl.clamp(k1, -FP8_MAX, FP8_MAX)
            k2 = tl.clamp(k2, -FP8_MAX, FP8_MAX)
            v1 = tl.clamp(v1.to(tl.float32), -FP8_MAX, FP8_MAX)
            v2 = tl.clamp(v2.to(tl.float32), -FP8_MAX, FP8_MAX)
        tl.store(key_cache_ptr + cache_base, k1.to(element), mask=kv_mask)
        tl.store(key_cache_ptr + cache_base + half, k2.to(element), mask=kv_mask)
        tl.store(value_cache_ptr + cache_base, v1.to(element), mask=kv_mask)
        tl.store(value_cache_ptr + cache_base + half, v2.to(element), mask=kv_mask)


@triton.jit
def _rotary_kv_store_lora_kernel(
    qkv_ptr,
    qkv_stride,
    num_tokens,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    slot_mapping_ptr,
    q_out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    num_heads,
    num_kv_heads,
    u_ptr,
    u_stride,
    bt_ptr,
    rows_on_ptr,
    rank_ptr,
    SLICE_WIDTH: tl.constexpr,
    R_P: tl.constexpr,
    IEEE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROTATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One head (of q, k or v: program_id 1 over q | k | v heads) of a block of tokens, each
    token's LoRA delta added first (one tensor-core product for the block)."""
    pdl_prologue(USE_PDL)
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, half)
    columns = head * HEAD_DIM + dims
    mask = token_mask[:, None]
    source = qkv_ptr + tokens[:, None].to(tl.int64) * qkv_stride + columns[None, :]
    x1 = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(source + half, mask=mask, other=0.0).to(tl.float32)
    ranks, top = block_ranks(rows_on_ptr, rank_ptr, tokens, token_mask)
    part = (head >= num_heads).to(tl.int32) + (head >= num_heads + num_kv_heads).to(tl.int32)
    u_part = u_ptr + part * SLICE_WIDTH  # slice 0 q, 1 k, 2 v
    width = (num_heads + 2 * num_kv_heads) * HEAD_DIM
    every = dims < half
    x1 += lora_block_delta(
        u_part, u_stride, tokens, token_mask, ranks, top, bt_ptr, width, columns, every,
        SLICE_WIDTH, R_P, IEEE,
    )  # fmt: skip
    x2 += lora_block_delta(
        u_part, u_stride, tokens, token_mask, ranks, top, bt_ptr, width, columns + half, every,
        SLICE_WIDTH, R_P, IEEE,
    )  # fmt: skip
    if ROTATE:  # noqa: SIM102 (a constexpr, then a value: two ifs for Triton)
        if part < 2:
            position = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
            table = position[:, None] * half + dims[None, :]
            cos = tl.load(cos_ptr + table, mask=mask, other=1.0)
            sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
            x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if part == 0:
        out = q_out_ptr + tokens[:, None].to(tl.int64) * (num_heads * HEAD_DIM) + columns[None, :]
        tl.store(out, x1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + half, x2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)
        kv_head = head - num_heads - (part - 1) * num_kv_heads
        offsets = (slot * num_kv_heads + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        store_mask = (slot >= 0)[:, None]
        element = key_cache_ptr.dtype.element_ty
        if element == tl.float8e4nv:  # kv_cache_dtype fp8: saturate, never NaN past its range
            x1 = tl.clamp(x1, -FP8_MAX, FP8_MAX)
            x2 = tl.clamp(x2, -FP8_MAX, FP8_MAX)
        if part == 1:
            tl.store(key_cache_ptr + offsets, x1.to(element), mask=store_mask)
            tl.store(key_cache_ptr + offsets + half, x2.to(element), mask=store_mask)
        else:
            tl.store(value_cache_ptr + offsets, x1.to(element), mask=store_mask)
            tl.store(value_cache_ptr + offsets + half, x2.to(element), mask=store_mask)


_launch_rotary_lora = CachedLaunch(_rotary_kv_store_lora_kernel)
_launch_rotary = CachedLaunch(_rotary_kv_store_kernel)


def rotary_kv_store(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    rotate: bool = True,
    lora: LoRAEpilogue | LoRADeltas | None = None,
) -> torch.Tensor:
    """Rotated query [T, heads, head_dim]; rotated key and value written into the caches.

    query [T, heads * head_dim] and key/value [T, kv_heads * head_dim] may be column views of
    one QKV tensor (unit stride inside a token). cos/sin: [max_position, head_dim // 2] float32.
    `lora`: each token's adapter delta of q | k | v, added before the rotation.
    """
    lora, deltas = split_deltas(lora)
    tokens = query.shape[0]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[-1] // head_dim if query.dim() == 2 else query.shape[1]
    query2d = query.reshape(tokens, -1) if query.dim() == 3 else query
    key2d = key.reshape(tokens, -1) if key.dim() == 3 else key
    value2d = value.reshape(tokens, -1) if value.dim() == 3 else value
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if tokens == 0:
        return q_out
    if key2d.stride(0) != value2d.stride(0) or query2d.stride(-1) != 1 or key2d.stride(-1) != 1:
        key2d, value2d, query2d = key2d.contiguous(), value2d.contiguous(), query2d.contiguous()
    if lora is not None:
        check(lora, tokens, query2d.shape[1] + 2 * key2d.shape[1], 3)
        if head_dim >= 32 and _one_qkv_tensor(query2d, key2d, value2d):
            block_t = 16
            grid = (triton.cdiv(tokens, block_t), num_heads + 2 * num_kv_heads)
            _launch_rotary_lora(grid,
                query2d, query2d.stride(0), tokens, positions, cos, sin, slot_mapping, q_out,
                key_cache, value_cache, num_heads, num_kv_heads, *lora.kernel_args(),
                **block_options(lora), HEAD_DIM=head_dim, BLOCK_T=block_t, ROTATE=rotate,
                num_warps=4, **pdl_options(q_out.device),
            )  # fmt: skip
            return q_out
    lora_args, lora_options = epilogue_args(query2d, lora)
    width = query2d.shape[1] + 2 * key2d.shape[1]
    extra_args, extra_options = delta_args(query2d, deltas, tokens, width)
    _launch_rotary(
        (tokens,),
        query2d,
        key2d,
        value2d,
        query2d.stride(0),
        key2d.stride(0),
        positions,
        cos,
        sin,
        slot_mapping,
        q_out,
        key_cache,
        value_cache,
        num_heads,
        num_kv_heads,
        *lora_args,
        *extra_args,
        HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_heads),
        KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        ROTATE=rotate,
        **lora_options,
        **extra_options,
        num_warps=4,
        **pdl_options(q_out.device),
    )
    return q_out


def _one_qkv_tensor(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether q | k | v lie side by side in one tensor's rows (columns of one QKV output)."""
    size = query.element_size()
    return (
        query.stride(0) == key.stride(0) == value.stride(0)
        and key.data_ptr() == query.data_ptr() + query.shape[1] * size
        and value.data_ptr() == key.data_ptr() + key.shape[1] * size
    )
