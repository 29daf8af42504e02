"""What an adapter's `adapter_config.json` says, checked against what the engine can serve.

The engine serves plain LoRA on the seven linear projections of a Llama-family decoder layer:
`y = W x + scale · B (A x)` with `scale = alpha / r` (or `alpha / sqrt(r)` with rsLoRA), per
module ranks and alphas from `rank_pattern` / `alpha_pattern` matched as PEFT matches them.
Everything else PEFT can save changes the model in ways those kernels do not compute, so it is
refused with the reason (INVALID_ARGUMENT): DoRA, trained biases, extra trainable modules
(`modules_to_save`: an embedding or LM head), trainable token rows, targets other than the seven
projections, and variants (QALoRA, BD-LoRA, parameter targets, layer replication).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import InvalidArgumentError
from services.engine.lora.projections import SUPPORTED_MODULES

# Options whose presence (truthy) means a model change these kernels do not compute.
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora) adapters are not supported",
    "modules_to_save": "adapters that train whole modules (modules_to_save, e.g. an embedding "
    "or LM head) are not supported",
    "trainable_token_indices": "adapters that train embedding rows (trainable_token_indices) "
    "are not supported",
    "lora_bias": "adapters with a LoRA bias (lora_bias) are not supported",
    "use_qalora": "QALoRA adapters are not supported",
    "use_bdlora": "BD-LoRA adapters are not supported",
    "target_parameters": "adapters on parameters (target_parameters) are not supported",
    "layer_replication": "adapters that replicate layers (layer_replication) are not supported",
    "megatron_config": "Megatron-parallel adapters are not supported",
    "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D-style weights) are not supported",
}
# "all-linear" in PEFT: every linear layer except the output head.
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of a PEFT LoRA config that decide the computation."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]
    rank_pattern: dict[str, int] = field(default_factory=dict, hash=False, compare=False)
    alpha_pattern: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    base_model: str | None = None

    def module_rank_alpha(self, module_path: str) -> tuple[int, float]:
        """Rank and alpha of one module (e.g. `model.layers.3.self_attn.q_proj`), as PEFT finds
        them: the first rank_pattern then alpha_pattern key matching the end of the path
        decides both."""
        for key in [*self.rank_pattern, *self.alpha_pattern]:
            if re.match(rf"(.*\.)?({key})$", module_path):
                return self.rank_pattern.get(key, self.rank), self.alpha_pattern.get(
                    key, self.alpha
                )
        return self.rank, self.alpha

    def scale(self, rank: int, alpha: float) -> float:
        """The factor on B·A: alpha / r, or alpha / sqrt(r) for rsLoRA."""
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def parse_adapter_config(text: str | bytes, *, max_rank: int) -> AdapterConfig:
    """Parse and check `adapter_config.json`; InvalidArgumentError says what is refused."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgumentError("adapter_config.json must hold a JSON object")
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidArgumentError(f"only LoRA adapters are served, not peft_type {peft_type!r}")
    for option, reason in _REFUSED_OPTIONS.items():
        if data.get(option):
            raise InvalidArgumentError(reason)
    bias = data.get("bias", "none")
    if bias != "none":
        raise InvalidArgumentError(f"adapters that train biases (bias={bias!r}) are not supported")
    rank = _rank(data.get("r", 8), "r", max_rank)
    alpha = _number(data.get("lora_alpha", 8), "lora_alpha")
    use_rslora = data.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise InvalidArgumentError("use_rslora must be a boolean")
    rank_pattern = _pattern(data.get("rank_pattern"), "rank_pattern")
    alpha_pattern = _pattern(data.get("alpha_pattern"), "alpha_pattern")
    ranks = {key: _rank(value, f"rank_pattern[{key!r}]", max_rank) for key, value in rank_pattern}
    alphas = {key: _number(value, f"alpha_pattern[{key!r}]") for key, value in alpha_pattern}
    base_model = data.get("base_model_name_or_path")
    return AdapterConfig(
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        target_modules=_targets(data.get("target_modules")),
        rank_pattern=ranks,
        alpha_pattern=alphas,
        base_model=str(base_model) if base_model else None,
    )


def _targets(value: Any) -> frozenset[str]:
    if value is None:
        raise InvalidArgumentError("adapter_config.json names no target_modules")
    if isinstance(value, str):
        if value == ALL_LINEAR:
            return SUPPORTED_MODULES
        # A regular expression over module paths: which modules it took is read from the
        # tensors themselves (an unsupported one is refused there).
        try:
            re.compile(value)
        except re.error as exc:
            raise InvalidArgumentError(f"target_modules is not a valid pattern: {exc}") from exc
        return SUPPORTED_MODULES
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidArgumentError("target_modules must be a list of module names or a pattern")
    modules = frozenset(item.rsplit(".", 1)[-1] for item in value)
    unsupported = sorted(modules - SUPPORTED_MODULES)
    if unsupported:
        raise InvalidArgumentError(
            f"adapter targets {unsupported}; only {sorted(SUPPORTED_MODULES)} are supported"
        )
    return modules


def _rank(value: Any, name: str, max_rank: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"adapter {name} must be a positive integer, got {value!r}")
    if value > max_rank:
        raise InvalidArgumentError(
            f"adapter {name} = {value} is over this engine's maximum LoRA rank {max_rank}"
        )
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"adapter {name} must be a finite number, got {value!r}")
    return float(value)


def _pattern(value: Any, name: str) -> list[tuple[str, Any]]:
    if not value:
        return []
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{name} must be an object")
    for key in value:
        try:
            re.compile(key)
        except re.error as exc:
            raise InvalidArgumentError(f"{name} key {key!r} is not a valid pattern: {exc}") from exc
    return list(value.items())
