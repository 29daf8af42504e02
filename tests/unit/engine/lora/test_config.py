"""LoRA settings: defaults, validation, and the same fields on EngineConfig (flags, env)."""

from __future__ import annotations

import pytest

from services.common.config import from_layers
from services.common.errors import InvalidArgumentError
from services.engine.config import EngineConfig
from services.engine.lora.config import LoRAConfig


def test_defaults_and_off_without_a_root() -> None:
    config = LoRAConfig.from_engine_config(EngineConfig())
    assert (config.max_loras, config.max_cpu_loras, config.max_lora_rank) == (4, 16, 64)
    assert not config.enabled
    assert LoRAConfig(adapter_root="/srv/adapters").enabled


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"max_loras": 0}, "max_loras must be an integer >= 1"),
        ({"max_lora_rank": True}, "max_lora_rank must be an integer"),
        ({"max_loras": 8, "max_cpu_loras": 4}, "at least max_loras"),
        ({"adapter_root": " "}, "adapter_root"),
    ],
)
def test_bad_values_are_refused_by_both(fields: dict, reason: str) -> None:
    with pytest.raises(InvalidArgumentError, match=reason):
        LoRAConfig(**fields)
    with pytest.raises(InvalidArgumentError, match=reason):
        EngineConfig(**fields)


def test_flags_and_environment_fill_the_engine_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_ADAPTER_ROOT", "/srv/adapters")
    config = from_layers(EngineConfig, {"max_loras": "8", "max_cpu_loras": "32"})
    lora = LoRAConfig.from_engine_config(config)
    assert (lora.max_loras, lora.max_cpu_loras, lora.adapter_root) == (8, 32, "/srv/adapters")


def test_serve_engine_flags_reach_the_engine() -> None:
    from services.engine.worker_config import WorkerConfig

    argv = ["--adapter-root", "/srv/adapters", "--max-loras", "3", "--max-cpu-loras", "5"]
    config = WorkerConfig.from_argv([*argv, "--max-lora-rank", "16"])
    lora = LoRAConfig.from_engine_config(config.engine)
    assert lora == LoRAConfig(3, 5, 16, "/srv/adapters") and lora.enabled
