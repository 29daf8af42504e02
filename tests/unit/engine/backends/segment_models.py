"""Small random Llama-family models of each family, for the segment export tests."""

from __future__ import annotations

import torch

from services.common.model_files import ModelFiles
from services.engine.loader.weights import build_model
from services.engine.models.config import ModelConfig

FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),  # q/k/v bias
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),  # per-head q/k norm
}


def family_config(family: str, *, tie: bool = False) -> ModelConfig:
    architecture, model_type = FAMILIES[family]
    shape = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 300,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie,
        "eos_token_id": 2,
    }
    return ModelConfig.from_dict(shape, name=f"test-{family}")


def family_model(
    family: str, dtype: torch.dtype = torch.float32, *, tie: bool = False
) -> tuple[ModelConfig, torch.nn.Module, ModelFiles]:
    """A random model of `family` with every parameter (norms and biases too) non-trivial."""
    config = family_config(family, tie=tie)
    model = build_model(config, weights_dir=None, device=torch.device("cpu"), dtype=dtype, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_((base + noise).to(dtype))
    files = ModelFiles(name=config.name, weights_dir=None, tokenizer_dir=None, dummy_shape=family)
    return config, model, files
