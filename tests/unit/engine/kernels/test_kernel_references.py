"""The plain-PyTorch kernel references (CPU): the statements the GPU kernels are tested against.

Each is checked against an independent formulation, so a wrong reference cannot pass a wrong
kernel on the device.
"""

from __future__ import annotations

import torch

from services.engine.kernels import reference


def test_paged_attention_ref_equals_dense_causal_attention_with_cached_prefix() -> None:
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    seq_lens, query_lens = [11, 6], [5, 6]  # sequence 0 has a 6-token cached prefix
    num_blocks = 10
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    tables = torch.tensor([[7, 2, 9], [4, 0, 0]], dtype=torch.int32)
    starts = torch.tensor([0, 5, 11], dtype=torch.int32)
    query = torch.randn(11, heads, head_dim, generator=generator)
    out = reference.paged_attention_ref(
        query, key_cache, value_cache, tables, starts, torch.tensor(seq_lens), 0.25
    )
    for index, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        slots = [int(tables[index, p // block_size]) * block_size + p % block_size
                 for p in range(seq_len)]  # fmt: skip
        keys = key_cache.flatten(0, 1)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
        values = value_cache.flatten(0, 1)[slots].repeat_interleave(2, dim=1).transpose(0, 1)
        q = query[int(starts[index]) : int(starts[index + 1])].transpose(0, 1)
        mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(seq_len - query_len)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=0.25
        ).transpose(0, 1)
        got = out[int(starts[index]) : int(starts[index + 1])]
        assert torch.allclose(got, expected, atol=1e-5)


def test_rotary_ref_matches_complex_rotation_and_preserves_norm() -> None:
    head_dim = 8
    cos, sin = reference.rotary_cos_sin(head_dim, 64, 10000.0, "cpu")
    x = torch.randn(5, 3, head_dim, dtype=torch.float64).float()
    positions = torch.tensor([0, 1, 7, 30, 63])
    rotated = reference.apply_rotary_ref(x, positions, cos, sin)
    half = head_dim // 2
    as_complex = torch.complex(x[..., :half].double(), x[..., half:].double())
    angle = torch.complex(cos[positions].double(), sin[positions].double())[:, None, :]
    turned = as_complex * angle
    expected = torch.cat([turned.real, turned.imag], dim=-1).float()
    assert torch.allclose(rotated, expected, atol=1e-5)
    assert torch.allclose(rotated[0], x[0])  # position 0 does not rotate
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-4)


def test_rms_norm_swiglu_and_kv_store_refs() -> None:
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    weight = torch.rand(8) + 0.5
    normed, summed = reference.rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.allclose(summed, x + residual)
    assert torch.allclose(normed, torch.nn.functional.rms_norm(x + residual, (8,), weight, 1e-6),
                          atol=1e-5)  # fmt: skip
    gate_up = torch.randn(2, 6)
    expected = torch.nn.functional.silu(gate_up[:, :3]) * gate_up[:, 3:]
    assert torch.allclose(reference.swiglu_ref(gate_up), expected)
    key_cache = torch.zeros(3, 2, 1, 4)
    value_cache = torch.zeros(3, 2, 1, 4)
    key, value = torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    reference.kv_store_ref(key, value, key_cache, value_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(key_cache[2, 1], key[0]) and torch.equal(value_cache[0, 0], value[2])
    assert int((key_cache != 0).any(-1).sum()) == 2  # the padding row (-1) wrote nothing
