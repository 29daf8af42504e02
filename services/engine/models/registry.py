"""Model implementations keyed by the Hugging Face architecture name in config.json."""

from __future__ import annotations

from torch import nn

from services.common.errors import FailedPreconditionError
from services.engine.models.config import ModelConfig
from services.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The implementation for config.architecture, or a clear error naming the supported ones."""
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise FailedPreconditionError(
            f"architecture {config.architecture!r} is not supported (supported: {supported})"
        ) from None
