"""LoRA test helpers shared by the engine and router tests: random PEFT adapters saved by peft
itself (with their transformers + peft greedy references), hand-made adapter files, a tiny Llama
config.

`write_peft_adapters` adapts one base model in place adapter after adapter (peft's `unload`
restores it), so even the default model needs no copy per adapter.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from services.engine.lora.weights import AdapterWeights, ProjectionWeights
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


# Adapters of different ranks, target modules and scalings (rsLoRA, rank/alpha patterns).
MIXED_ADAPTERS: dict[str, dict[str, Any]] = {
    "attn-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "mlp-r8-rs": {
        "r": 8,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj"],
    },
    "all-r2": {"r": 2, "lora_alpha": 3, "target_modules": ALL_MODULES},
    "ko-r6": {
        "r": 6,
        "lora_alpha": 6,
        "target_modules": ["k_proj", "o_proj"],
        "rank_pattern": {"o_proj": 3},
    },
}


def write_peft_adapters(
    base: torch.nn.Module,
    root: Path,
    adapters: dict[str, dict[str, Any]],
    prompts: list[list[int]],
    max_tokens: int,
    *,
    scale: float = 0.2,
) -> dict[str | None, list[list[int]]]:
    """Save each adapter (random, non-zero A and B) under root/<name> with peft; return the
    greedy tokens of transformers + peft with that adapter alone for every prompt (key None:
    the base model). `base` is adapted in place and restored after each adapter."""
    from peft import LoraConfig, get_peft_model

    references = {None: greedy_tokens(base, prompts, max_tokens)}
    for index, (name, options) in enumerate(adapters.items()):
        model = get_peft_model(base, LoraConfig(**options))
        generator = torch.Generator().manual_seed(1000 + index)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_A" in param_name or "lora_B" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(root / name)
        model.eval()
        references[name] = greedy_tokens(model, prompts, max_tokens)
        base = model.unload()
    return references


def greedy_tokens(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list:
    """Each prompt alone, `max_tokens` argmax steps of the full forward (EOS does not stop it)."""
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.float().argmax()))
            results.append(ids[len(prompt) :])
    return results


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


def random_weights(
    slots: Any, name: str, rank: int, projections: Any, seed: int, *, scaled: bool = False
) -> AdapterWeights:
    """Random factors of `rank` for `projections` of every layer of `slots` (LoRASlots), as a
    loaded adapter holds them (the checksum a placeholder). scaled: A / sqrt(in features) and
    B / sqrt(rank), in the slots' dtype (outputs of order one in bf16 kernels)."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(slots.num_layers):
        layer = {}
        for projection in projections:
            shape = slots.shapes[projection]
            a = torch.randn(shape.num_slices, rank, shape.in_features, generator=generator)
            b = torch.randn(shape.out_features, rank, generator=generator)
            if scaled:
                a = (a / shape.in_features**0.5).to(slots.dtype)
                b = (b / rank**0.5).to(slots.dtype)
            layer[projection] = ProjectionWeights(a, b)
        layers.append(layer)
    return AdapterWeights(name, "0" * 64, rank, frozenset(), tuple(layers))
