"""EngineConfig validation and layering; the package's lazy exports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.config import from_layers
from services.common.errors import InvalidArgumentError
from services.engine.config import EngineConfig


def test_defaults_suit_the_cpu():
    config = EngineConfig()
    assert config.model is None and config.backend == "torch"
    assert config.block_size == 16 and config.enable_prefix_caching
    # Step limits are chosen for the device at start (device_limits.py): 256 / 2048 on CPU.
    assert config.max_num_seqs is None and config.max_num_batched_tokens is None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "power of two"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
        ({"dtype": "float64"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"seed": -3}, "seed"),
        ({"model": "  "}, "model"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"kv_cache_dtype": "fp8", "device": "cpu"}, "kv_cache_dtype fp8 needs a CUDA device"),
        ({"kv_cache_dtype": "fp8", "backend": "onnxruntime"}, "Triton attention"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(fields, message):
    with pytest.raises(InvalidArgumentError, match=message):
        EngineConfig(**fields)


def test_flags_then_environment_then_defaults(monkeypatch):
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("SLUICE_BLOCK_SIZE", "32")
    monkeypatch.setenv("SLUICE_ENABLE_PREFIX_CACHING", "off")
    config = from_layers(EngineConfig, {"block_size": "8"})
    assert config.block_size == 8  # the flag wins
    assert config.max_num_seqs == 12
    assert config.enable_prefix_caching is False
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "many")
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        from_layers(EngineConfig, {})


def test_resolved_device():
    assert EngineConfig(device="cpu").resolved_device() == "cpu"
    assert EngineConfig(device="cuda:1").resolved_device() == "cuda:1"
    assert EngineConfig(device="auto").resolved_device() in ("cpu", "cuda")


def test_importing_the_package_is_cheap_and_exports_resolve():
    code = (
        "import sys, services.engine as e\n"
        "heavy = [m for m in ('torch', 'ray', 'redis', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from services.engine import LLM, SamplingParams, LLMEngine, EngineConfig\n"
        "assert LLM.__name__ == 'LLM' and 'ray' not in sys.modules and 'redis' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
