"""Engine actors on a real local Ray cluster, registered in a real redis-server.

One Ray start for the whole module (it is slow on a shared 2-core machine): an `EngineWorker`
actor with a tiny random-weight model serves Engine.Info on its address and appears in the
registry; `kill -9` of its process mid-stream ends the stream with UNAVAILABLE within 2 s; Ray
restarts the actor, which re-registers under the same engine id and serves again. Then a router
that finds engines only through the registry (RegistryDiscovery) serves through Redis being
paused and through another kill -9 of the engine. A clean stop deregisters the engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator

import grpc
import pytest

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from services.common.grpc_server import start_server
from services.common.redis_server import LocalRedisServer, find_redis_server, start_redis_server
from services.common.redis_store import StoreConfig, open_store
from services.ray_cluster import RayCluster, RayClusterConfig, start_ray_engines
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.registry import EngineRegistry, RegistryDiscovery
from services.router.server import RouterServicer
from services.tokenizer import server as tokenizer_server
from services.tokenizer.config import TokenizerConfig
from tests.integration.processes import engine_info

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
    engine_flags = ["--model", "dummy:tiny", "--device", "cpu", "--load-report-interval-s", "0.2"]
    ray_cluster = start_ray_engines(
        [*engine_flags, "--kv-cache-bytes", str(16 * 1024 * 1024)],
        redis_url=redis_server.url,
        config=config,
    )
    try:
        yield ray_cluster
    finally:
        ray_cluster.stop()


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
    info = asyncio.run(engine_info(actor.address))
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
    assert restarted.address == actor.address  # a local cluster keeps the engine's port
    assert asyncio.run(engine_info(restarted.address)).model == "dummy:tiny"
    (now,) = cluster.describe_engines()
    assert now["pid"] == restarted.pid and now["address"] == restarted.address


async def _generate(stub: router_pb2_grpc.RouterStub, max_tokens: int) -> list:
    request = router_pb2.GenerateRequest(
        prompt="Hello there",
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    return [response async for response in stub.Generate(request, timeout=60)]


async def _wait_serving(core: RouterCore, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not core.serving:
        assert time.monotonic() < deadline, "router never became ready"
        await asyncio.sleep(0.1)


async def _router_scenario(redis_server: LocalRedisServer, cluster: RayCluster) -> None:
    tokenizer = await tokenizer_server.start(TokenizerConfig(model="dummy:tiny", port=0))
    store = open_store(StoreConfig(redis_url=redis_server.url, redis_timeout_s=0.3))
    registry = EngineRegistry(store, poll_interval_s=0.2)
    discovery = RegistryDiscovery(registry)
    config = RouterConfig(port=0, engines=("127.0.0.1:1",), tokenizer=f"127.0.0.1:{tokenizer.port}")
    core = RouterCore(config, discovery=discovery)
    discovery.follow(core.pool.refresh)
    await registry.start()
    servicer = RouterServicer(core)
    server = await start_server(
        "127.0.0.1:0",
        lambda grpc_server: router_pb2_grpc.add_RouterServicer_to_server(servicer, grpc_server),
        ["sluice.v1.Router"],
    )
    await core.start()
    try:
        await _wait_serving(core, 60)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            assert len([r for r in await _generate(stub, 4) if r.token_ids]) >= 1
            # Redis frozen: the registry view stays and requests keep succeeding.
            os.kill(redis_server.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(0.6)
                responses = await _generate(stub, 4)
                assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert registry.degraded and set(registry.engines()) == {"engine-0"}
            finally:
                os.kill(redis_server.pid, signal.SIGCONT)
            # kill -9 of the engine mid-stream: the stream ends UNAVAILABLE within 2 s.
            (before,) = cluster.describe_engines()
            request = router_pb2.GenerateRequest(
                prompt="Hello",
                params=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True),
            )
            killed_at = 0.0
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for response in stub.Generate(request, timeout=60):
                    if response.token_ids and not killed_at:
                        os.kill(before["pid"], signal.SIGKILL)
                        killed_at = time.monotonic()
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert killed_at and time.monotonic() - killed_at < 2.0
            # Ray restarts it, it re-registers, the router follows, the next request succeeds.
            assert await registry.wait_until(
                lambda view: "engine-0" in view and view["engine-0"].pid != before["pid"], 120
            )
            await _wait_serving(core, 60)
            responses = await _generate(stub, 3)
            assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        await server.stop(0.5)
        await core.close()
        await registry.stop()
        await store.close()
        await tokenizer.stop(0.5)


def test_router_follows_registry_through_redis_pause_and_engine_kill(
    cluster: RayCluster, redis_server: LocalRedisServer
) -> None:
    asyncio.run(_router_scenario(redis_server, cluster))


def test_token_auth_on_and_clean_stop_deregisters(
    cluster: RayCluster, redis_server: LocalRedisServer
) -> None:
    assert cluster.token_auth is True  # Ray 2.5x+ default for a new local cluster; kept on
    for port in (8265, 10001):  # Ray's dashboard and client server ports stay closed
        with socket.socket() as probe:
            probe.settimeout(0.5)
            assert probe.connect_ex(("127.0.0.1", port)) != 0
    cluster.stop()
    view = asyncio.run(_registry_view(redis_server.url, lambda engines: not engines, 5.0))
    assert view == {}
