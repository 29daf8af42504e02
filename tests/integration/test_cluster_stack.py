"""The cluster end to end: the launcher's Ray + Redis stack with two real router processes.

One stack for the module (Ray and the model load are slow on a shared 2-core machine): a private
redis-server, one engine as a Ray actor (dummy:tiny weights) registered in Redis, a tokenizer,
and two routers that find the engine only through the registry and check API keys kept in
Redis. Through the real routers: a per-key limit of N requests/min admits exactly N across both;
a retried request id returns the same text without a second generation (the engine's accepted
request counter); Redis SIGSTOP keeps requests succeeding while the SharedState health reports
NOT_SERVING, and SIGCONT brings limits back; kill -9 of the engine actor mid-stream ends the call
with UNAVAILABLE within 2 s and the restarted actor serves the next request; a router killed and
restarted rebuilds its view from Redis and serves.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from services.cli import dispatch
from services.common.redis_server import find_redis_server
from services.common.redis_store import StoreConfig, open_store
from services.engine.server import ACCEPTED_REQUESTS_TRAILER
from services.launcher import (
    ChildProcess,
    Stack,
    StackConfig,
    free_port,
    spawn_service,
    terminate,
    wait_until_serving,
)
from services.ray_cluster import RayClusterConfig
from services.router.api_keys import ApiKeyStore
from services.router.rate_limit import RateLimits
from services.router.shared_state import SHARED_STATE_HEALTH

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]

ROUTER_ARGS = ("--registry-poll-s", "0.2", "--redis-timeout-s", "0.3", "--shutdown-grace-s", "1")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = StackConfig(
        model="dummy:tiny",
        port=0,
        engines=1,
        engine_args=(
            "--device",
            "cpu",
            "--kv-cache-bytes",
            str(16 * 1024 * 1024),
            "--load-report-interval-s",
            "0.2",
        ),
        router_args=(*ROUTER_ARGS, "--redis-api-keys"),
        startup_timeout_s=400.0,
        stop_grace_s=5.0,
        log_dir=tmp_path_factory.mktemp("ray-stack-logs"),
        ray=True,
        ray_cluster=RayClusterConfig(
            ray_num_cpus=1, registration_ttl_s=2.0, engine_ready_timeout_s=300.0
        ),
        shared_state=True,
    )
    running = Stack(config)
    running.start()
    try:
        yield running
    finally:
        if running.redis_server is not None:
            os.kill(running.redis_server.pid, signal.SIGCONT)
        running.stop()


def _start_router(stack: Stack, name: str) -> ChildProcess:
    assert stack.redis_url is not None
    router = spawn_service(
        stack.config,
        name,
        "router",
        free_port(),
        [
            "--tokenizer",
            stack.tokenizer_address,
            "--redis-url",
            stack.redis_url,
            "--redis-api-keys",
            *ROUTER_ARGS,
        ],
    )
    wait_until_serving(router, time.monotonic() + 120)
    return router


@pytest.fixture(scope="module")
def second_router(stack: Stack) -> Iterator[list[ChildProcess]]:
    holder = [_start_router(stack, "router-2")]
    try:
        yield holder  # a test may replace it (kill and restart)
    finally:
        terminate(holder, 2.0)
        for router in holder:
            router.close_log()


def _add_key(stack: Stack, name: str, limits: RateLimits) -> str:
    async def add() -> str:
        store = open_store(StoreConfig(redis_url=stack.redis_url))
        try:
            raw_key, _ = await ApiKeyStore(store).add(name, limits)
            return raw_key
        finally:
            await store.close()

    return asyncio.run(add())


@pytest.fixture(scope="module")
def open_key(stack: Stack) -> str:
    key = _add_key(stack, "tests", RateLimits())
    time.sleep(2.5)  # routers mirror the key table every 2 s
    return key


def _request(max_tokens: int = 4, request_id: str = "", prompt: str = "Hello there"):  # noqa: ANN202
    return router_pb2.GenerateRequest(
        prompt=prompt,
        request_id=request_id,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _generate(address: str, key: str | None, request, timeout: float = 60.0) -> str:  # noqa: ANN001
    metadata = (("x-api-key", key),) if key else None
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        responses = list(stub.Generate(request, timeout=timeout, metadata=metadata))
    assert responses and responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    return "".join(r.text for r in responses)


def _accepted_requests(stack: Stack) -> int:
    (engine,) = stack.ray_cluster.describe_engines()
    with grpc.insecure_channel(engine["address"]) as channel:
        _, call = engine_pb2_grpc.EngineStub(channel).Info.with_call(
            engine_pb2.EngineInfoRequest(), timeout=5
        )
    return int(dict(call.trailing_metadata())[ACCEPTED_REQUESTS_TRAILER])


def _shared_state_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(
            health_pb2.HealthCheckRequest(service=SHARED_STATE_HEALTH), timeout=5
        ).status


def test_keys_and_a_limit_of_n_requests_shared_by_two_routers(
    stack: Stack,
    second_router: list[ChildProcess],
    open_key: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    routers = [stack.router_address, second_router[0].address]
    with pytest.raises(grpc.RpcError) as missing:
        _generate(routers[0], None, _request())
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as wrong:
        _generate(routers[1], "sk-sluice-not-a-key", _request())
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED

    limit = 3
    # `sluice keys add` as an operator runs it; the key is printed once, last.
    argv = ["keys", "add", "--name", "limited", "--requests-per-minute", str(limit)]
    assert dispatch([*argv, "--redis-url", stack.redis_url]) == 0
    limited_key = capsys.readouterr().out.strip().splitlines()[-1]
    time.sleep(2.5)
    admitted, refused = 0, []
    for attempt in range(2 * limit + 2):
        try:
            _generate(routers[attempt % 2], limited_key, _request(max_tokens=2))
            admitted += 1
        except grpc.RpcError as error:
            refused.append(error)
    assert admitted == limit
    assert {error.code() for error in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(
        any(name == "retry-after" for name, _ in error.trailing_metadata()) for error in refused
    )
    _generate(routers[1], open_key, _request(max_tokens=2))  # other keys are not limited


def test_retried_request_id_returns_same_text_without_second_generation(
    stack: Stack, second_router: list[ChildProcess], open_key: str
) -> None:
    request = _request(max_tokens=6, request_id=f"retry-{time.time_ns()}")
    before = _accepted_requests(stack)
    first = _generate(stack.router_address, open_key, request)
    assert _accepted_requests(stack) == before + 1
    again = _generate(second_router[0].address, open_key, request)  # the other router
    assert again == first
    assert _accepted_requests(stack) == before + 1
    other = _request(max_tokens=7, request_id=request.request_id)
    with pytest.raises(grpc.RpcError) as reused:
        _generate(stack.router_address, open_key, other)
    assert reused.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_redis_paused_requests_keep_succeeding_and_limits_resume(
    stack: Stack, second_router: list[ChildProcess], open_key: str
) -> None:
    redis_pid = stack.redis_server.pid
    assert _shared_state_health(stack.router_address) == health_pb2.HealthCheckResponse.SERVING
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        for router in (stack.router_address, second_router[0].address):
            started = time.monotonic()
            _generate(router, open_key, _request(max_tokens=3), timeout=20)
            assert time.monotonic() - started < 10.0
        deadline = time.monotonic() + 5
        while _shared_state_health(stack.router_address) != 2:  # NOT_SERVING
            assert time.monotonic() < deadline, "health never reported the outage"
            time.sleep(0.1)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while _shared_state_health(stack.router_address) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "health never recovered"
        time.sleep(0.2)
    # Shared limits again: a new key's 2 requests/min hold across both routers.
    key = _add_key(stack, "after-outage", RateLimits(requests_per_minute=2))
    time.sleep(2.5)
    codes = []
    for attempt in range(4):
        router = (stack.router_address, second_router[0].address)[attempt % 2]
        try:
            _generate(router, key, _request(max_tokens=2))
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as error:
            codes.append(error.code())
    assert codes.count(grpc.StatusCode.OK) == 2
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2


def test_engine_actor_kill_mid_stream_then_restart_serves(
    stack: Stack, second_router: list[ChildProcess], open_key: str
) -> None:
    (before,) = stack.ray_cluster.describe_engines()
    killed_at = 0.0
    with grpc.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as ended:
            for response in stub.Generate(
                _request(max_tokens=1500), timeout=120, metadata=(("x-api-key", open_key),)
            ):
                if response.token_ids and not killed_at:
                    os.kill(before["pid"], signal.SIGKILL)
                    killed_at = time.monotonic()
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert killed_at and time.monotonic() - killed_at < 2.0
    # The actor restarts and re-registers; each router follows the registry on its own refresh,
    # so each one serves again once it has seen the new engine (UNAVAILABLE until then).
    _generate_once_served(second_router[0].address, open_key, within_s=180)
    (after,) = stack.ray_cluster.describe_engines()
    assert after["pid"] != before["pid"]
    _generate_once_served(stack.router_address, open_key, within_s=30)


def _generate_once_served(address: str, key: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        try:
            _generate(address, key, _request(max_tokens=3), timeout=20)
            return
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert time.monotonic() < deadline, f"{address} never served the restarted engine"
            time.sleep(0.5)


def test_router_killed_and_restarted_rebuilds_view_from_redis(
    stack: Stack, second_router: list[ChildProcess], open_key: str
) -> None:
    old = second_router[0]
    old.process.send_signal(signal.SIGKILL)
    old.process.wait(10)
    old.close_log()
    second_router[0] = _start_router(stack, "router-2b")
    # No --engines given: the engine comes from the registry; keys from Redis.
    _generate(second_router[0].address, open_key, _request(max_tokens=3))
