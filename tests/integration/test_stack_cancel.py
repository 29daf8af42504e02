"""Cancelling streams through the real stack frees every KV block on the engine."""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from protos.sluice.v1 import engine_pb2, engine_pb2_grpc
from services.client import AsyncSluiceClient
from services.launcher import Stack

NUM_STREAMS = 50


def engine_free_blocks(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.EngineInfoRequest(), timeout=10)
    return info.load.free_blocks, info.num_blocks


def wait_for_free_blocks(address: str, expected: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    free, _ = engine_free_blocks(address)
    while free != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        free, _ = engine_free_blocks(address)
    return free


def test_cancel_fifty_streams_at_random_points_frees_all_blocks(stack: Stack) -> None:
    engine = stack.engine_addresses[0]
    initial, total = engine_free_blocks(engine)
    assert initial > 0 and total >= initial
    chooser = random.Random(1234)
    cancel_after = [chooser.randint(0, 6) for _ in range(NUM_STREAMS)]

    async def one(client: AsyncSluiceClient, index: int) -> int:
        received = 0
        prompt = f"Request {index}: tell me a long story about the number {index}."
        responses = client.generate(
            prompt, max_tokens=200, temperature=0.8, seed=index, ignore_eos=True
        )
        async for _ in responses:
            received += 1
            if received > cancel_after[index]:
                break
        await responses.aclose()  # cancels the call
        return received

    async def scenario() -> list[int]:
        async with AsyncSluiceClient(stack.router_address, timeout_s=120.0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_STREAMS)))

    received = asyncio.run(scenario())
    assert all(count >= 1 for count in received)
    assert wait_for_free_blocks(engine, initial) == initial
    # The stack still serves normally afterwards.
    from services.client import SluiceClient

    with SluiceClient(stack.router_address, timeout_s=60.0) as client:
        completion = client.complete("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert completion.completion_tokens == 4
    assert wait_for_free_blocks(engine, initial) == initial
