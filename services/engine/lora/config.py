"""The engine's LoRA settings: one frozen, validated dataclass.

The same four fields (same names, types, defaults and help) are meant to sit in EngineConfig,
so that `--max-loras`, `--max-cpu-loras`, `--max-lora-rank` and `--adapter-root` are flags and
`SLUICE_*` variables like every other engine setting; `LoRAConfig.from_engine_config` takes
them from there. Adapters are off until `adapter_root` is set: without it no slot memory is
allocated and any adapter name is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.config import field
from services.common.errors import InvalidArgumentError


@dataclass(frozen=True)
class LoRAConfig:
    """Device slots, host cache, rank limit and the only directory adapters may come from."""

    max_loras: int = field(
        4, help="LoRA adapters resident on the device at once (slots; one batch mixes them)"
    )
    max_cpu_loras: int = field(
        16, help="LoRA adapters kept loaded in host memory (LRU; at least max_loras)"
    )
    max_lora_rank: int = field(
        64, help="largest LoRA rank served; slot memory is sized for it (max_loras x rank)"
    )
    adapter_root: str | None = field(
        None,
        help="directory that every registered adapter path must resolve under (unset: no adapters)",
    )

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_cpu_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise InvalidArgumentError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
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
        return cls(**values)
