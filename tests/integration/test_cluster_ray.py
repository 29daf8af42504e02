"""Engine actors on a real local Ray cluster, registered in a real redis-server.

One Ray start for the whole module (it is slow on a shared 2-core machine): an `EngineWorker`
actor with a tiny random-weight model serves Engine.Info on its address and appears in the
registry; `kill -9` of its process mid-stream ends the stream with UNAVAILABLE within 2 s; Ray
restarts the actor, which re-registers under the same engine id and serves again; a clean stop
deregisters it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.redis_server import LocalRedisServer, find_redis_server, start_redis_server
from services.common.redis_store import StoreConfig, open_store
from services.engine.config import EngineConfig
from services.engine.worker_config import WorkerConfig, WorkerNetworkConfig
from services.ray_cluster import RayCluster, RayClusterConfig
from services.router.registry import EngineRegistry

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedisServer]:
    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(redis_server: LocalRedisServer) -> Iterator[RayCluster]:
    config = RayClusterConfig(
        engines=1, ray_num_cpus=1, registration_ttl_s=2.0, engine_ready_timeout_s=240
    )
    ray_cluster = RayCluster(config).start()
    try:
        worker = WorkerConfig(
            WorkerNetworkConfig(host="127.0.0.1", port=0, load_report_interval_s=0.2),
            EngineConfig(model="dummy:tiny", device="cpu", kv_cache_bytes=16 * 1024 * 1024),
        )
        ray_cluster.start_engines(worker, StoreConfig(redis_url=redis_server.url))
        yield ray_cluster
    finally:
        ray_cluster.stop()


async def _info(address: str) -> engine_pb2.EngineInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return await stub.Info(engine_pb2.EngineInfoRequest(), timeout=5)


async def _registry_view(url: str, predicate, timeout_s: float) -> dict:  # noqa: ANN001
    store = open_store(StoreConfig(redis_url=url))
    registry = EngineRegistry(store, poll_interval_s=0.1)
    await registry.start()
    try:
        assert await registry.wait_until(predicate, timeout_s), registry.engines()
        return registry.engines()
    finally:
        await registry.stop()
        await store.close()


async def _stream_until_killed(address: str, pid: int) -> tuple[grpc.StatusCode, float, int]:
    """Start a long generation, SIGKILL the engine process after tokens flow; time the end."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        submit = engine_pb2.EngineRequest(
            submits=[
                engine_pb2.SubmitRequest(
                    request_id="long",
                    prompt_token_ids=[1, 2, 3, 4],
                    params=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True),
                )
            ]
        )
        queue: asyncio.Queue[engine_pb2.EngineRequest] = asyncio.Queue()
        await queue.put(submit)

        async def requests():  # noqa: ANN202 - keeps the stream open until cancelled
            while True:
                yield await queue.get()

        call = stub.EngineSession(requests())
        tokens = 0
        killed_at = 0.0
        try:
            async for step in call:
                tokens += sum(len(update.token_ids) for update in step.updates)
                if tokens >= 3 and not killed_at:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
        except grpc.aio.AioRpcError as exc:
            return exc.code(), time.monotonic() - killed_at, tokens
        return grpc.StatusCode.OK, time.monotonic() - killed_at, tokens


def test_engine_actor_serves_registers_and_survives_kill(
    cluster: RayCluster, redis_server: LocalRedisServer
) -> None:
    (actor,) = cluster.engines
    assert actor.engine_id == "engine-0"
    info = asyncio.run(_info(actor.address))
    assert info.model == "dummy:tiny" and info.num_blocks > 0
    view = asyncio.run(_registry_view(redis_server.url, lambda engines: "engine-0" in engines, 5.0))
    assert view["engine-0"].address == actor.address
    assert view["engine-0"].pid == actor.pid != os.getpid()

    code, seconds, tokens = asyncio.run(_stream_until_killed(actor.address, actor.pid))
    assert tokens >= 3
    assert code == grpc.StatusCode.UNAVAILABLE
    assert seconds < 2.0

    # Ray restarts the actor; it re-registers (new process, maybe a new port) and serves.
    view = asyncio.run(
        _registry_view(
            redis_server.url,
            lambda engines: "engine-0" in engines and engines["engine-0"].pid != actor.pid,
            120.0,
        )
    )
    restarted = view["engine-0"]
    assert asyncio.run(_info(restarted.address)).model == "dummy:tiny"
    (now,) = cluster.describe_engines()
    assert now["pid"] == restarted.pid and now["address"] == restarted.address


def test_token_auth_on_and_clean_stop_deregisters(
    cluster: RayCluster, redis_server: LocalRedisServer
) -> None:
    assert cluster.token_auth is True  # Ray 2.5x+ default for a new local cluster; kept on
    cluster.stop()
    view = asyncio.run(_registry_view(redis_server.url, lambda engines: not engines, 5.0))
    assert view == {}
