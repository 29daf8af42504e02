"""ModelConfig: the few facts about a checkpoint that the engine needs, parsed from config.json.

Reads both the transformers 4 layout (rope_theta, rope_scaling at top level) and the
transformers 5 one (rope_parameters). Family differences are flags here, not forked model code:
Qwen2 has biases on q/k/v, Qwen3 normalizes q and k per head, Llama 3.x scales rope.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import FailedPreconditionError, InvalidArgumentError

logger = logging.getLogger(__name__)

_QKV_BIAS_TYPES = {"qwen2"}
_QK_NORM_TYPES = {"qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one Llama-family model (frozen; built once at load)."""

    name: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_model_len: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    output_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @classmethod
    def from_dict(
        cls,
        config: dict[str, Any],
        *,
        name: str,
        max_model_len: int | None = None,
        generation_config: dict[str, Any] | None = None,
    ) -> ModelConfig:
        """Parse an HF config dictionary; max_model_len caps the model's own context."""
        architectures = config.get("architectures") or []
        if not architectures:
            raise FailedPreconditionError(f"{name}: config.json names no architecture")
        model_type = str(config.get("model_type", "llama"))
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
        scaling = config.get("rope_scaling") or rope or None
        if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
            scaling = None
        positions = int(config.get("max_position_embeddings") or 2048)
        context = positions
        window = _sliding_window(config, model_type)
        if window is not None and window < context:
            logger.info("%s: context capped to the sliding window (%d tokens)", name, window)
            context = window
        if max_model_len is not None:
            if max_model_len <= 0:
                raise InvalidArgumentError(f"max_model_len must be positive, got {max_model_len}")
            context = min(context, int(max_model_len))
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            name=name,
            architecture=str(architectures[0]),
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_model_len=context,
            max_position_embeddings=positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type in _QKV_BIAS_TYPES,
            output_bias=attention_bias and model_type not in _QKV_BIAS_TYPES,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM_TYPES,
            eos_token_ids=_eos_ids(config, generation_config),
            bos_token_id=config.get("bos_token_id"),
            rope_scaling=dict(scaling) if scaling else None,
        )

    @classmethod
    def from_directory(
        cls, directory: Path, *, name: str, max_model_len: int | None = None
    ) -> ModelConfig:
        """Read config.json (and generation_config.json for extra EOS ids) from an HF directory."""
        config_path = directory / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FailedPreconditionError(f"cannot read {config_path}: {exc}") from exc
        generation_path = directory / "generation_config.json"
        generation = None
        if generation_path.is_file():
            generation = json.loads(generation_path.read_text())
        return cls.from_dict(
            config, name=name, max_model_len=max_model_len, generation_config=generation
        )


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    window = config.get("sliding_window")
    if not window:
        return None
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        return None
    return int(window)


def _eos_ids(config: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (config, generation or {}):
        value = source.get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)
