"""PEFT adapters into the fused layout (checked against peft's own delta weights), and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.errors import FailedPreconditionError, InvalidArgumentError
from services.common.protocol.adapter_record import validate_adapter_name
from services.engine.lora.loader import inspect_adapter, load_registered_adapter, parse_adapter
from services.engine.lora.paths import checksum_of, read_adapter_files
from services.engine.lora.projections import MODULE_PARENT, MODULE_TO_SLICE, projection_shapes
from tests.lora_adapters import (
    ALL_MODULES,
    lora_tensors,
    peft_config,
    save_peft_adapter,
    tiny_model_config,
    write_adapter,
)
from tests.unit.engine.models.helpers import hf_config

CONFIG = tiny_model_config()


def _parse(directory: Path, max_rank: int = 64, config=CONFIG):
    contents = read_adapter_files(directory)
    return parse_adapter(
        "test",
        contents,
        checksum_of(contents),
        model_config=config,
        max_rank=max_rank,
        dtype=torch.float32,
    )


@pytest.fixture(scope="module")
def hf_base() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "options",
    [
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        {
            "r": 8,
            "lora_alpha": 4,
            "use_rslora": True,
            "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj"],
            "rank_pattern": {"up_proj": 2},
            "alpha_pattern": {r"layers\.1\.self_attn\.k_proj": 3},
        },
        {"r": 2, "lora_alpha": 2, "target_modules": ALL_MODULES, "layers_to_transform": [1]},
        {"r": 3, "lora_alpha": 5, "target_modules": "all-linear"},
    ],
)
def test_fused_layout_reproduces_peft_delta_weights(
    options: dict, hf_base: torch.nn.Module, tmp_path: Path
) -> None:
    peft_model = save_peft_adapter(hf_base, tmp_path, seed=3, **options)
    weights = _parse(tmp_path)
    shapes = projection_shapes(CONFIG)
    modules = dict(peft_model.named_modules())
    checked = 0
    for layer in range(CONFIG.num_layers):
        for module, (projection, index) in MODULE_TO_SLICE.items():
            name = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            target = modules[name]
            shape = shapes[projection]
            low, high = shape.slice_offsets[index], shape.slice_offsets[index + 1]
            fused = weights.layers[layer].get(projection)
            ours = (
                torch.zeros(high - low, shape.in_features)
                if fused is None
                else fused.b[low:high] @ fused.a[index]
            )
            if hasattr(target, "get_delta_weight") and "default" in target.lora_A:
                expected = target.get_delta_weight("default")
                checked += 1
            else:
                expected = torch.zeros_like(ours)
            torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert checked > 0
    assert weights.rank == max([options["r"], *options.get("rank_pattern", {}).values()])


def test_missing_modules_are_zero_slices(tmp_path: Path) -> None:
    write_adapter(tmp_path, peft_config(["k_proj"], 4), lora_tensors(CONFIG, ["k_proj"], 4))
    weights = _parse(tmp_path)
    qkv = weights.layers[0]["qkv_proj"]
    assert set(weights.layers[0]) == {"qkv_proj"} and weights.modules == {"k_proj"}
    assert qkv.a[0].abs().sum() == 0 and qkv.a[2].abs().sum() == 0 and qkv.a[1].abs().sum() > 0
    offsets = projection_shapes(CONFIG)["qkv_proj"].slice_offsets
    assert qkv.b[: offsets[1]].abs().sum() == 0 and qkv.b[offsets[2] :].abs().sum() == 0


def _refused(tmp_path: Path, config: dict, tensors: dict, reason: str, **kwargs) -> None:
    write_adapter(tmp_path, config, tensors)
    with pytest.raises(InvalidArgumentError, match=reason):
        _parse(tmp_path, **kwargs)


def test_shapes_of_another_base_model_are_refused(tmp_path: Path) -> None:
    other = tiny_model_config(hidden_size=32)
    tensors = lora_tensors(other, ["q_proj"], 4)
    _refused(tmp_path, peft_config(["q_proj"], 4), tensors, "do not fit the base model")


def test_rank_different_from_the_config_is_refused(tmp_path: Path) -> None:
    tensors = lora_tensors(CONFIG, ["o_proj"], 8)
    _refused(tmp_path, peft_config(["o_proj"], 4), tensors, r"expected \(4, 64\)")


def test_rank_over_the_engine_limit_is_refused(tmp_path: Path) -> None:
    tensors = lora_tensors(CONFIG, ["o_proj"], 8)
    _refused(tmp_path, peft_config(["o_proj"], 8), tensors, "maximum LoRA rank 4", max_rank=4)


def test_layer_beyond_the_model_is_refused(tmp_path: Path) -> None:
    tensors = lora_tensors(tiny_model_config(num_hidden_layers=3), ["o_proj"], 2)
    _refused(tmp_path, peft_config(["o_proj"], 2), tensors, "layer 2; the base model has 2")


@pytest.mark.parametrize(
    ("extra_name", "reason"),
    [
        ("base_model.model.model.embed_tokens.lora_embedding_A", "token embedding"),
        ("base_model.model.lm_head.lora_A.weight", "LM head"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "DoRA"),
        ("base_model.model.model.layers.0.mlp.act_fn.lora_A.weight", "'act_fn'"),
        ("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", "unexpected tensor"),
        ("something.else", "unexpected tensor"),
    ],
)
def test_tensors_outside_the_seven_projections_are_refused(
    tmp_path: Path, extra_name: str, reason: str
) -> None:
    tensors = lora_tensors(CONFIG, ["q_proj"], 2) | {extra_name: torch.ones(2, 2)}
    _refused(tmp_path, peft_config(["q_proj"], 2), tensors, reason)


def test_tensor_for_a_module_not_in_target_modules_is_refused(tmp_path: Path) -> None:
    tensors = lora_tensors(CONFIG, ["q_proj", "v_proj"], 2)
    _refused(tmp_path, peft_config(["q_proj"], 2), tensors, "not in target_modules")


def test_missing_factor_non_finite_and_integer_weights_are_refused(tmp_path: Path) -> None:
    tensors = lora_tensors(CONFIG, ["q_proj"], 2)
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    without_b = {key: value for key, value in tensors.items() if key != name}
    _refused(tmp_path / "a", peft_config(["q_proj"], 2), without_b, "lora_B is missing")
    nan = dict(tensors)
    nan[name] = nan[name].clone()
    nan[name][0, 0] = float("nan")
    _refused(tmp_path / "b", peft_config(["q_proj"], 2), nan, "NaN or infinity")
    integer = dict(tensors)
    integer[name] = integer[name].to(torch.int32)
    _refused(tmp_path / "c", peft_config(["q_proj"], 2), integer, "not floating point")


def test_bad_safetensors_and_empty_adapters_are_refused(tmp_path: Path) -> None:
    write_adapter(tmp_path, peft_config(["q_proj"], 2), lora_tensors(CONFIG, ["q_proj"], 2))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(InvalidArgumentError, match="not a valid safetensors file"):
        _parse(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(InvalidArgumentError, match="not a valid safetensors file"):
        _parse(tmp_path)
    write_adapter(tmp_path / "empty", peft_config(["q_proj"], 2), {})
    with pytest.raises(InvalidArgumentError, match="holds no tensors"):
        _parse(tmp_path / "empty")


def test_registration_then_load_verifies_the_checksum(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_adapter(
        root / "sql",
        peft_config(["q_proj", "down_proj"], 4),
        lora_tensors(CONFIG, ["q_proj", "down_proj"], 4),
    )
    record = inspect_adapter("sql", "sql", adapter_root=root, model_config=CONFIG, max_rank=64)
    assert record.rank == 4 and record.target_modules == ("down_proj", "q_proj")
    loaded = load_registered_adapter(
        "sql",
        record.path,
        record.sha256,
        adapter_root=root,
        model_config=CONFIG,
        max_rank=64,
        dtype=torch.bfloat16,
    )
    assert loaded.layers[1]["down_proj"].b.dtype == torch.bfloat16
    assert loaded.checksum == record.sha256
    # Swap in other (valid) weights after registration: the load refuses them.
    write_adapter(root / "sql", peft_config(["q_proj"], 4), lora_tensors(CONFIG, ["q_proj"], 4))
    with pytest.raises(FailedPreconditionError, match="changed on disk"):
        load_registered_adapter(
            "sql",
            record.path,
            record.sha256,
            adapter_root=root,
            model_config=CONFIG,
            max_rank=64,
            dtype=torch.float32,
        )


def test_registration_refuses_bad_names_and_bad_adapters(tmp_path: Path) -> None:
    # The one name rule of the protocol layer, as the router's registry applies it.
    for name in ("", "../x", " sql", "a" * 200, "sql name", "team/sql"):
        with pytest.raises(InvalidArgumentError, match="adapter name|a non-empty name"):
            validate_adapter_name(name)
    assert validate_adapter_name("team-sql-v2.1") == "team-sql-v2.1"
    write_adapter(tmp_path / "dora", peft_config(["q_proj"], 2, use_dora=True), {})
    with pytest.raises(InvalidArgumentError, match="DoRA"):
        inspect_adapter("dora", "dora", adapter_root=tmp_path, model_config=CONFIG, max_rank=64)
