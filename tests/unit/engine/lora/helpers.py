"""Test helpers: a tiny Llama config, random adapters saved by peft itself, raw adapter files."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.engine.models.config import ModelConfig
from tests.unit.engine.models.helpers import TINY_COMMON

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model_config(**overrides: Any) -> ModelConfig:
    """The engine's view of tests/unit/engine/models/helpers.TINY_COMMON (a tiny GQA Llama)."""
    settings = {**TINY_COMMON, "architectures": ["LlamaForCausalLM"], **overrides}
    return ModelConfig.from_dict(settings, name="tiny")


def save_peft_adapter(
    base: torch.nn.Module, directory: Path, seed: int, **lora_options: Any
) -> torch.nn.Module:
    """A random LoRA adapter (A and B both non-zero) on a copy of `base`, saved by peft.

    Returns the peft model (eval mode) that computes base + this adapter.
    """
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora_options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(directory)
    return model.eval()


def write_adapter(
    directory: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> Path:
    """Hand-made adapter files (for what peft would refuse to save, or a broken adapter)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def lora_tensors(
    config: ModelConfig, modules: list[str], rank: int, layers: int | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """PEFT-named random A/B tensors for `modules` in every layer of `config`."""
    from services.engine.lora.projections import MODULE_PARENT, module_shape

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers if layers is None else layers):
        for module in modules:
            in_features, out_features = module_shape(config, module)
            prefix = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                out_features, rank, generator=generator
            )
    return tensors


def peft_config(modules: list[str], rank: int, **extra: Any) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "bias": "none",
        **extra,
    }
