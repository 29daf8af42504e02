"""The attention backend interface and its registry.

One backend instance serves every layer of a model. The runner calls `prepare(metadata)` once
per step (host-side planning, index tensors) and each layer calls `forward`, which stores the
new K/V at `metadata.slot_mapping` and returns attention over the whole cached context. A
backend that `fuses_rotary` also takes q/k unrotated (`forward_rotary`) and rotates them in the
same kernel that writes the cache.
Backends register by name; the module that defines one is imported lazily on first use.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.engine.layers.attention_metadata import AttentionMetadata

_REGISTRY: dict[str, type[AttentionBackend]] = {}
# Backends that register themselves when their module is imported (kept lazy: "cuda" imports
# Triton, which CPU machines lack).
_LAZY_MODULES: dict[str, str] = {
    "torch": "services.engine.backends.torch_backend",
    "cuda": "services.engine.backends.cuda_backend",
}


class AttentionBackend(ABC):
    """Paged attention over flat token batches; K/V cache layout per attention_metadata.py."""

    name: str = ""
    # True where forward_rotary serves: q/k come unrotated and one kernel rotates them while
    # writing the cache (the CUDA fast path binds its rotary tables to the "cuda" backend).
    fuses_rotary: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads != 0:
            raise InvalidArgumentError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Plan one step once for all layers (fill metadata.backend_state)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] → output [T, H, D]; caches updated in place."""

    def forward_rotary(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """forward() for query [T, H * D] and key/value [T, KVH * D] not yet rotated."""
        raise FailedPreconditionError(f"attention backend {self.name!r} does not fuse rotary")


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: make a backend available under `name`."""

    def decorate(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name` (importing its module on first use)."""
    if name not in _REGISTRY and name in _LAZY_MODULES:
        try:
            importlib.import_module(_LAZY_MODULES[name])
        except ImportError as exc:
            raise InvalidArgumentError(f"attention backend {name!r} is unavailable: {exc}") from exc
    if name not in _REGISTRY:
        known = ", ".join(available_backends())
        raise InvalidArgumentError(f"unknown attention backend {name!r}; known: {known}")
    return _REGISTRY[name]


def available_backends() -> list[str]:
    return sorted(set(_REGISTRY) | set(_LAZY_MODULES))
