"""The engine's LoRA settings: one frozen, validated dataclass.

The same fields sit in EngineConfig (flags `--max-loras`, `--max-cpu-loras`, `--max-lora-rank`,
`--adapter-root`, `--lora-slot-quantum-ms`, `--lora-load-workers`, `--lora-deterministic`,
`--lora-fused-decode`, `--lora-fused-swiglu` and their `SLUICE_*` variables, with the help text
there);
`LoRAConfig.from_engine_config` takes them from it and validates them. Adapters are off until
`adapter_root` is set: without it no slot memory is allocated and every adapter name is unknown.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgumentError

DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_CPU_LORAS = 16
DEFAULT_MAX_LORA_RANK = 64
DEFAULT_SLOT_QUANTUM_MS = 100.0
# Loads are CPU work (checksum, checks, layout): more threads than cores only contend.
DEFAULT_LOAD_WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class LoRAConfig:
    """Device slots, host cache, rank limit and the only directory adapters may come from."""

    max_loras: int = DEFAULT_MAX_LORAS
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    adapter_root: str | None = None
    slot_quantum_ms: float = DEFAULT_SLOT_QUANTUM_MS  # 0: no time-slicing of device slots
    # time-slicing: a request yet to give its first token may join its adapter's draining slot
    first_token_joins: bool = True
    # threads reading, verifying and laying out adapters from disk at once (off the step loop)
    load_workers: int = DEFAULT_LOAD_WORKERS
    # GPU kernels: K splits summed in a fixed order (False: float atomics, order of finishing)
    deterministic: bool = True
    # CUDA fast path: decode steps of one adapter fold its LoRA into the base kernels (the
    # projection weights get room for it at load: lora/fused.py)
    fused_decode: bool = True
    # CUDA fast path: SwiGLU adds the gate_up deltas of steps of several adapters as it reads
    # them (lora/runtime.py: tile_consumer)
    fused_swiglu: bool = True
    # CUDA fast path: decode graphs of several adapters run the LoRA kernels on a side stream
    # beside each base matmul, the next kernel adding the written deltas (lora/runtime.py)
    side_deltas: bool = True

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_cpu_loras", "max_lora_rank", "load_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise InvalidArgumentError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        quantum = self.slot_quantum_ms
        if isinstance(quantum, bool) or not isinstance(quantum, int | float) or quantum < 0:
            raise InvalidArgumentError(f"slot_quantum_ms must be >= 0, got {quantum!r}")
        for name in (
            "deterministic",
            "fused_decode",
            "fused_swiglu",
            "side_deltas",
            "first_token_joins",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.adapter_root is not None and (
            not isinstance(self.adapter_root, str) or not self.adapter_root.strip()
        ):
            raise InvalidArgumentError("adapter_root must be a non-empty path or unset")

    @property
    def enabled(self) -> bool:
        return self.adapter_root is not None

    @classmethod
    def from_engine_config(cls, config: Any) -> LoRAConfig:
        """The LoRA fields of an EngineConfig (defaults for those it does not have)."""
        values = {
            name: getattr(config, name)
            for name in ("max_loras", "max_cpu_loras", "max_lora_rank", "adapter_root")
            if hasattr(config, name)
        }
        if hasattr(config, "lora_slot_quantum_ms"):
            values["slot_quantum_ms"] = config.lora_slot_quantum_ms
        if hasattr(config, "lora_first_token_joins"):
            values["first_token_joins"] = config.lora_first_token_joins
        if hasattr(config, "lora_load_workers"):
            values["load_workers"] = config.lora_load_workers
        if hasattr(config, "lora_deterministic"):
            values["deterministic"] = config.lora_deterministic
        if hasattr(config, "lora_fused_decode"):
            values["fused_decode"] = config.lora_fused_decode
        if hasattr(config, "lora_fused_swiglu"):
            values["fused_swiglu"] = config.lora_fused_swiglu
        if hasattr(config, "lora_side_deltas"):
            values["side_deltas"] = config.lora_side_deltas
        return cls(**values)
