"""Build a model and fill its weights: from an HF safetensors directory or at random (dummy).

The model is built on the meta device (no memory, no wasted random init), materialized on the
target device in the target dtype, then filled. Checkpoints may be sharded (an index json or
several *.safetensors files); tensors are read one at a time so peak memory stays near the
model's size. GGUF files never reach this module: `resolve_model` converts them once into an
HF directory in the cache. Dummy weights are normal(0, 0.02) with unit norms, seeded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from services.common.errors import FailedPreconditionError
from services.engine.models.config import ModelConfig
from services.engine.models.registry import model_class

logger = logging.getLogger(__name__)

DUMMY_STD = 0.02


def build_model(
    config: ModelConfig,
    *,
    weights_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
) -> nn.Module:
    """The model of `config` on `device` in `dtype`, with checkpoint or dummy weights."""
    cls = model_class(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.model.rotary.reset_cache(device)  # type: ignore[union-attr, operator]
    if weights_dir is None:
        _fill_dummy(model, seed)
    else:
        loaded = model.load_weights(iterate_safetensors(weights_dir))  # type: ignore[operator]
        missing = model.expected_weight_names() - loaded  # type: ignore[operator]
        if missing:
            sample = ", ".join(sorted(missing)[:5])
            raise FailedPreconditionError(
                f"{weights_dir}: {len(missing)} weights missing from the checkpoint ({sample})"
            )
    # Inference only: no operation on a weight records autograd history (which would keep a
    # replaced weight alive, as a copy of it would).
    return model.eval().requires_grad_(False)


def iterate_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every safetensors shard in `directory`."""
    from safetensors import safe_open

    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name)


def safetensors_files(directory: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FailedPreconditionError(f"{directory} holds no *.safetensors weights")
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise FailedPreconditionError(f"{directory}: shards listed but missing: {missing[:3]}")
    return files


def _fill_dummy(model: nn.Module, seed: int) -> None:
    generator_device = next(model.parameters()).device
    generator = torch.Generator(device=generator_device)
    generator.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)
