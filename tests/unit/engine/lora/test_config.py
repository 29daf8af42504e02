"""LoRA settings: defaults, validation, and the same fields on EngineConfig (flags, env)."""

from __future__ import annotations

import os

import pytest
import torch

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


def test_the_determinism_flag_reaches_the_kernels() -> None:
    """`--no-lora-deterministic` takes the shrink's workspace away (its splits then add with
    float atomics); by default the runtime hands the workspace to every shrink."""
    pytest.importorskip("triton", reason="the kernels' runtime imports Triton")
    from services.engine.lora.batch import LoRABatch
    from services.engine.lora.runtime import LoRARuntime
    from services.engine.lora.slots import LoRASlots
    from services.engine.worker_config import WorkerConfig
    from tests.lora_adapters import tiny_model_config

    assert LoRAConfig.from_engine_config(EngineConfig()).deterministic
    engine = WorkerConfig.from_argv(["--no-lora-deterministic"]).engine
    assert not LoRAConfig.from_engine_config(engine).deterministic
    config = tiny_model_config()
    slots = LoRASlots(config, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    for ordered in (True, False):
        runtime = LoRARuntime(slots, kernels="triton", max_rows=32, ordered_sums=ordered)
        seen: list[dict] = []
        runtime._shrink = lambda *args, seen=seen, **kwargs: seen.append(kwargs)
        runtime._expand = lambda *args, **kwargs: None
        runtime.set_batch(LoRABatch.from_row_slots([0, 1, -1]))
        x = torch.zeros(3, config.hidden_size)
        runtime.apply(0, "qkv_proj", x, torch.zeros(3, slots.shapes["qkv_proj"].out_features))
        assert len(seen) == 1 and (seen[0]["partials"] is not None) is ordered


def test_the_fused_decode_flag_reaches_the_lora_config() -> None:
    from services.engine.worker_config import WorkerConfig

    assert LoRAConfig.from_engine_config(EngineConfig()).fused_decode  # on by default
    engine = WorkerConfig.from_argv(["--no-lora-fused-decode"]).engine
    assert not LoRAConfig.from_engine_config(engine).fused_decode
    with pytest.raises(InvalidArgumentError, match="fused_decode"):
        LoRAConfig(fused_decode="yes")


def test_the_fused_swiglu_flag_is_on_by_default_and_reaches_the_lora_config() -> None:
    from services.engine.worker_config import WorkerConfig

    assert LoRAConfig().fused_swiglu
    assert LoRAConfig.from_engine_config(EngineConfig()).fused_swiglu
    engine = WorkerConfig.from_argv(["--no-lora-fused-swiglu"]).engine
    assert not LoRAConfig.from_engine_config(engine).fused_swiglu
    with pytest.raises(InvalidArgumentError, match="fused_swiglu"):
        LoRAConfig(fused_swiglu=1)


def test_the_side_deltas_flag_is_on_by_default_and_reaches_the_lora_config() -> None:
    from services.engine.worker_config import WorkerConfig

    assert LoRAConfig().side_deltas
    assert LoRAConfig.from_engine_config(EngineConfig()).side_deltas
    engine = WorkerConfig.from_argv(["--no-lora-side-deltas"]).engine
    assert not LoRAConfig.from_engine_config(engine).side_deltas
    with pytest.raises(InvalidArgumentError, match="side_deltas"):
        LoRAConfig(side_deltas="on")


def test_the_first_token_join_is_on_by_default_and_reaches_the_gate() -> None:
    from services.engine.lora.engine_adapters import EngineAdapters
    from services.engine.worker_config import WorkerConfig
    from tests.lora_adapters import tiny_model_config

    assert LoRAConfig().first_token_joins
    assert LoRAConfig.from_engine_config(EngineConfig()).first_token_joins
    engine = WorkerConfig.from_argv(["--no-lora-first-token-joins"]).engine
    off = LoRAConfig.from_engine_config(engine)
    assert not off.first_token_joins
    with pytest.raises(InvalidArgumentError, match="first_token_joins"):
        LoRAConfig(first_token_joins="yes")
    adapters = EngineAdapters(off, tiny_model_config(), dtype=torch.float32, device="cpu")
    try:
        assert adapters.gate.first_token_joins is False
    finally:
        adapters.manager.shutdown()


def test_deltas_are_left_to_a_kernel_only_while_it_runs_the_model_and_asks_this_runtime() -> None:
    """LoRARuntime leaves gate_up's deltas to SwiGLU (tile_consumer) only where that kernel
    will run next and ask it: the fast path bound (not its plain-torch reference mode), its
    source this runtime, a projection it reads, deltas written first, and tiles to walk (with
    long runs, every row's, laid out while the consumer was set); otherwise the deltas go
    through memory as before."""
    pytest.importorskip("triton", reason="the kernels' runtime imports Triton")
    from services.engine.backends.cuda_fast_path import TritonOps
    from services.engine.lora.batch import LoRABatch
    from services.engine.lora.runtime import LoRARuntime
    from services.engine.lora.slots import LoRASlots
    from tests.lora_adapters import tiny_model_config

    slots = LoRASlots(tiny_model_config(), max_loras=2, max_rank=8, dtype=torch.float32,
                      device="cpu")  # fmt: skip
    runtime = LoRARuntime(slots, kernels="triton", max_rows=64)
    ops = TritonOps()
    runtime.set_batch(LoRABatch.from_row_slots([0, -1, 1, 1]))
    assert not runtime._consumer_takes("gate_up_proj")  # none bound
    runtime.tile_consumer = ops
    assert not runtime._consumer_takes("gate_up_proj")  # not running the model
    ops.bound = True
    assert not runtime._consumer_takes("gate_up_proj")  # asks another source (or none)
    ops.epilogues = runtime
    assert runtime._consumer_takes("gate_up_proj")
    assert not runtime._consumer_takes("down_proj")  # read by the next matmul, no kernel
    runtime.write_tile_deltas = False
    assert not runtime._consumer_takes("gate_up_proj")
    runtime.write_tile_deltas = True
    runtime.long_segment_rows = 2  # the run of two rows goes through cuBLAS
    runtime.set_batch(LoRABatch.from_row_slots([0, -1, 1, 1]))
    assert runtime._consumer_takes("gate_up_proj")  # it walks every row's tiles
    assert runtime._num_all_tiles == 3  # slot 0's row, slot 1's run, the base row
    runtime.tile_consumer = None  # no consumer when the step was laid out: no such tiles
    runtime.set_batch(LoRABatch.from_row_slots([0, -1, 1, 1]))
    runtime.tile_consumer = ops
    assert not runtime._consumer_takes("gate_up_proj")
    runtime.set_batch(LoRABatch.from_row_slots([-1, -1]))  # no adapter rows: nothing to add
    assert not runtime._consumer_takes("gate_up_proj")


@pytest.mark.parametrize(
    ("fields", "rank"),
    [
        ({"adapter_root": "/adapters", "max_lora_rank": 16}, 16),
        ({"adapter_root": "/adapters", "lora_fused_decode": False}, 0),
        ({}, 0),  # adapters off
    ],
)
def test_a_cuda_runner_widens_its_weights_only_for_the_fold(
    monkeypatch: pytest.MonkeyPatch, fields: dict, rank: int
) -> None:
    """The fold's room below the projection weights is asked for at load exactly when adapters
    are on and the fold is."""
    from services.engine.cuda_runner import CudaModelRunner

    seen = {}
    monkeypatch.setattr(CudaModelRunner, "__init__", lambda self, files, **kw: seen.update(kw))
    CudaModelRunner.from_engine_config(EngineConfig(device="cpu", **fields), None)
    assert seen["lora_fold_rank"] == rank


def test_the_warm_up_compiles_the_expand_both_adding_and_writing() -> None:
    """Eager steps write their deltas first (the expand storing into y), graphs add them after
    the matmul: the warm-up launches both for every projection and row count, so no request's
    step waits for a kernel variant to compile."""
    pytest.importorskip("triton", reason="the kernels' runtime imports Triton")
    from services.engine.lora.engine_adapters import EngineAdapters
    from tests.lora_adapters import tiny_model_config

    config = tiny_model_config()
    lora = LoRAConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=8, adapter_root="/adapters")
    adapters = EngineAdapters(
        lora, config, dtype=torch.float32, device="cpu", kernels="triton", max_rows=64
    )
    runtime = adapters.runtime
    expands: list[tuple[int, bool]] = []
    runtime._shrink = lambda *args, **kwargs: None
    runtime._expand = lambda u, b, y, *args, **kwargs: expands.append((y.shape[0], kwargs["write"]))
    assert adapters.warm_up([1, 40, 1000]) == 3 * 4 * 4  # 1,000 rows: max_rows (64)
    assert sorted(set(expands)) == [(1, False), (1, True), (40, False), (40, True),
                                    (64, False), (64, True)]  # fmt: skip
    assert runtime.batch.is_empty


def test_the_load_workers_flag_reaches_the_lora_config_and_zero_is_refused() -> None:
    from services.engine.worker_config import WorkerConfig

    default = LoRAConfig.from_engine_config(EngineConfig()).load_workers
    assert default == max(1, min(4, os.cpu_count() or 1))
    engine = WorkerConfig.from_argv(["--lora-load-workers", "2"]).engine
    assert LoRAConfig.from_engine_config(engine).load_workers == 2
    with pytest.raises(InvalidArgumentError, match="load_workers must be an integer >= 1"):
        LoRAConfig(load_workers=0)
    with pytest.raises(InvalidArgumentError, match="load_workers must be an integer >= 1"):
        EngineConfig(lora_load_workers=0)
