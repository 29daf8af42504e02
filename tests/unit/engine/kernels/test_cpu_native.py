"""The native CPU kernels (kernels/cpu_native.cpp) against PyTorch, and their build and fallback.

The library is built here with the machine's g++ (CI has it: scripts/setup.sh installs it), so a
broken build fails these tests instead of silently leaving the engine on its slower path.
"""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch
import torch.nn.functional as F

from services.engine.kernels.cpu import cpu_native
from services.engine.layers.rotary import RotaryEmbedding

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


@pytest.fixture(scope="module")
def kernels() -> cpu_native.CpuKernels:
    loaded = cpu_native.cpu_kernels()
    assert loaded is not None, "the native CPU kernels did not build (see the log)"
    return loaded


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("dim", [576, 40, 7])  # lane multiple, tail, narrower than one lane group
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_torch(kernels, dtype, tolerance, dim, with_residual) -> None:
    generator = torch.Generator().manual_seed(dim)
    wide = torch.randn(5, dim + 3, generator=generator).to(dtype)
    x = wide[:, :dim]  # strided rows, as a slice of a wider activation
    residual = torch.randn(5, dim, generator=generator).to(dtype) if with_residual else None
    weight = torch.rand(dim, generator=generator).to(dtype)
    out, kept = kernels.rms_norm(x, residual, weight, 1e-5)
    summed = x + residual if with_residual else x
    assert torch.equal(kept, summed)  # the sum is rounded to the dtype exactly as eager adds it
    expected = F.rms_norm(summed, (dim,), weight, 1e-5)
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("half", [1536, 24])
def test_silu_mul_matches_torch(kernels, dtype, tolerance, half) -> None:
    gate_up = (torch.randn(4, 2 * half, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    expected = F.silu(gate_up[:, :half]) * gate_up[:, half:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_in_place_matches_the_model_rotary(kernels, dtype, tolerance, head_dim) -> None:
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    generator = torch.Generator().manual_seed(head_dim)
    fused = torch.randn(6, 5 * head_dim, generator=generator).to(dtype)  # 3 q, 1 k, 1 v heads
    heads = fused[:, : 4 * head_dim].view(6, 4, head_dim)
    positions = torch.tensor([0, 1, 7, 100, 255, 511])
    expected = rotary.rotate(positions, heads.clone())
    untouched = fused[:, 4 * head_dim :].clone()
    kernels.rotate_(heads, positions, rotary.cos_cache, rotary.sin_cache)
    torch.testing.assert_close(heads, expected, atol=tolerance * 2, rtol=tolerance)
    assert torch.equal(fused[:, 4 * head_dim :], untouched)  # only the rotated heads change


def test_kv_store_writes_each_token_to_its_slot(kernels) -> None:
    cache_shape = (8, 4, 2, 16)  # blocks, block size, KV heads, head dim
    key_cache, value_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16)
    key = qkv[:, 64:96].view(3, 2, 16)
    value = qkv[:, 96:].view(3, 2, 16)
    slots = torch.tensor([5, 0, 31])
    kernels.kv_store(key, value, key_cache, value_cache, slots)
    flat_keys, flat_values = key_cache.view(-1, 2, 16), value_cache.view(-1, 2, 16)
    assert torch.equal(flat_keys[slots], key) and torch.equal(flat_values[slots], value)
    others = torch.ones(32, dtype=torch.bool)
    others[slots] = False
    assert not flat_keys[others].any() and not flat_values[others].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_first_index_on_ties(kernels, dtype) -> None:
    values = torch.randn(7, 49152 + 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    values[2, 100] = values[2, 40000] = 50.0  # a tie across chunks: the first wins
    values[3, :] = 1.0  # all equal: index 0
    values[4, -1] = 60.0  # the tail past the last full chunk
    assert torch.equal(kernels.argmax_rows(values), values.float().argmax(-1))
    strided = values[:, 10:1000]
    assert torch.equal(kernels.argmax_rows(strided), strided.float().argmax(-1))


def _random_paged_cache(
    generator: torch.Generator,
    lengths: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random key/value caches covering `lengths` in shuffled blocks: each sequence's block ids,
    the padded int32 block tables, the key cache and the value cache."""
    width = -(-max(lengths) // block_size)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    permutation = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[permutation.pop() for _ in range(-(-n // block_size))] for n in lengths]
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    return tables, block_tables, key_cache, value_cache


def _check_decode_attention(
    kernels, dtype, tolerance, head_dim, num_heads, num_kv_heads, block_size, lengths, seed
) -> None:
    """Decode attention over randomly placed cache blocks against a float64 reference."""
    generator = torch.Generator().manual_seed(seed)
    tables, block_tables, key_cache, value_cache = _random_paged_cache(
        generator, lengths, block_size, num_kv_heads, head_dim, dtype
    )
    wide = torch.randn(len(lengths), num_heads, head_dim + 8, generator=generator).to(dtype)
    query = wide[..., :head_dim]  # strided heads, as the query part of a qkv row
    scale = head_dim**-0.5
    out = kernels.decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(lengths, dtype=torch.int32),
        num_kv_heads,
        block_size,
        scale,
    )
    group = num_heads // num_kv_heads
    for row, (length, table) in enumerate(zip(lengths, tables, strict=True)):
        positions = torch.arange(length)
        blocks = torch.tensor(table)[positions // block_size]
        keys = key_cache[blocks, positions % block_size].double()  # [L, KVH, D]
        values = value_cache[blocks, positions % block_size].double()
        grouped = query[row].double().view(num_kv_heads, group, head_dim)
        weights = (grouped @ keys.permute(1, 2, 0) * scale).softmax(-1)  # [KVH, G, L]
        expected = (weights @ values.transpose(0, 1)).reshape(num_heads, head_dim)
        torch.testing.assert_close(out[row].double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 80, 48, 24])  # lanes; 16 mod 32; plain
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (16, 2), (20, 2)])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_decode_attention_matches_a_float64_reference(
    kernels, dtype, tolerance, head_dim, num_heads, num_kv_heads, block_size
) -> None:
    # GQA groups 3, 1, 8 and 10 (more than one pass of 8 heads); lengths around the 16-key
    # tiles and the blocks; the batch is large enough for one item per sequence.
    lengths = [1, 2, 15, 16, 17, 31, 33, 70, 130]
    _check_decode_attention(
        kernels, dtype, tolerance, head_dim, num_heads, num_kv_heads, block_size, lengths,
        seed=head_dim + num_heads + block_size,
    )  # fmt: skip


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("lengths", [[4096], [4095, 3], [1000, 2049, 7, 513, 64]])
def test_decode_attention_long_contexts_and_small_batches(
    kernels, dtype, tolerance, head_dim, lengths
) -> None:
    # Fewer sequences than twice the threads split their KV heads into separate work items.
    _check_decode_attention(
        kernels, dtype, tolerance, head_dim, 8, 2, 16, lengths, seed=len(lengths) + head_dim
    )


def test_attention_without_avx512_bf16_matches(tmp_path, monkeypatch) -> None:
    """Decode and prefill on the float32-product path that bfloat16 caches take on CPUs without
    AVX512-BF16 (this CPU may have it: the library is built once more with the extension
    switched off)."""
    monkeypatch.setattr(cpu_native, "FLAGS", (*cpu_native.FLAGS, "-mno-avx512bf16"))
    path = tmp_path / "no_bf16.so"
    cpu_native.build(path)
    plain = cpu_native.CpuKernels(ctypes.CDLL(str(path)))
    for head_dim in (16, 64, 80):
        _check_decode_attention(
            plain, torch.bfloat16, 1e-2, head_dim, 9, 3, 16, [1, 17, 130, 300], seed=head_dim
        )
        _check_prefill_attention(
            plain, torch.bfloat16, 1e-2, head_dim, 9, 3, 16, PREFILL_CHUNKS, seed=head_dim
        )


def _check_prefill_attention(
    kernels, dtype, tolerance, head_dim, num_heads, num_kv_heads, block_size, chunks, seed
) -> None:
    """Prefill chunks (cached prefix, chunk length) over randomly placed cache blocks, after
    two decode rows that must be left alone, against a float64 causal reference."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [prefix + chunk for prefix, chunk in chunks]
    tables, block_tables, key_cache, value_cache = _random_paged_cache(
        generator, lengths, block_size, num_kv_heads, head_dim, dtype
    )
    starts = [2]
    for _, chunk in chunks:
        starts.append(starts[-1] + chunk)
    wide = torch.randn(starts[-1], num_heads, head_dim + 8, generator=generator).to(dtype)
    query = wide[..., :head_dim]  # strided heads, as the query part of a qkv row
    out = torch.full((starts[-1], num_heads, head_dim), 7.0, dtype=dtype)
    scale = head_dim**-0.5
    kernels.prefill_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lengths, dtype=torch.int32),
        num_kv_heads,
        block_size,
        scale,
        out=out,
    )
    assert torch.all(out[:2] == 7.0)
    group = num_heads // num_kv_heads
    for index, ((prefix, chunk), table) in enumerate(zip(chunks, tables, strict=True)):
        positions = torch.arange(prefix + chunk)
        blocks = torch.tensor(table)[positions // block_size]
        keys = key_cache[blocks, positions % block_size].double()  # [L, KVH, D]
        values = value_cache[blocks, positions % block_size].double()
        rows = query[starts[index] : starts[index + 1]].double()
        grouped = rows.view(chunk, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = grouped @ keys.permute(1, 2, 0).unsqueeze(1) * scale  # [KVH, G, Q, L]
        allowed = positions[None, :] <= (prefix + torch.arange(chunk))[:, None]
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        expected = (weights @ values.transpose(0, 1).unsqueeze(1)).permute(2, 0, 1, 3)
        got = out[starts[index] : starts[index + 1]].double()
        torch.testing.assert_close(
            got, expected.reshape(chunk, num_heads, head_dim), atol=tolerance, rtol=tolerance
        )


# (cached prefix, chunk): single tokens, chunks around the 16-token query tiles and the 32-key
# tiles, with and without a prefix, one long chunk over several hundred keys.
PREFILL_CHUNKS = [(0, 1), (0, 16), (0, 17), (3, 1), (30, 33), (100, 47), (0, 130), (17, 300)]


@pytest.mark.parametrize("dtype, tolerance", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 128, 80, 24])  # lanes; 16 mod 32; plain
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (16, 2)])
def test_prefill_attention_matches_a_float64_reference(
    kernels, dtype, tolerance, head_dim, num_heads, num_kv_heads
) -> None:
    # GQA groups 3, 1 and 8; block sizes 16, 8 and 32 in turn.
    block_size = (16, 8, 32)[(head_dim + num_heads) % 3]
    _check_prefill_attention(
        kernels, dtype, tolerance, head_dim, num_heads, num_kv_heads, block_size, PREFILL_CHUNKS,
        seed=head_dim + num_heads,
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype, tolerance", DTYPES)
def test_prefill_attention_block_sizes(kernels, dtype, tolerance, block_size) -> None:
    chunks = [(0, 31), (1, 32), (64, 65), (5, 2)]
    _check_prefill_attention(
        kernels, dtype, tolerance, 64, 9, 3, block_size, chunks, seed=block_size
    )


def test_library_is_built_once_and_named_by_its_inputs(kernels, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_native, "cache_dir", lambda: str(tmp_path))
    path = cpu_native.library_path()
    assert path.parent == tmp_path / "kernels" and not path.exists()
    cpu_native.build(path)
    assert path.exists() and list(path.parent.iterdir()) == [path]  # no temporary left behind
    monkeypatch.setattr(cpu_native, "FLAGS", (*cpu_native.FLAGS, "-DSLUICE_TEST_FLAG"))
    assert cpu_native.library_path() != path  # other flags, another build


def test_no_compiler_leaves_pytorch_ops_and_says_so(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_native, "COMPILER", "sluice-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native._load() is None
    assert "no sluice-no-such-compiler on PATH" in caplog.text


def test_failed_build_leaves_pytorch_ops(monkeypatch, tmp_path, caplog) -> None:
    bad_source = tmp_path / "broken.cpp"
    bad_source.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_native, "SOURCE", bad_source)
    monkeypatch.setattr(cpu_native, "cache_dir", lambda: str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native._load() is None
    assert "failed" in caplog.text and not list((tmp_path / "kernels").glob("*.so"))


def _float32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden.float() @ weight.float().T


@pytest.mark.parametrize("dim", [16, 17, 64, 200])  # even, odd (padded pair), wider
@pytest.mark.parametrize("rows", [1, 5, 8, 19])  # inside one block of 8, whole blocks, a tail
@pytest.mark.parametrize("vocab", [37, 4099])  # a partial last tile of 16
@pytest.mark.parametrize("threads", [1, 2])
def test_lm_head_and_greedy_head_match_float32_logits(kernels, dim, rows, vocab, threads) -> None:
    if not kernels.has_greedy_head:
        pytest.skip("this CPU build has no AVX-512 BF16: the engine keeps the unfused head")
    generator = torch.Generator().manual_seed(dim * 1000 + rows * 10 + vocab)
    weight = torch.randn(vocab, dim, generator=generator).to(torch.bfloat16)
    hidden = torch.randn(rows + 3, dim, generator=generator).to(torch.bfloat16)[3:]  # strided
    packed = kernels.pack_greedy_head(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        greedy = kernels.greedy_head(hidden, packed, vocab)
        logits = kernels.lm_head(hidden, packed, vocab)
    finally:
        torch.set_num_threads(previous)
    expected = _float32_logits(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (rows, vocab)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    assert greedy.dtype == torch.int64
    assert torch.equal(greedy, logits.argmax(-1))  # the same products in the same order
    assert torch.equal(greedy, expected.argmax(-1))


def test_greedy_head_ties_go_to_the_lowest_id_across_lanes_tiles_and_threads(kernels) -> None:
    if not kernels.has_greedy_head:
        pytest.skip("this CPU build has no AVX-512 BF16: the engine keeps the unfused head")
    vocab, dim = 200_003, 16  # wide enough for the two threads to split the tiles
    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(vocab, dim, generator=generator) * 0.01).to(torch.bfloat16)
    target = torch.ones(dim, dtype=torch.bfloat16)
    for token in (vocab - 2, 150_001, 77, 78):  # ties in another thread, tile and lane
        weight[token] = target
    hidden = torch.stack([target, torch.zeros(dim, dtype=torch.bfloat16)])
    packed = kernels.pack_greedy_head(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = kernels.greedy_head(hidden, packed, vocab).tolist()
    finally:
        torch.set_num_threads(previous)
    assert got == [77, 0]  # the lowest of the tied ids; all-zero logits: token 0
    assert got == _float32_logits(hidden, weight).argmax(-1).tolist()
