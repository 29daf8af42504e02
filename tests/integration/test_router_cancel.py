"""Cancelling 50 streams at random points through the router frees every KV block on the engine."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from protos.sluice.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow


def free_blocks(engine_address: str) -> int:
    with grpc.insecure_channel(engine_address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.EngineInfoRequest(), timeout=10)
    return info.load.free_blocks


def test_cancel_50_streams_frees_engine_blocks(stack_factory) -> None:
    stack = stack_factory(model="dummy:tiny")
    engine_address = stack.engine_addresses[0]
    initial = free_blocks(engine_address)
    rng = random.Random(3)
    with grpc.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        calls = []
        for index in range(50):
            params = common_pb2.SamplingParams(max_tokens=400, temperature=0.8, ignore_eos=True)
            prompt = f"Story number {index}: " + "once upon a time " * rng.randint(1, 40)
            calls.append(
                (stub.Generate(router_pb2.GenerateRequest(prompt=prompt, params=params)), index)
            )
        next(calls[0][0])
        assert free_blocks(engine_address) < initial  # the streams hold KV blocks now
        rng.shuffle(calls)
        for call, _ in calls:
            for _ in range(rng.randint(0, 5)):
                next(call)
            call.cancel()
        # The stack still serves, and every block comes back.
        done = list(
            stub.Generate(
                router_pb2.GenerateRequest(
                    prompt="after", params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)
                ),
                timeout=60,
            )
        )
        assert done[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and free_blocks(engine_address) != initial:
        time.sleep(0.1)
    assert free_blocks(engine_address) == initial
