"""`python -m services.ray_engines`, the driver the KubeRay head runs: its flags, its GPU wait,
and the fixed engine port on a joined cluster, with a stand-in `ray` module (no Ray started)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from services.common.errors import InvalidArgumentError, UnavailableError
from services.common.redis_store import StoreConfig
from services.engine.worker_config import WorkerConfig
from services.ray_cluster import RayCluster, RayClusterConfig
from services.ray_engines import main


class _FakeRay(types.ModuleType):
    """Just the calls RayCluster makes: remote actors that report ready at once."""

    def __init__(self, gpus: list[int]) -> None:
        super().__init__("ray")
        self.gpus = gpus  # cluster GPU count per cluster_resources() call (last one repeats)
        self.created: list[tuple[dict[str, Any], Any]] = []

    def cluster_resources(self) -> dict[str, float]:
        return {"GPU": float(self.gpus.pop(0) if len(self.gpus) > 1 else self.gpus[0])}

    def remote(self, cls: type) -> Any:
        ray = self

        class _Actor:
            @staticmethod
            def options(**options: Any) -> Any:
                class _Bound:
                    @staticmethod
                    def remote(settings: Any) -> Any:
                        ray.created.append((options, settings))
                        network = settings.worker.network
                        address = f"10.1.2.{len(ray.created)}:{network.port}"
                        ready = {"engine_id": settings.engine_id, "address": address, "pid": 7}
                        return types.SimpleNamespace(
                            ready=types.SimpleNamespace(remote=lambda timeout: ready)
                        )

                return _Bound

        return _Actor

    def get(self, value: Any, timeout: float | None = None) -> Any:
        return value


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> _FakeRay:
    ray = _FakeRay([0, 1, 2])
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


def test_joined_cluster_engines_bind_the_pinned_port_one_gpu_each(fake_ray: _FakeRay) -> None:
    config = RayClusterConfig(ray_address="auto", engines=2, engine_port=50061)
    cluster = RayCluster(config)
    cluster.wait_for_gpus(2, poll_s=0.0)
    assert fake_ray.gpus == [2]
    worker = WorkerConfig.from_argv(["--host", "0.0.0.0"])
    engines = cluster.start_engines(worker, StoreConfig(), host="0.0.0.0")
    assert [engine.address for engine in engines] == ["10.1.2.1:50061", "10.1.2.2:50061"]
    for options, settings in fake_ray.created:
        assert options["num_gpus"] == 1 and options["num_cpus"] == 0
        assert settings.worker.network.port == 50061
        assert settings.worker.network.host == "0.0.0.0"


def test_joined_cluster_without_a_pinned_port_lets_each_node_pick(fake_ray: _FakeRay) -> None:
    fake_ray.gpus = [1]
    cluster = RayCluster(RayClusterConfig(ray_address="auto", engines=1))
    cluster.start_engines(WorkerConfig.from_argv([]), StoreConfig(), host="0.0.0.0")
    assert fake_ray.created[0][1].worker.network.port == 0


def test_waiting_for_gpus_gives_up_after_the_ready_timeout(fake_ray: _FakeRay) -> None:
    fake_ray.gpus = [1]
    cluster = RayCluster(RayClusterConfig(ray_address="auto", engine_ready_timeout_s=0.05))
    with pytest.raises(UnavailableError, match="1 GPUs, 2 are needed"):
        cluster.wait_for_gpus(2, poll_s=0.01)


def test_engine_port_is_validated() -> None:
    with pytest.raises(InvalidArgumentError):
        RayClusterConfig(engine_port=70000)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--ray-address is needed"),
        (["--ray-address=auto", "--wait-for-gpus"], "needs --engines"),
    ],
)
def test_main_refuses_incomplete_command_lines(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_drain_this_node_stops_only_the_engines_served_from_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stopped: list[str] = []

    def actor(engine_id: str, address: str) -> Any:
        info = {"engine_id": engine_id, "address": address}
        return types.SimpleNamespace(
            describe=types.SimpleNamespace(remote=lambda: info),
            stop=types.SimpleNamespace(remote=lambda timeout: stopped.append(engine_id) or True),
        )

    actors = {
        "sluice-engine-0": actor("engine-0", "10.1.2.3:50061"),
        "sluice-engine-1": actor("engine-1", "10.9.9.9:50061"),
        "other-actor": actor("x", "10.1.2.3:1"),
    }
    ray = types.ModuleType("ray")
    calls: list[str] = []
    ray.init = lambda **kwargs: calls.append(f"init {kwargs['address']} {kwargs['namespace']}")
    ray.shutdown = lambda: calls.append("shutdown")
    ray.get_actor = actors.__getitem__
    ray.get = lambda value, timeout=None: value
    ray.util = types.ModuleType("ray.util")
    ray.util.list_named_actors = lambda: list(actors)
    ray.util.get_node_ip_address = lambda: "10.1.2.3"
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", ray.util)
    assert main(["--ray-address=auto", "--drain-this-node", "--shutdown-grace-s=1"]) == 0
    assert stopped == ["engine-0"]
    assert calls == ["init auto sluice", "shutdown"]
