"""The paged KV cache tensors: per layer a key and a value tensor of fixed-size blocks.

Layout (shared by every backend): [num_blocks, block_size, num_kv_heads, head_dim] per layer,
each a view of one tensor of every layer's keys and values ([layers, 2, num_blocks, ...]:
`stacked`), so moving a sequence's blocks to or from host memory is one gather or scatter over
all layers (services/engine/kv_swap.py). The number
of blocks comes from a memory budget, sized after the weights are loaded: on CPU a byte budget
(default DEFAULT_CPU_KV_CACHE_BYTES, 512 MiB: ~11,600 tokens of SmolLM2-135M in float32,
~23,300 in bfloat16); on CUDA a fraction of the device memory (gpu_memory_utilization) minus
what is already in use, unless an explicit byte budget is given. Blocks are zeroed so a padded
gather never reads NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.engine.models.config import ModelConfig

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, keys and values."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def kv_cache_budget(
    device: torch.device, kv_cache_bytes: int | None, gpu_memory_utilization: float
) -> int:
    """The bytes to spend on KV blocks on `device`."""
    if kv_cache_bytes is not None:
        if kv_cache_bytes <= 0:
            raise InvalidArgumentError(f"kv_cache_bytes must be positive, got {kv_cache_bytes}")
        return int(kv_cache_bytes)
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise InvalidArgumentError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    # Leave headroom for activations and logits of a step (they come from the same pool).
    return int(total * gpu_memory_utilization - used)


@dataclass
class KVCache:
    """The allocated cache: one (key, value) pair per layer and its geometry."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    block_size: int
    # Every layer's keys and values in one tensor, [layers, 2, num_blocks, ...], of which
    # `layers` are views; None where the layers were made apart.
    stacked: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        *,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = 0.85,
    ) -> KVCache:
        if block_size <= 0:
            raise InvalidArgumentError(f"block_size must be positive, got {block_size}")
        budget = kv_cache_budget(device, kv_cache_bytes, gpu_memory_utilization)
        per_block = bytes_per_block(config, block_size, dtype)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ResourceExhaustedError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes "
                f"(block_size {block_size}); raise kv_cache_bytes or gpu_memory_utilization"
            )
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        stacked = torch.zeros((config.num_layers, 2, *shape), dtype=dtype, device=device)
        layers = [(stacked[layer, 0], stacked[layer, 1]) for layer in range(config.num_layers)]
        return cls(
            layers=layers, num_blocks=int(num_blocks), block_size=block_size, stacked=stacked
        )
