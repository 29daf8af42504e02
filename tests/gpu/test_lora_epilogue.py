"""The LoRA epilogues of the norm, SwiGLU and rotary + KV-store kernels against plain PyTorch.

Each kernel reads a projection output that is a column view of a wider matmul output (u in the
columns after it, as lora/fused.py lays it out) and must add each row's `u Bᵀ` over the
adapter's rank: rows of the adapter and of the base model side by side, ranks below and at the
slice width and a rank of zero (a projection the adapter leaves out). With `LoRADeltas` (the
deltas the LoRA kernels wrote beside the matmul) each kernel must give what it gives for the
output with the deltas added first. Run on the GPU in float32 and bfloat16 and, in float32, by
Triton's interpreter in CI (tests/unit/engine/kernels).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as functional

from services.engine.kernels.triton.lora_epilogue import LoRADeltas, LoRAEpilogue


def _deltas(u, bt, rows_on, rank, bounds, width, slice_width) -> torch.Tensor:
    rows = u.shape[0]
    out = torch.zeros(rows, bt.shape[1], dtype=torch.float32, device=u.device)
    for row in range(rows):
        rank_here = int(rows_on[row]) * int(rank)
        for index, (low, high) in enumerate(bounds):
            u_slice = u[row, index * slice_width : index * slice_width + rank_here].float()
            out[row, low:high] = u_slice @ bt[:rank_here, low:high].float()
    return out[:, :width]


def check_epilogues(device: str, dtype: torch.dtype, slice_width: int = 8) -> None:
    for rank in (5, slice_width, 0):
        check_epilogues_of_rank(device, dtype, slice_width, rank)


def check_epilogues_of_rank(device: str, dtype: torch.dtype, slice_width: int, rank_value: int):
    from services.engine.kernels.triton.rms_norm import rms_norm
    from services.engine.kernels.triton.swiglu import swiglu

    generator = torch.Generator().manual_seed(0)
    tight = dtype == torch.float32
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if tight else {"rtol": 3e-2, "atol": 3e-2}

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    rank = torch.tensor([rank_value], dtype=torch.int32, device=device)
    rows = 6
    rows_on = torch.tensor([1, 0, 1, 1, 0, 1, 0, 0], dtype=torch.int32, device=device)

    def epilogue(u, bt) -> LoRAEpilogue:
        return LoRAEpilogue(u, bt, rows_on, rank, slice_width)

    # residual add + RMSNorm, x a column view (3 spare columns past u)
    hidden, eps = 48, 1e-5
    wide = randn(rows, hidden + slice_width + 3)
    x, u = wide[:, :hidden], wide[:, hidden : hidden + slice_width]
    bt = randn(slice_width, hidden)
    delta = _deltas(u, bt, rows_on, rank, [(0, hidden)], hidden, slice_width)
    weight = torch.rand(hidden, generator=generator).to(device=device, dtype=dtype)
    for residual in (None, randn(rows, hidden)):
        normed, summed = rms_norm(x, residual, weight, eps, lora=epilogue(u, bt))
        want = x.float() + delta + (0 if residual is None else residual.float())
        torch.testing.assert_close(summed.float(), want, **tolerance)
        want_normed = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        torch.testing.assert_close(normed.float(), want_normed, **tolerance)
        # rows of the base model, or rank 0: what no epilogue gives, bit for bit
        untouched = rows_on[:rows] * rank_value == 0
        plain_normed, plain_summed = rms_norm(x.contiguous(), residual, weight, eps)
        assert torch.equal(normed[untouched], plain_normed[untouched])
        assert torch.equal(summed[untouched], plain_summed[untouched])

    # SwiGLU over [gate | up], u slices 0 and 1
    inter = 40
    wide = randn(rows, 2 * inter + 2 * slice_width)
    gate_up, u = wide[:, : 2 * inter], wide[:, 2 * inter :]
    bt = randn(slice_width, 2 * inter)
    bounds = [(0, inter), (inter, 2 * inter)]
    summed = gate_up.float() + _deltas(u, bt, rows_on, rank, bounds, 2 * inter, slice_width)
    want = functional.silu(summed[:, :inter]) * summed[:, inter:]
    torch.testing.assert_close(swiglu(gate_up, lora=epilogue(u, bt)).float(), want, **tolerance)

    # rotary + KV store over q | k | v, u slices 0, 1 and 2; one padding token (slot -1); heads
    # of 16 per token, of 32 a head of a block of tokens at a time
    for head_dim in (16, 32):
        check_rotary_epilogue(device, dtype, slice_width, head_dim, rows_on, rank, randn)


HEADS, KV_HEADS = 4, 2


def _rotary_store(head_dim: int, cache_slots: list[int], dtype: torch.dtype, device: str):
    """A function of (q | k | v rows, lora) giving the rotary kernel's rotated q and the
    caches it wrote, for tokens at positions 3, 4, ... into `cache_slots` (-1: padding)."""
    from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store

    q_size, kv_size = HEADS * head_dim, KV_HEADS * head_dim
    half = head_dim // 2
    angles = torch.arange(64).float()[:, None] / (10000 ** (torch.arange(half).float() / half))
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    positions = torch.arange(len(cache_slots), device=device) + 3
    slots = torch.tensor(cache_slots, device=device)

    def store(source, lora):
        key_cache = torch.zeros(2, 16, KV_HEADS, head_dim, dtype=dtype, device=device)
        value_cache = torch.zeros_like(key_cache)
        query, key, value = source.split([q_size, kv_size, kv_size], dim=-1)
        out = rotary_kv_store(
            query, key, value, positions, cos, sin, slots, key_cache, value_cache, lora=lora
        )
        return out, key_cache, value_cache

    return store


def check_rotary_epilogue(device, dtype, slice_width, head_dim, rows_on, rank, randn) -> None:
    rows = 6
    tight = dtype == torch.float32
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if tight else {"rtol": 3e-2, "atol": 3e-2}
    q_size, kv_size = HEADS * head_dim, KV_HEADS * head_dim
    width = q_size + 2 * kv_size
    wide = randn(rows, width + 3 * slice_width)
    qkv, u = wide[:, :width], wide[:, width:]
    bt = randn(slice_width, width)
    bounds = [(0, q_size), (q_size, q_size + kv_size), (q_size + kv_size, width)]
    summed = (qkv.float() + _deltas(u, bt, rows_on, rank, bounds, width, slice_width)).to(dtype)
    store = _rotary_store(head_dim, [0, 1, -1, 3, 4, 17], dtype, device)
    lora = LoRAEpilogue(u, bt, rows_on, rank, slice_width)
    for got, want in zip(store(qkv, lora), store(summed, None), strict=True):
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


def check_dense_deltas(device: str, dtype: torch.dtype) -> None:
    """Each consumer kernel given a delta buffer (more rows than the step, as a graph's buffer
    is) against the same kernel on the output with the delta added first."""
    from services.engine.kernels.triton.rms_norm import rms_norm
    from services.engine.kernels.triton.swiglu import swiglu

    generator = torch.Generator().manual_seed(1)
    # bfloat16: the kernels add in float32, the reference rounds the sum to bfloat16 first
    tight = dtype == torch.float32
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if tight else {"rtol": 2e-2, "atol": 2e-2}

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    def summed(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return (y.float() + delta[: y.shape[0]].float()).to(dtype)

    rows, hidden, eps = 5, 48, 1e-5
    x, delta = randn(rows, hidden), randn(rows + 3, hidden)
    delta[1].zero_()  # a row of the base model
    weight = torch.rand(hidden, generator=generator).to(device=device, dtype=dtype)
    for residual in (None, randn(rows, hidden)):
        got = rms_norm(x, residual, weight, eps, lora=LoRADeltas(delta))
        want = rms_norm(summed(x, delta), residual, weight, eps)
        for got_part, want_part in zip(got, want, strict=True):
            torch.testing.assert_close(got_part, want_part, **tolerance)
        assert got[1].data_ptr() != x.data_ptr()  # the input itself is never written

    inter = 40
    gate_up, delta = randn(rows, 2 * inter), randn(rows + 3, 2 * inter)
    torch.testing.assert_close(
        swiglu(gate_up, lora=LoRADeltas(delta)), swiglu(summed(gate_up, delta)), **tolerance
    )

    width = (HEADS + 2 * KV_HEADS) * 16
    qkv, delta = randn(rows, width), randn(rows + 3, width)
    store = _rotary_store(16, [0, -1, 2, 3, 17], dtype, device)
    got, want = store(qkv, LoRADeltas(delta)), store(summed(qkv, delta), None)
    for got_part, want_part in zip(got, want, strict=True):
        torch.testing.assert_close(got_part, want_part, **tolerance)
    with pytest.raises(ValueError, match="does not cover"):
        swiglu(gate_up, lora=LoRADeltas(delta[:, :inter]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consumers_add_written_deltas(dtype) -> None:
    check_dense_deltas("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slice_width", [8, 64])
def test_epilogues_add_each_rows_delta(dtype, slice_width) -> None:
    check_epilogues("cuda", dtype, slice_width)
