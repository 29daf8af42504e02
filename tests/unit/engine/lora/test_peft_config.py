"""adapter_config.json: what is served, what is refused (INVALID_ARGUMENT) and why."""

from __future__ import annotations

import json
import math

import pytest

from services.common.errors import InvalidArgumentError
from services.engine.lora.peft_config import parse_adapter_config
from services.engine.lora.projections import SUPPORTED_MODULES
from tests.lora_adapters import peft_config


def _parse(**fields: object) -> object:
    return parse_adapter_config(json.dumps(peft_config(["q_proj"], 8) | fields), max_rank=64)


def test_plain_lora_scale_is_alpha_over_rank() -> None:
    config = _parse(r=8, lora_alpha=32, target_modules=["q_proj", "self_attn.v_proj"])
    assert config.rank == 8 and config.target_modules == {"q_proj", "v_proj"}
    assert config.scale(8, 32.0) == 4.0


def test_rslora_scale_is_alpha_over_sqrt_rank() -> None:
    config = _parse(r=16, lora_alpha=8, use_rslora=True)
    assert config.scale(16, 8.0) == pytest.approx(2.0)
    assert config.scale(2, 8.0) == pytest.approx(8 / math.sqrt(2))


def test_rank_and_alpha_patterns_match_as_peft_does() -> None:
    from peft.utils.other import get_pattern_key

    rank_pattern = {"down_proj": 2, r"layers\.1\.self_attn\.q_proj": 4}
    alpha_pattern = {"layers.0.mlp.down_proj": 3, "o_proj": 5}
    config = _parse(r=8, lora_alpha=16, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    keys = [*rank_pattern, *alpha_pattern]
    for path in (
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.3.self_attn.o_proj",
    ):
        key = get_pattern_key(keys, path)
        expected = (rank_pattern.get(key, 8), alpha_pattern.get(key, 16))
        assert config.module_rank_alpha(path) == expected
    # The first matching key decides both: down_proj's alpha is the default, not 3.
    assert config.module_rank_alpha("model.layers.0.mlp.down_proj") == (2, 16)


def test_all_linear_means_the_seven_projections() -> None:
    assert _parse(target_modules="all-linear").target_modules == SUPPORTED_MODULES


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"modules_to_save": ["embed_tokens"]}, "modules_to_save"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"target_modules": ["lm_head"]}, "lm_head"),
        ({"target_modules": ["q_proj", "rotary_emb"]}, "only"),
        ({"r": 65}, "maximum LoRA rank 64"),
        ({"rank_pattern": {"q_proj": 128}}, "maximum LoRA rank 64"),
        ({"r": 0}, "positive integer"),
        ({"lora_alpha": "big"}, "finite number"),
        ({"lora_alpha": float("nan")}, "finite number"),
        ({"bias": "all"}, "biases"),
        ({"lora_bias": True}, "lora_bias"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"target_modules": None}, "no target_modules"),
        ({"target_modules": "(unclosed"}, "not a valid pattern"),
        ({"rank_pattern": {"(bad": 4}}, "not a valid pattern"),
        ({"use_rslora": "yes"}, "boolean"),
    ],
)
def test_refused_configs(fields: dict[str, object], reason: str) -> None:
    with pytest.raises(InvalidArgumentError, match=reason):
        _parse(**fields)


def test_not_json_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        parse_adapter_config(b"\xff{", max_rank=64)
    with pytest.raises(InvalidArgumentError, match="JSON object"):
        parse_adapter_config("[1]", max_rank=64)
