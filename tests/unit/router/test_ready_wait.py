"""A request that arrives while the tokenizer restarts waits for it (up to ready_wait_s)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos.sluice.v1 import tokenizer_pb2_grpc
from tests.unit.router.router_fakes import FakeTokenizer, generated_text
from tests.unit.router.test_router_servicer import Stack, eventually, run_stack, text_request


async def restart_tokenizer(stack: Stack, after_s: float) -> grpc.aio.Server:
    await asyncio.sleep(after_s)
    port = int(stack.core.config.tokenizer.rpartition(":")[2])
    server = grpc.aio.server()
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(FakeTokenizer(), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


def test_a_request_waits_for_a_restarting_tokenizer() -> None:
    async def check(stack: Stack) -> None:
        await stack.tokenizer_server.stop(None)
        await eventually(lambda: not stack.core.serving, "router not serving")
        started = time.monotonic()
        restart = asyncio.ensure_future(restart_tokenizer(stack, 0.5))
        responses = await stack.collect(text_request(max_tokens=3))
        assert "".join(r.text for r in responses) == generated_text(3)
        assert time.monotonic() - started >= 0.5  # it waited for the tokenizer
        await (await restart).stop(None)

    run_stack(check, ready_wait_s=10.0, reconnect_min_backoff_s=0.05, reconnect_max_backoff_s=0.2)


def test_without_a_peer_within_the_wait_the_request_is_unavailable() -> None:
    async def check(stack: Stack) -> None:
        await stack.tokenizer_server.stop(None)
        await eventually(lambda: not stack.core.serving, "router not serving")
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=3))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no tokenizer is ready" in info.value.details()
        assert 0.3 <= time.monotonic() - started < 5.0

    run_stack(check, ready_wait_s=0.3, reconnect_min_backoff_s=0.05, reconnect_max_backoff_s=0.2)
