"""SIGTERM to the router with streams in flight: they finish, new calls get UNAVAILABLE, it exits 0.

Also: an engine that goes away ends its in-flight streams with UNAVAILABLE (never a hang).
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from protos.sluice.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow


def generate(max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        prompt="Once upon a time",
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def stream_in_thread(stub, max_tokens: int, results: list, first_token: threading.Event):
    def run() -> None:
        try:
            responses = []
            for response in stub.Generate(generate(max_tokens), timeout=120):
                responses.append(response)
                first_token.set()
            results.append(responses)
        except grpc.RpcError as error:
            results.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sigterm_drains_in_flight_streams(stack_factory) -> None:
    stack = stack_factory(model="dummy:tiny", router_args=("--shutdown-grace-s", "60"))
    max_tokens = 600
    with grpc.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        results: list = []
        events = [threading.Event() for _ in range(4)]
        threads = [stream_in_thread(stub, max_tokens, results, e) for e in events]
        for event in events:
            assert event.wait(60)
        stack.router.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate(2), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        for thread in threads:
            thread.join(timeout=90)
        assert len(results) == 4
        for responses in results:
            assert not isinstance(responses, grpc.RpcError), responses
            assert sum(len(r.token_ids) for r in responses) == max_tokens
            assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert stack.router.process.wait(timeout=30) == 0


def test_engine_loss_ends_streams_with_unavailable(stack_factory) -> None:
    stack = stack_factory(model="dummy:tiny")
    with grpc.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        results: list = []
        first = threading.Event()
        thread = stream_in_thread(stub, 1800, results, first)
        assert first.wait(60)
        stack.engines[0].process.kill()
        killed_at = time.monotonic()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert time.monotonic() - killed_at < 10
        assert isinstance(results[0], grpc.RpcError)
        assert results[0].code() == grpc.StatusCode.UNAVAILABLE
