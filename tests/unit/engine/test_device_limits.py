"""Step limits sized from the device's memory and the model's shape."""

from __future__ import annotations

from services.engine.config import EngineConfig
from services.engine.device_limits import (
    GIB,
    DeviceRates,
    ModelShape,
    model_shape,
    plan_limits,
    resolve_limits,
    ridge_batch_cap,
    ridge_rows,
)
from services.engine.models.config import ModelConfig

LLAMA_3_8B = ModelShape(
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    parameter_count=8_030_000_000,
)


def plan(memory_gib: float, **kwargs):
    return plan_limits(
        device_type="cuda",
        total_memory_bytes=int(memory_gib * GIB),
        gpu_memory_utilization=0.85,
        shape=kwargs.pop("shape", LLAMA_3_8B),
        dtype_bytes=2,
        **kwargs,
    )


def test_an_80gb_card_takes_512_sequences_and_8k_tokens():
    limits = plan(79.6)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (512, 8192)
    assert "KV tokens" in limits.reason


def test_a_one_byte_kv_cache_counts_twice_the_tokens():
    bf16, fp8 = plan(79.6), plan(79.6, kv_dtype_bytes=1)
    tokens = [
        int(limits.reason.split("about ")[1].split(" KV")[0].replace(",", ""))
        for limits in (bf16, fp8)
    ]
    assert abs(tokens[1] - 2 * tokens[0]) <= 1  # whole tokens of each


def test_smaller_cards_take_less_and_a_tight_cache_cuts_sequences():
    mid = plan(24)
    assert mid.max_num_batched_tokens <= 4096 and mid.max_num_seqs <= 256
    # 8B weights (16 GB) on a 20 GB budget leave a few thousand KV tokens: few sequences.
    tight = plan(24 * 0.85 / 0.85)
    assert tight.max_num_seqs * 512 <= 24 * GIB
    small = plan(16.5, shape=LLAMA_3_8B)
    assert small.max_num_seqs == 16  # never below the floor


H100_RATES = DeviceRates(matmul_flops_per_s=690e12, bandwidth_bytes_per_s=3.0e12)


def test_the_ridge_is_the_matmul_rate_over_bandwidth_in_rows():
    assert ridge_rows(H100_RATES, 2) == 230.0
    # float32 weights: twice the bytes per weight, so twice the rows to the same ridge.
    assert ridge_rows(H100_RATES, 4) == 460.0
    # 1.5 x 230 = 345: the nearest choice is 384; a faster matmul moves it, ties go down.
    assert ridge_batch_cap(H100_RATES, 2) == 384
    assert ridge_batch_cap(DeviceRates(790e12, 3.0e12), 2) == 384
    assert ridge_batch_cap(DeviceRates(312e12, 2.0e12), 2) == 256  # A100-like
    assert ridge_batch_cap(DeviceRates(1e12, 3.0e12), 2) == 128  # never below the floor
    assert ridge_batch_cap(DeviceRates(2000e12, 3.0e12), 2) == 512


def test_measured_rates_cap_the_running_batch_unless_it_is_set():
    capped = plan(79.6, rates=H100_RATES)
    assert capped.max_num_seqs == 384 and capped.max_num_batched_tokens == 8192
    assert "batch cap 384 from the ridge at 230 rows" in capped.reason
    assert plan(79.6, rates=H100_RATES, max_num_seqs=512).max_num_seqs == 512
    # The memory tier still bounds it: a 24 GB card keeps at most its 256.
    assert plan(24, rates=DeviceRates(2000e12, 1.0e12)).max_num_seqs <= 256


def test_explicit_values_win():
    limits = plan(79.6, max_num_seqs=64, max_num_batched_tokens=1024)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (64, 1024)


def test_cpu_keeps_its_defaults():
    limits = plan_limits(
        device_type="cpu",
        total_memory_bytes=0,
        gpu_memory_utilization=0.85,
        shape=LLAMA_3_8B,
        dtype_bytes=4,
    )
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (256, 2048)
    config, line = resolve_limits(EngineConfig(max_num_seqs=12), None, "cpu")
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (12, 2048)
    assert "max_num_seqs 12" in line and "target_step_ms" not in line
    _, line = resolve_limits(EngineConfig(max_num_seqs=12, target_step_ms=40.0), None, "cpu")
    assert line.endswith("(cpu defaults), target_step_ms 40")
    set_both = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, target_step_ms=2.5)
    assert resolve_limits(set_both, None, "cpu")[1].endswith("(set), target_step_ms 2.5")


def test_model_shape_counts_parameters():
    config = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
        },
        name="llama-3-8b",
    )
    shape = model_shape(config)
    assert 7.9e9 < shape.parameter_count < 8.1e9
    assert shape.num_kv_heads == 8 and shape.head_dim == 128


def test_device_rates_come_from_the_tuning_cache_or_a_measurement(tmp_path, monkeypatch):
    import torch

    from services.engine import device_limits

    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    measured = []

    def measure(device, dtype):
        measured.append(dtype)
        return H100_RATES

    monkeypatch.setattr(device_limits, "measure_device_rates", measure)
    assert device_limits.device_rates("cuda", torch.bfloat16) == H100_RATES
    assert device_limits.device_rates("cuda", torch.bfloat16) == H100_RATES  # from the cache
    assert measured == [torch.bfloat16]

    def no_room(device, dtype):
        raise torch.cuda.OutOfMemoryError("out of memory")

    monkeypatch.setattr(device_limits, "measure_device_rates", no_room)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert device_limits.device_rates("cuda", torch.float32) is None  # not cached for fp32
