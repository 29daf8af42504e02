"""`sluice up --no-ray`: one engine process per GPU, each pinned to its own."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.launcher import StackConfig, plan_engine_processes, start_engine_processes


def test_one_engine_per_gpu_by_default() -> None:
    assert plan_engine_processes(None, None, ["0", "1", "2", "3"]) == (4, ("0", "1", "2", "3"))
    assert plan_engine_processes(None, "auto", ["4", "7"]) == (2, ("4", "7"))
    assert plan_engine_processes(2, "cuda", ["0", "1", "2"]) == (2, ("0", "1"))


def test_a_tensor_parallel_engine_gets_a_group_of_gpus() -> None:
    assert plan_engine_processes(None, None, ["0", "1", "2", "3"], 2) == (2, ("0,1", "2,3"))
    assert plan_engine_processes(1, "cuda", ["0", "1", "2"], 2) == (1, ("0,1",))
    with pytest.raises(InvalidArgumentError, match="2 engines of 2 GPUs each but 3 GPUs"):
        plan_engine_processes(2, None, ["0", "1", "2"], 2)
    with pytest.raises(InvalidArgumentError, match="1 engines of 4 GPUs each"):
        plan_engine_processes(None, None, ["0", "1"], 4)


def test_cpu_engines_are_not_pinned() -> None:
    assert plan_engine_processes(None, None, []) == (1, ())
    assert plan_engine_processes(3, "cpu", ["0", "1"]) == (3, ())
    assert plan_engine_processes(2, "cuda:1", ["0", "1"]) == (2, ())  # the user's own device


def test_more_engines_than_gpus_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="3 engines of 1 GPUs each but 2 GPUs"):
        plan_engine_processes(3, None, ["0", "1"])
    with pytest.raises(InvalidArgumentError, match="need 2 GPUs"):
        StackConfig(engines=2, engine_gpus=("0",))


def test_each_engine_process_gets_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.launcher as launcher

    started: list[tuple[str, dict | None]] = []

    def fake_spawn(config, name, service, port, argv, *, host="127.0.0.1", env=None):  # noqa: ANN001, ANN202
        started.append((name, env))

    monkeypatch.setattr(launcher, "spawn_service", fake_spawn)
    config = StackConfig(engines=2, engine_gpus=("3", "5"))
    start_engine_processes(config, launcher.ModelSpec(None))
    assert started == [
        ("engine-0", {"CUDA_VISIBLE_DEVICES": "3"}),
        ("engine-1", {"CUDA_VISIBLE_DEVICES": "5"}),
    ]


def test_ray_engine_actors_take_their_tensor_parallel_size_in_gpus() -> None:
    from services.engine.worker_config import WorkerConfig
    from services.ray_cluster import RayClusterConfig
    from services.ray_engines import with_tensor_parallel

    pair = WorkerConfig.from_argv(["--model", "dummy:tiny", "--tensor-parallel-size", "2"])
    single = WorkerConfig.from_argv(["--model", "dummy:tiny"])
    assert with_tensor_parallel(RayClusterConfig(), pair).gpus_per_engine == 2
    assert with_tensor_parallel(RayClusterConfig(gpus_per_engine=2), pair).gpus_per_engine == 2
    assert with_tensor_parallel(RayClusterConfig(), single).gpus_per_engine == 1
    with pytest.raises(InvalidArgumentError, match="--gpus-per-engine 4 differs"):
        with_tensor_parallel(RayClusterConfig(gpus_per_engine=4), pair)
