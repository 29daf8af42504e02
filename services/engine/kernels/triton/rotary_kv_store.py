"""Rotary embedding of q and k fused with the paged KV-cache write, one program per token.

Reads q, k, v of a token once (views into the fused QKV projection output are fine: only the
token stride is taken), rotates q and k by the token's position (Llama's rotate-half
convention, float32 cos/sin tables) and writes rotated q to a contiguous [T, heads, head_dim]
tensor and rotated k plus v into the cache slot `slot_mapping[t]` (slot < 0: padding, skipped).
With `rotate=False` it is the plain KV-cache store. Into a float8 cache (kv_cache_dtype fp8)
keys and values are clamped to float8 e4m3's range (+-448) before they are rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.triton.launch import pdl_options, pdl_prologue

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
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    ROTATE: tl.constexpr,
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
        if ROTATE:
            k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
        v1 = tl.load(v_ptr + token * kv_stride + kv_offsets, mask=kv_mask, other=0.0)
        v2 = tl.load(v_ptr + token * kv_stride + kv_offsets + half, mask=kv_mask, other=0.0)
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
) -> torch.Tensor:
    """Rotated query [T, heads, head_dim]; rotated key and value written into the caches.

    query [T, heads * head_dim] and key/value [T, kv_heads * head_dim] may be column views of
    one QKV tensor (unit stride inside a token). cos/sin: [max_position, head_dim // 2] float32.
    """
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
    _rotary_kv_store_kernel[(tokens,)](
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
        HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_heads),
        KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        ROTATE=rotate,
        num_warps=4,
        **pdl_options(q_out.device),
    )
    return q_out
