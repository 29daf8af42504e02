"""KV cache sizing from a byte budget, layout, and errors for impossible budgets."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.common.protocol.dummy_shapes import dummy_config
from services.engine.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCache,
    bytes_per_block,
    kv_cache_budget,
)
from services.engine.models.config import ModelConfig

CONFIG = ModelConfig.from_dict(dummy_config("tiny"), name="tiny")  # 2 layers, 2 kv heads, dim 16


def test_bytes_per_block_counts_keys_values_layers() -> None:
    assert bytes_per_block(CONFIG, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    assert bytes_per_block(CONFIG, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2
    assert bytes_per_block(CONFIG, 16, torch.float8_e4m3fn) == 2 * 2 * 16 * 2 * 16  # fp8


def test_a_float8_cache_holds_twice_the_blocks_of_a_bf16_one_in_the_same_bytes() -> None:
    budget = bytes_per_block(CONFIG, 16, torch.bfloat16) * 7
    caches = [
        KVCache.allocate(
            CONFIG, block_size=16, dtype=dtype, device=torch.device("cpu"), kv_cache_bytes=budget
        )
        for dtype in (torch.bfloat16, torch.float8_e4m3fn)
    ]
    assert [cache.num_blocks for cache in caches] == [7, 14]
    assert caches[1].layers[0][0].dtype == torch.float8_e4m3fn


def test_allocation_fills_the_budget_with_whole_blocks() -> None:
    per_block = bytes_per_block(CONFIG, 8, torch.float32)
    cache = KVCache.allocate(
        CONFIG,
        block_size=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        kv_cache_bytes=per_block * 10 + per_block // 2,
    )
    assert cache.num_blocks == 10
    assert len(cache.layers) == CONFIG.num_layers
    for key, value in cache.layers:
        assert key.shape == (10, 8, CONFIG.num_kv_heads, CONFIG.head_dim)
        assert value.shape == key.shape
        assert key.dtype == torch.float32
        assert not key.any() and not value.any()  # zeroed: padded reads never see NaN
    assert cache.layers[0][0].data_ptr() != cache.layers[1][0].data_ptr()
    # Every layer's keys and values are views of one tensor (a swap moves all layers at once).
    layout = (CONFIG.num_layers, 2, 10, 8, CONFIG.num_kv_heads, CONFIG.head_dim)
    assert cache.stacked.shape == layout
    for layer, (key, value) in enumerate(cache.layers):
        assert key.is_contiguous() and value.is_contiguous()
        assert key.data_ptr() == cache.stacked[layer, 0].data_ptr()
        assert value.data_ptr() == cache.stacked[layer, 1].data_ptr()


def test_cpu_default_budget() -> None:
    budget = kv_cache_budget(torch.device("cpu"), None, 0.85)
    assert budget == DEFAULT_CPU_KV_CACHE_BYTES


def test_budget_too_small_for_one_block() -> None:
    with pytest.raises(ResourceExhaustedError, match="holds no block"):
        KVCache.allocate(
            CONFIG,
            block_size=16,
            dtype=torch.float32,
            device=torch.device("cpu"),
            kv_cache_bytes=100,
        )


@pytest.mark.parametrize("block_size, budget", [(0, 1 << 20), (16, 0), (16, -5)])
def test_bad_settings_are_invalid(block_size: int, budget: int) -> None:
    with pytest.raises(InvalidArgumentError):
        KVCache.allocate(
            CONFIG,
            block_size=block_size,
            dtype=torch.float32,
            device=torch.device("cpu"),
            kv_cache_bytes=budget,
        )
