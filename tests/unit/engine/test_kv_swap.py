"""Swap space: host extents handed out and merged back; KV blocks copied out and in exactly."""

from __future__ import annotations

import pytest
import torch

from services.engine.forward_batch import ScheduledBatch
from services.engine.kv_swap import KVSwapper
from services.engine.scheduler import SchedulerOutput
from services.engine.swap_space import HostBlocks, default_swap_space_gib, host_memory_bytes


def test_extents_are_first_fit_and_merge_when_freed() -> None:
    blocks = HostBlocks(10)
    assert blocks.allocate(4) == 0 and blocks.allocate(3) == 4 and blocks.allocate(3) == 7
    assert blocks.allocate(1) is None and blocks.num_free == 0
    blocks.free(4, 3)
    assert blocks.allocate(4) is None  # 3 free in a row, not 4
    blocks.free(0, 4)  # merges with 4..6
    assert blocks.largest_extent == 7 and blocks.num_free == 7
    assert blocks.allocate(5) == 0
    blocks.free(7, 3)
    blocks.free(0, 5)
    assert blocks.largest_extent == 10 and blocks.num_free == 10


def test_freeing_blocks_that_are_free_is_refused() -> None:
    blocks = HostBlocks(6)
    start = blocks.allocate(2)
    blocks.free(start, 2)
    with pytest.raises(ValueError, match="free already"):
        blocks.free(start, 2)
    with pytest.raises(ValueError, match="at least one"):
        blocks.allocate(0)


def test_default_swap_space_only_on_a_gpu_with_time_sliced_slots() -> None:
    assert default_swap_space_gib(device_type="cpu", time_sliced=True) == 0.0
    assert default_swap_space_gib(device_type="cuda", time_sliced=False) == 0.0
    assert 0.0 < default_swap_space_gib(device_type="cuda", time_sliced=True) <= 16.0


def test_a_container_limit_below_the_host_memory_bounds_it(tmp_path) -> None:
    unlimited = host_memory_bytes(limit_files=())
    assert unlimited and unlimited > 1 << 20
    v2 = tmp_path / "memory.max"
    v2.write_text("max\n")  # cgroup v2 without a limit
    assert host_memory_bytes(limit_files=(str(v2),)) == unlimited
    v2.write_text(f"{1 << 30}\n")
    assert host_memory_bytes(limit_files=(str(v2), "/nonexistent")) == 1 << 30
    assert host_memory_bytes(limit_files=("/nonexistent", str(v2))) == 1 << 30


@pytest.mark.parametrize("stacked", [True, False], ids=["one-tensor", "per-layer"])
def test_blocks_come_back_exactly_into_other_device_blocks(stacked: bool) -> None:
    """The cache's layers as views of one tensor (as KVCache.allocate makes them: a block of
    every layer moves in one gather) or apart: the same bytes come back."""
    shape = (8, 4, 2, 3)  # blocks, block size, heads, head dim
    whole = torch.randn((2, 2, *shape))  # layers, keys and values
    layers = [(whole[layer, 0], whole[layer, 1]) for layer in range(2)]
    if not stacked:
        layers = [(key.clone(), value.clone()) for key, value in layers]
    original = [(key.clone(), value.clone()) for key, value in layers]
    swapper = KVSwapper(layers, num_host_blocks=5, stacked=whole if stacked else None)
    assert swapper.nbytes == 2 * 2 * 5 * 4 * 2 * 3 * 4
    out = SchedulerOutput(batch=ScheduledBatch(), swap_out=[([6, 1, 3], 2)])
    swapper.apply(out)
    for key, value in layers:  # the blocks are free now: the next step writes over them
        key[[6, 1, 3]] = 0.0
        value[[6, 1, 3]] = 0.0
    swapper.apply(SchedulerOutput(batch=ScheduledBatch(), swap_in=[(2, [0, 7, 5])]))
    for (key, value), (key0, value0) in zip(layers, original, strict=True):
        assert torch.equal(key[[0, 7, 5]], key0[[6, 1, 3]])
        assert torch.equal(value[[0, 7, 5]], value0[[6, 1, 3]])
        assert torch.equal(key[[2, 4]], key0[[2, 4]])  # blocks not named are untouched


def test_the_engine_serves_without_swap_space_it_cannot_allocate(monkeypatch, caplog) -> None:
    """Swap space is sized from the KV cache's blocks; where the host memory cannot be had, the
    engine logs why and goes on without it (paused sequences keep their device blocks)."""
    from types import SimpleNamespace

    from services.engine import kv_swap
    from services.engine.config import EngineConfig
    from services.engine.kv_cache import KVCache
    from services.engine.llm_engine import LLMEngine
    from services.engine.lora.config import LoRAConfig

    shape = (10, 4, 2, 8)
    cache = KVCache([(torch.zeros(shape), torch.zeros(shape))], num_blocks=10, block_size=4)
    runner = SimpleNamespace(device=torch.device("cpu"), kv_cache=cache)
    block = 2 * 4 * 2 * 8 * 4  # bytes of one block: keys and values, float32
    config = EngineConfig(adapter_root="/adapters", swap_space_gib=6 * block / 1024**3)
    lora = LoRAConfig.from_engine_config(config)
    swapper = LLMEngine._build_swap(None, config, lora, runner)
    assert swapper is not None and swapper.num_blocks == 6
    off = EngineConfig(adapter_root="/adapters", lora_slot_quantum_ms=0.0, swap_space_gib=1.0)
    assert LLMEngine._build_swap(None, off, LoRAConfig.from_engine_config(off), runner) is None

    def refuse(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(kv_swap, "KVSwapper", refuse)
    with caplog.at_level("WARNING"):
        assert LLMEngine._build_swap(None, config, lora, runner) is None
    assert "no KV swap space" in caplog.text and "out of memory" in caplog.text
