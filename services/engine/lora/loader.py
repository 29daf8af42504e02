"""Reads a PEFT adapter (config + safetensors) into AdapterWeights, refusing what can't be served.

Every tensor name must be one of `base_model.model.model.layers.N.{self_attn|mlp}.M.lora_{A|B}
.weight` with M one of the seven projections; shapes must match the base model (A [r, in],
B [out, r]), ranks the config (and its rank_pattern), values must be finite. Embedding or LM-head
tensors, DoRA magnitudes and anything else are refused (INVALID_ARGUMENT) with the reason. The
safetensors bytes are parsed from memory: the checksum covers exactly what is loaded. Runs on the
adapter manager's loader threads, never on the step loop. `inspect_adapter` does the same checks
once at registration (a bad adapter is refused then, never at a request's first token) and
returns the AdapterRecord with the files' SHA-256.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from services.common.errors import InvalidArgumentError
from services.common.protocol.adapter_record import AdapterRecord, validate_adapter_name
from services.engine.lora.paths import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    checksum_of,
    read_adapter_files,
    resolve_adapter_dir,
    verify_checksum,
)
from services.engine.lora.peft_config import AdapterConfig, parse_adapter_config
from services.engine.lora.projections import (
    MODULE_PARENT,
    MODULE_TO_SLICE,
    module_shape,
    projection_shapes,
)
from services.engine.lora.weights import AdapterWeights, ProjectionWeights
from services.engine.models.config import ModelConfig

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_REFUSED_NAMES = (
    ("lora_magnitude_vector", "DoRA magnitude vectors (use_dora) are not supported"),
    ("lora_embedding", "adapters on the token embedding are not supported"),
    ("embed_tokens", "adapters on the token embedding are not supported"),
    ("lm_head", "adapters on the LM head are not supported"),
    ("bias", "adapter bias tensors are not supported"),
)


def inspect_adapter(
    name: str,
    path: str,
    *,
    adapter_root: str | Path | None,
    model_config: ModelConfig,
    max_rank: int,
) -> AdapterRecord:
    """Check an adapter completely and return its record (raises a SluiceError with the reason)."""
    validate_adapter_name(name)
    directory = resolve_adapter_dir(path, adapter_root)
    contents = read_adapter_files(directory)
    checksum = checksum_of(contents)
    weights = parse_adapter(
        name,
        contents,
        checksum,
        model_config=model_config,
        max_rank=max_rank,
        dtype=torch.float32,
    )
    return AdapterRecord(
        name=name,
        # Relative to the root, as the registry and every engine's root expect it.
        path=directory.relative_to(Path(adapter_root).resolve()).as_posix() or ".",
        sha256=checksum,
        rank=weights.rank,
        target_modules=tuple(sorted(weights.modules)),
    )


def load_registered_adapter(
    name: str,
    path: str,
    checksum: str,
    *,
    adapter_root: str | Path | None,
    model_config: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
) -> AdapterWeights:
    """Resolve `path` under the root again, read, verify the checksum, parse and validate."""
    directory = resolve_adapter_dir(path, adapter_root)
    contents = read_adapter_files(directory)
    verify_checksum(contents, checksum, name)
    return parse_adapter(
        name, contents, checksum, model_config=model_config, max_rank=max_rank, dtype=dtype
    )


def parse_adapter(
    name: str,
    contents: dict[str, bytes],
    checksum: str,
    *,
    model_config: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
) -> AdapterWeights:
    """AdapterWeights from the bytes of both files; InvalidArgumentError names what is wrong."""
    config = parse_adapter_config(contents[CONFIG_FILE], max_rank=max_rank)
    try:
        tensors = load_safetensors(contents[WEIGHTS_FILE])
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(
            f"adapter {name!r}: {WEIGHTS_FILE} is not a valid safetensors file ({exc})"
        ) from exc
    if not tensors:
        raise InvalidArgumentError(f"adapter {name!r}: {WEIGHTS_FILE} holds no tensors")
    pairs = _module_pairs(name, tensors, config, model_config)
    rank = max(a.shape[0] for a, _ in pairs.values())
    shapes = projection_shapes(model_config)
    layers: list[dict[str, ProjectionWeights]] = [{} for _ in range(model_config.num_layers)]
    for (layer, module), (a, b) in sorted(pairs.items()):
        projection, index = MODULE_TO_SLICE[module]
        shape = shapes[projection]
        entry = layers[layer].get(projection)
        if entry is None:
            entry = ProjectionWeights(
                a=torch.zeros(shape.num_slices, rank, shape.in_features, dtype=dtype),
                b=torch.zeros(shape.out_features, rank, dtype=dtype),
            )
            layers[layer][projection] = entry
        module_rank = a.shape[0]
        _, alpha = config.module_rank_alpha(_module_path(layer, module))
        scale = config.scale(module_rank, alpha)
        start = shape.slice_offsets[index]
        entry.a[index, :module_rank] = a.to(dtype)
        entry.b[start : start + b.shape[0], :module_rank] = (b.float() * scale).to(dtype)
    return AdapterWeights(
        name=name,
        checksum=checksum,
        rank=rank,
        modules=frozenset(module for _, module in pairs),
        layers=tuple(layers),
    )


def _module_path(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"


def _module_pairs(
    name: str,
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig,
    model_config: ModelConfig,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) → (A, B), every name, shape, rank and value checked."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        layer, module, factor = _parse_name(name, tensor_name, config, model_config)
        if not tensor.is_floating_point():
            raise InvalidArgumentError(f"adapter {name!r}: {tensor_name} is not floating point")
        found.setdefault((layer, module), {})[factor] = tensor
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), factors in found.items():
        where = f"adapter {name!r}, layer {layer} {module}"
        if set(factors) != {"A", "B"}:
            missing = "lora_B" if "A" in factors else "lora_A"
            raise InvalidArgumentError(f"{where}: {missing} is missing")
        a, b = factors["A"], factors["B"]
        in_features, out_features = module_shape(model_config, module)
        rank, _ = config.module_rank_alpha(_module_path(layer, module))
        if a.dim() != 2 or b.dim() != 2:
            raise InvalidArgumentError(f"{where}: lora_A and lora_B must be matrices")
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise InvalidArgumentError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"model (expected ({rank}, {in_features}) / ({out_features}, {rank}) for rank "
                f"{rank})"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise InvalidArgumentError(f"{where}: weights hold NaN or infinity")
        pairs[(layer, module)] = (a, b)
    return pairs


def _parse_name(
    name: str, tensor_name: str, config: AdapterConfig, model_config: ModelConfig
) -> tuple[int, str, str]:
    match = _TENSOR_NAME.match(tensor_name)
    if match is None:
        for fragment, reason in _REFUSED_NAMES:
            if fragment in tensor_name:
                raise InvalidArgumentError(f"adapter {name!r}: {reason} ({tensor_name})")
        raise InvalidArgumentError(f"adapter {name!r}: unexpected tensor {tensor_name!r}")
    layer, parent, module, factor = int(match[1]), match[2], match[3], match[4]
    if module not in MODULE_TO_SLICE:
        raise InvalidArgumentError(
            f"adapter {name!r} targets {module!r}; only {sorted(MODULE_TO_SLICE)} are supported"
        )
    if MODULE_PARENT[module] != parent:
        raise InvalidArgumentError(f"adapter {name!r}: unexpected tensor {tensor_name!r}")
    if module not in config.target_modules:
        raise InvalidArgumentError(
            f"adapter {name!r}: tensor {tensor_name!r} is for a module not in target_modules"
        )
    if layer >= model_config.num_layers:
        raise InvalidArgumentError(
            f"adapter {name!r} has weights for layer {layer}; the base model has "
            f"{model_config.num_layers} layers"
        )
    return layer, module, factor
