"""The router's shared-state wiring without Redis: flags, combined API keys, per-key limits and
idempotent request ids through the real servicer (fake engine and tokenizer, in-memory store)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.sluice.v1 import (
    common_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2_grpc,
)
from services.common.errors import InvalidArgumentError, UnauthenticatedError
from services.common.redis_store import MemoryStore
from services.router.auth import ApiKeyAuthenticator
from services.router.config import RouterConfig, RouterSettings
from services.router.idempotency import IdempotencyCache
from services.router.rate_limit import RateLimiter, RateLimits
from services.router.server import shutdown, start
from services.router.shared_state import ANONYMOUS, Caller, CombinedAuthenticator
from tests.unit.router.router_fakes import FakeEngine, FakeTokenizer, generated_text, start_fake


def test_redis_url_turns_on_the_registry_and_allows_no_static_engines() -> None:
    settings = RouterSettings.from_argv(["--redis-url", "redis://127.0.0.1:1", "--engines", ""])
    assert settings.router.engine_registry and settings.router.engines == ()
    assert settings.store.redis_url == "redis://127.0.0.1:1"
    kept = RouterSettings.from_argv(["--redis-url", "redis://h:1", "--no-engine-registry"])
    assert not kept.router.engine_registry and kept.router.engines == ("127.0.0.1:50061",)
    assert not RouterSettings.from_argv([]).router.engine_registry
    with pytest.raises(InvalidArgumentError):
        RouterSettings.from_argv(["--engines", ""])
    with pytest.raises(InvalidArgumentError):
        RouterSettings.from_argv(["--redis-api-keys"])
    with pytest.raises(InvalidArgumentError):
        RouterSettings.from_argv(["--registry-poll-s", "0"])


class _RedisKeys:
    """Stands in for MirroredKeyAuthenticator: one known key with limits."""

    def check(self, metadata):  # noqa: ANN001, ANN201
        for name, value in metadata:
            if name == "x-api-key" and value == "redis-key":
                return Caller("key_1", RateLimits(requests_per_minute=2))
        raise UnauthenticatedError("invalid API key")


def test_combined_authenticator_sources() -> None:
    assert CombinedAuthenticator(ApiKeyAuthenticator(), None).check([]) is ANONYMOUS
    file_only = CombinedAuthenticator(ApiKeyAuthenticator(["file-key"]), None)
    caller = file_only.check([("x-api-key", "file-key")])
    assert caller.key_id.startswith("file:") and "file-key" not in caller.key_id
    assert caller.limits.unlimited
    with pytest.raises(UnauthenticatedError):
        file_only.check([("x-api-key", "redis-key")])
    both = CombinedAuthenticator(ApiKeyAuthenticator(["file-key"]), _RedisKeys())
    assert both.check([("authorization", "Bearer file-key")]).key_id == caller.key_id
    assert both.check([("x-api-key", "redis-key")]).key_id == "key_1"
    with pytest.raises(UnauthenticatedError):
        both.check([("x-api-key", "nope")])
    with pytest.raises(UnauthenticatedError):
        both.check([])


def _run(test, **core_options) -> None:  # noqa: ANN001
    async def scenario() -> None:
        engine, tokenizer = FakeEngine(), FakeTokenizer()
        engine_server, engine_port = await start_fake(
            engine, engine_pb2_grpc.add_EngineServicer_to_server
        )
        tokenizer_server, tokenizer_port = await start_fake(
            tokenizer, tokenizer_pb2_grpc.add_TokenizerServicer_to_server
        )
        config = RouterConfig(
            port=0,
            engines=(f"127.0.0.1:{engine_port}",),
            tokenizer=f"127.0.0.1:{tokenizer_port}",
        )
        core, server = await start(config, **core_options)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            for _ in range(300):
                if core.serving:
                    break
                await asyncio.sleep(0.01)
            await test(router_pb2_grpc.RouterStub(channel), engine)
        finally:
            await channel.close()
            await shutdown(core, server, 1.0)
            await engine_server.stop(None)
            await tokenizer_server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def _request(max_tokens: int, request_id: str = "") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        prompt="hi",
        request_id=request_id,
        params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )


async def _text(stub, request, key: str = "redis-key") -> str:  # noqa: ANN001
    responses = [r async for r in stub.Generate(request, metadata=(("x-api-key", key),))]
    return "".join(r.text for r in responses)


def test_retried_request_id_replays_without_a_second_generation() -> None:
    async def check(stub, engine) -> None:  # noqa: ANN001
        assert await _text(stub, _request(5, "r-1")) == generated_text(5)
        assert len(engine.submitted) == 1
        assert await _text(stub, _request(5, "r-1")) == generated_text(5)
        assert len(engine.submitted) == 1  # replayed, not generated again
        with pytest.raises(grpc.aio.AioRpcError) as reused:
            await _text(stub, _request(6, "r-1"))
        assert reused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert await _text(stub, _request(5, "r-2")) == generated_text(5)
        assert len(engine.submitted) == 2
        # A concurrent duplicate joins the stream in flight.
        first, second = await asyncio.gather(
            _text(stub, _request(30, "r-3")), _text(stub, _request(30, "r-3"))
        )
        assert first == second == generated_text(30)
        assert len(engine.submitted) == 3

    _run(
        check,
        authenticator=CombinedAuthenticator(ApiKeyAuthenticator(), _RedisKeys()),
        idempotency=IdempotencyCache(MemoryStore()),
    )


def test_per_key_request_limit_and_unknown_key() -> None:
    async def check(stub, engine) -> None:  # noqa: ANN001
        assert await _text(stub, _request(2)) == generated_text(2)
        assert await _text(stub, _request(2)) == generated_text(2)
        with pytest.raises(grpc.aio.AioRpcError) as limited:
            await _text(stub, _request(2))
        assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert any(name == "retry-after" for name, _ in limited.value.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await _text(stub, _request(2), key="other")
        assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(engine.submitted) == 2

    _run(
        check,
        authenticator=CombinedAuthenticator(ApiKeyAuthenticator(), _RedisKeys()),
        rate_limiter=RateLimiter(MemoryStore()),
    )
