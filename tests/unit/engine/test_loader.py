"""Config parsing (transformers 4 and 5 layouts) and weight loading from HF directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.common.errors import FailedPreconditionError
from services.common.protocol.dummy_shapes import DUMMY_SHAPES, dummy_config
from services.engine.loader.weights import build_model, safetensors_files
from services.engine.models.config import ModelConfig
from tests.unit.engine.models.helpers import hf_config, save_random_model

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _base(**extra: object) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        "eos_token_id": 2,
    }
    config.update(extra)
    return config


def test_transformers4_layout() -> None:
    config = ModelConfig.from_dict(
        _base(rope_theta=500000.0, rope_scaling=LLAMA3, num_key_value_heads=2), name="m"
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling["factor"] == 32.0
    assert config.num_kv_heads == 2 and config.head_dim == 16
    assert config.max_model_len == 4096 and config.eos_token_ids == (2,)


def test_transformers5_layout_and_defaults() -> None:
    rope = {"rope_type": "default", "rope_theta": 1234.0}
    config = ModelConfig.from_dict(_base(rope_parameters=rope), name="m", max_model_len=100)
    assert config.rope_theta == 1234.0 and config.rope_scaling is None
    assert config.num_kv_heads == 4  # MHA when num_key_value_heads is absent
    assert config.max_model_len == 100 and config.max_position_embeddings == 4096


def test_family_flags() -> None:
    qwen2 = ModelConfig.from_dict(_base(model_type="qwen2"), name="q2")
    qwen3 = ModelConfig.from_dict(_base(model_type="qwen3", head_dim=32), name="q3")
    assert qwen2.qkv_bias and not qwen2.output_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_base(eos_token_id=[2, 7])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_directory(tmp_path, name="m").eos_token_ids == (2, 7, 9)


def test_mistral_sliding_window_caps_context() -> None:
    config = ModelConfig.from_dict(
        _base(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=512),
        name="m",
    )
    assert config.max_model_len == 512


def test_unsupported_architecture_is_refused() -> None:
    config = ModelConfig.from_dict(_base(architectures=["GPT2LMHeadModel"]), name="m")
    with pytest.raises(FailedPreconditionError, match="not supported"):
        build_model(config, weights_dir=None, device=torch.device("cpu"), dtype=torch.float32)


def test_every_dummy_shape_parses() -> None:
    for shape in DUMMY_SHAPES:
        config = ModelConfig.from_dict(dummy_config(shape), name=shape)
        assert config.vocab_size >= 49152
        assert config.num_heads % config.num_kv_heads == 0


def _saved(tmp_path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    reference = save_random_model(hf_config("qwen2"), tmp_path)
    return ModelConfig.from_directory(tmp_path, name="q"), reference


def test_sharded_checkpoint_loads_every_fused_shard(tmp_path: Path) -> None:
    config, reference = _saved(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(tmp_path)) > 1
    model = build_model(
        config, weights_dir=tmp_path, device=torch.device("cpu"), dtype=torch.float32
    )
    ours = dict(model.named_parameters())
    theirs = dict(reference.named_parameters())
    attention = "model.layers.1.self_attn"
    fused = ours[f"{attention}.qkv_proj.bias"]
    expected = torch.cat([theirs[f"{attention}.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(fused, expected)
    gate_up = ours["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(
        gate_up[: config.intermediate_size], theirs["model.layers.0.mlp.gate_proj.weight"]
    )


def test_missing_tensor_is_reported(tmp_path: Path) -> None:
    config, reference = _saved(tmp_path)
    for path in tmp_path.glob("*.safetensors*"):
        path.unlink()
    tensors = {
        name: tensor.detach().clone().contiguous()
        for name, tensor in reference.state_dict().items()
        if "layers.1.self_attn.v_proj" not in name
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(FailedPreconditionError, match="missing"):
        build_model(config, weights_dir=tmp_path, device=torch.device("cpu"), dtype=torch.float32)


def test_wrong_shape_is_reported(tmp_path: Path) -> None:
    config, reference = _saved(tmp_path)
    for path in tmp_path.glob("*.safetensors*"):
        path.unlink()
    tensors = {k: v.detach().clone().contiguous() for k, v in reference.state_dict().items()}
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(FailedPreconditionError, match="shape"):
        build_model(config, weights_dir=tmp_path, device=torch.device("cpu"), dtype=torch.float32)


def test_directory_without_weights(tmp_path: Path) -> None:
    with pytest.raises(FailedPreconditionError, match="safetensors"):
        safetensors_files(tmp_path)
