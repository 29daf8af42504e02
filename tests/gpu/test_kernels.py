"""Each Triton kernel against its plain-PyTorch reference, on fresh random inputs (GPU only).

Outputs are poisoned (NaN) before each kernel so an unwritten element fails the check.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.kernels import reference

DEVICE = "cuda"
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn  # kv_cache_dtype fp8


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN (unwritten or broken) in kernel output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def paged_setup(
    seq_lens, query_lens, num_heads, kv_heads, head_dim, block_size, generator,
    device=DEVICE, dtype=DTYPE, cache_dtype=None,
):  # fmt: skip
    """Random caches, shuffled block tables and metadata for sequences of the given lengths."""
    blocks_needed = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    permutation = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros((len(seq_lens), max(blocks_needed)), dtype=torch.int32)
    used = 0
    for index, count in enumerate(blocks_needed):
        tables[index, :count] = permutation[used : used + count].to(torch.int32)
        used += count
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype or dtype).to(device)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype or dtype).to(device)
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    query = torch.randn((starts[-1], num_heads, head_dim), generator=generator).to(dtype)
    return (
        query.to(device),
        key_cache,
        value_cache,
        tables.to(device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("hidden", [64, 2048, 4096, 5000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(hidden: int, with_residual: bool) -> None:
    from services.engine.kernels.triton.rms_norm import rms_norm

    x = torch.randn(37, hidden, device=DEVICE, dtype=DTYPE)
    residual = torch.randn(37, hidden, device=DEVICE, dtype=DTYPE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(DTYPE)
    out, new_residual = rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = reference.rms_norm_ref(x, residual, weight, 1e-5)
    assert _relative_error(out, ref_out) < 1e-2
    assert _relative_error(new_residual, ref_residual) < 1e-2


@pytest.mark.parametrize("intermediate", [128, 8192, 14336, 1000])
def test_swiglu_matches_reference(intermediate: int) -> None:
    from services.engine.kernels.triton.swiglu import swiglu

    gate_up = torch.randn(19, 2 * intermediate, device=DEVICE, dtype=DTYPE)
    assert _relative_error(swiglu(gate_up), reference.swiglu_ref(gate_up)) < 1e-2


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 8, 64), (9, 3, 64)])
def test_rotary_kv_store_matches_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store

    tokens, block_size, num_blocks = 23, 16, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=DTYPE)
    query, key, value = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    positions = torch.randint(0, 4000, (tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[3] = -1  # a padding row: its cache write is skipped
    cos, sin = reference.rotary_cos_sin(head_dim, 4096, 500000.0, DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=DTYPE)
    value_cache = torch.full(shape, float("nan"), device=DEVICE, dtype=DTYPE)
    ref_key_cache, ref_value_cache = key_cache.clone(), value_cache.clone()
    q_out = rotary_kv_store(query, key, value, positions, cos, sin, slots, key_cache, value_cache)
    q3 = query.reshape(tokens, heads, head_dim)
    k3 = key.reshape(tokens, kv_heads, head_dim)
    v3 = value.reshape(tokens, kv_heads, head_dim)
    assert _relative_error(q_out, reference.apply_rotary_ref(q3, positions, cos, sin)) < 1e-2
    ref_k = reference.apply_rotary_ref(k3, positions, cos, sin)
    reference.kv_store_ref(ref_k, v3, ref_key_cache, ref_value_cache, slots)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    flat_key, flat_ref = key_cache.flatten(0, 1), ref_key_cache.flatten(0, 1)
    assert _relative_error(flat_key[written], flat_ref[written]) < 1e-2
    assert torch.isnan(flat_key[~written]).all(), "wrote outside slot_mapping"
    flat_value, flat_ref_value = value_cache.flatten(0, 1), ref_value_cache.flatten(0, 1)
    assert torch.equal(flat_value[written], flat_ref_value[written])


def test_rotary_kv_store_into_a_float8_cache_rounds_and_saturates() -> None:
    from services.engine.kernels.triton.rotary_kv_store import rotary_kv_store

    tokens, heads, kv_heads, head_dim, block_size, num_blocks = 29, 32, 8, 128, 16, 4
    qkv = 4 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=DTYPE)
    query, key, value = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    value[0, :5] = torch.tensor([1000.0, -1000.0, 448.0, 500.0, 3e4], dtype=DTYPE)
    positions = torch.randint(0, 4000, (tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    cos, sin = reference.rotary_cos_sin(head_dim, 4096, 500000.0, DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.zeros(shape, device=DEVICE, dtype=FP8)
    value_cache = torch.zeros(shape, device=DEVICE, dtype=FP8)
    rotary_kv_store(query, key, value, positions, cos, sin, slots, key_cache, value_cache)
    k3 = reference.apply_rotary_ref(key.reshape(tokens, kv_heads, head_dim), positions, cos, sin)
    v3 = value.reshape(tokens, kv_heads, head_dim)
    stored_k = key_cache.flatten(0, 1).float()[slots.long()]
    stored_v = value_cache.flatten(0, 1).float()[slots.long()]
    assert torch.isfinite(stored_k).all() and torch.isfinite(stored_v).all()
    # Values are exact once in bf16 and in range: rounded to float8 alone.
    in_range = v3.float().abs() <= 448
    assert torch.equal(stored_v[in_range], v3.float()[in_range].to(FP8).float())
    assert stored_v[0, 0, :5].tolist() == [448.0, -448.0, 448.0, 448.0, 448.0]
    # Keys are rotated in float32 first: within float8's rounding of the bf16 reference.
    assert _relative_error(stored_k, k3.float().clamp(-448, 448)) < 4e-2


@pytest.mark.parametrize("seq_lens", [[1, 17, 300, 2048], [5000], [64, 0, 129]])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 8, 64), (8, 8, 64)])
@pytest.mark.parametrize("cache_dtype", [DTYPE, FP8])
def test_decode_attention_matches_reference(seq_lens, heads, kv_heads, head_dim, cache_dtype):
    from services.engine.kernels.triton.decode_attention import paged_decode_attention

    generator = torch.Generator().manual_seed(sum(seq_lens) + heads)
    lengths_for_blocks = [max(1, length) for length in seq_lens]
    query, key_cache, value_cache, tables, starts, lens = paged_setup(
        lengths_for_blocks, [1] * len(seq_lens), heads, kv_heads, head_dim, 16, generator,
        cache_dtype=cache_dtype,
    )  # fmt: skip
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    # The reference reads the cache widened to bf16 (exact for float8): the kernel must too.
    ref = reference.paged_attention_ref(
        query, key_cache.to(DTYPE), value_cache.to(DTYPE), tables, starts, lens, scale
    )
    counters = torch.zeros(len(seq_lens) * kv_heads, dtype=torch.int32, device=DEVICE)
    for splits in (None, 1, 7, 32):
        for merge_counters in (None, counters, counters):  # twice: the counters re-arm
            out = paged_decode_attention(
                query, key_cache, value_cache, tables, lens, scale, num_splits=splits,
                counters=merge_counters,
            )  # fmt: skip
            assert _relative_error(out, ref) < 2e-2, (splits, merge_counters is not None)
            assert int(counters.abs().sum()) == 0, "the last split must re-arm its counter"
    empty = [index for index, length in enumerate(seq_lens) if length == 0]
    for index in empty:
        assert torch.all(out[index] == 0)


@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [([100], [100]), ([300, 7, 1000], [44, 7, 1000]), ([2048, 50, 513], [1, 50, 200])],
)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 4, 64)])
@pytest.mark.parametrize("cache_dtype", [DTYPE, FP8])
def test_prefill_attention_matches_reference(
    seq_lens, query_lens, heads, kv_heads, head_dim, cache_dtype
):
    from services.engine.kernels.triton.prefill_attention import paged_prefill_attention

    generator = torch.Generator().manual_seed(sum(seq_lens) + head_dim)
    query, key_cache, value_cache, tables, starts, lens = paged_setup(
        seq_lens, query_lens, heads, kv_heads, head_dim, 16, generator, cache_dtype=cache_dtype
    )
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        query, key_cache, value_cache, tables, starts, lens, max(query_lens), scale
    )
    ref = reference.paged_attention_ref(
        query, key_cache.to(DTYPE), value_cache.to(DTYPE), tables, starts, lens, scale
    )
    assert _relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (1000, 14336), (4096, 700)])
def test_skinny_matmul_matches_reference(rows: int, n: int, k: int) -> None:
    from services.engine.kernels.triton.skinny_matmul import candidates, skinny_matmul

    x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
    weight = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k**0.5
    expected = x.double() @ weight.double().T
    for config in candidates(rows):
        out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=DTYPE)
        out.copy_(skinny_matmul(x, weight, config))
        assert _relative_error(out, expected) < 1e-2, config


def test_base_kernels_launched_directly_give_the_jit_paths_bits(monkeypatch) -> None:
    """Eager steps launch the norm, SwiGLU, rotary + KV store and both attention kernels
    without Triton's dispatch after their first launch (kernels/triton/launch.py): each
    later launch must write exactly what the JIT path writes."""
    from services.engine.kernels.triton import (
        decode_attention,
        launch,
        prefill_attention,
        rms_norm,
        rotary_kv_store,
        swiglu,
    )

    launchers = (
        rms_norm._launch_rms_norm,
        swiglu._launch_swiglu,
        rotary_kv_store._launch_rotary,
        decode_attention._launch_decode_split,
        decode_attention._launch_decode_merge,
        prefill_attention._launch_prefill,
    )
    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, tokens = 32, 8, 128, 19
    x = torch.randn(tokens, 4096, generator=generator).to(DTYPE).to(DEVICE)
    residual = torch.randn(tokens, 4096, generator=generator).to(DTYPE).to(DEVICE)
    weight = torch.randn(4096, generator=generator).to(DTYPE).to(DEVICE)
    gate_up = torch.randn(tokens, 2 * 14336, generator=generator).to(DTYPE).to(DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    qkv = qkv.to(DTYPE).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    positions = torch.arange(tokens, device=DEVICE) * 7
    cos, sin = reference.rotary_cos_sin(head_dim, 4096, 500000.0, DEVICE)
    query, key_cache, value_cache, tables, starts, lens = paged_setup(
        [300, 7, 1000], [44, 7, 1000], heads, kv_heads, head_dim, 16, generator
    )
    decode_query = query[:3].contiguous()

    def run() -> list[torch.Tensor]:
        caches = (key_cache.clone(), value_cache.clone())
        slots = torch.arange(tokens, device=DEVICE) * 3
        return [
            *rms_norm.rms_norm(x, residual, weight, 1e-5),
            swiglu.swiglu(gate_up),
            rotary_kv_store.rotary_kv_store(q, k, v, positions, cos, sin, slots, *caches),
            *caches,
            decode_attention.paged_decode_attention(
                decode_query, key_cache, value_cache, tables, lens, 0.088, num_splits=7
            ),
            prefill_attention.paged_prefill_attention(
                query, key_cache, value_cache, tables, starts, lens, 1000, 0.088
            ),
        ]

    results = []
    for direct in (False, True):
        monkeypatch.setattr(launch, "DIRECT_LAUNCH", direct)
        before = [launcher.direct_launches for launcher in launchers]
        results += [run(), run()]  # the second run of each specialization is direct
        after = [launcher.direct_launches for launcher in launchers]
        assert all((b > a) == direct for a, b in zip(before, after, strict=True))
    torch.cuda.synchronize()
    for outputs in results[1:]:
        for out, first in zip(outputs, results[0], strict=True):
            assert torch.equal(out, first)
