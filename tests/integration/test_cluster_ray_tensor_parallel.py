"""A tensor-parallel engine as a Ray actor on a real local Ray cluster (CPU, gloo): the actor
starts its rank process and serves; a killed rank takes the actor down and Ray restarts the
whole group, which serves again on the same address. No Redis: the engine registers nowhere
shared (its address is fixed on a local cluster)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from protos.sluice.v1 import engine_pb2
from services.ray_cluster import RayCluster, RayClusterConfig, start_ray_engines
from tests.integration.processes import cmdline, descendants, engine_info, wait_until_gone

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    config = RayClusterConfig(engines=1, ray_num_cpus=1, engine_ready_timeout_s=240)
    flags = ["--model", "dummy:tiny", "--device", "cpu", "--tensor-parallel-size", "2"]
    ray_cluster = start_ray_engines(
        [*flags, "--kv-cache-bytes", str(8 * 1024 * 1024)], redis_url=None, config=config
    )
    try:
        yield ray_cluster
    finally:
        ray_cluster.stop()


def _ranks(actor_pid: int) -> list[int]:
    return [pid for pid in descendants(actor_pid) if "parallel.rank_main" in cmdline(pid)]


def _info_when_served(address: str, timeout_s: float) -> engine_pb2.EngineInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return asyncio.run(engine_info(address))
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_tensor_parallel_actor_serves_and_ray_restarts_its_group(cluster: RayCluster) -> None:
    (actor,) = cluster.engines
    info = asyncio.run(engine_info(actor.address))
    assert "tensor parallel over 2 ranks (gloo all-reduce)" in info.execution_path
    (rank,) = _ranks(actor.pid)

    os.kill(rank, signal.SIGKILL)  # the actor ends itself; Ray starts a new one
    assert not wait_until_gone([actor.pid], timeout_s=20)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            (now,) = cluster.describe_engines()
        except Exception:  # noqa: BLE001 - the actor is restarting
            now = {"pid": actor.pid}
        if now["pid"] != actor.pid and _ranks(now["pid"]):
            break
        time.sleep(0.5)
    else:
        raise AssertionError("Ray did not restart the tensor-parallel engine")
    assert now["address"] == actor.address
    assert "tensor parallel over 2 ranks" in _info_when_served(actor.address, 120).execution_path
