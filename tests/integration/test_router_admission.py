"""The router in a real stack (separate processes, dummy:tiny model): admission and validation.

- A full queue answers RESOURCE_EXHAUSTED with a retry-after trailer within 50 ms (measured on
  the client), and the stack serves the next request normally.
- Bad parameters and an over-long prompt answer INVALID_ARGUMENT; the stack keeps serving.
"""

from __future__ import annotations

import statistics
import threading
import time

import grpc
import pytest

from protos.sluice.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow


def generate(prompt: str = "Hello", **params) -> router_pb2.GenerateRequest:
    values = {"temperature": 0.0, "ignore_eos": True, **params}
    return router_pb2.GenerateRequest(prompt=prompt, params=common_pb2.SamplingParams(**values))


def test_queue_overflow_and_bad_requests(stack_factory) -> None:
    stack = stack_factory(
        model="dummy:tiny",
        # the delay bound off in effect: the queued request waits for the whole long one,
        # and this test is about the count bound
        router_args=(
            *("--max-inflight-per-engine", "1", "--max-queued-requests", "1"),
            *("--max-queue-delay-s", "600"),
        ),
    )
    with grpc.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        warm = list(stub.Generate(generate(max_tokens=2), timeout=60))
        assert warm[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

        # One long stream occupies the only engine slot, a second waits in the queue.
        running = stub.Generate(generate(max_tokens=1500), timeout=120)
        assert next(running).token_ids
        queued_result: list = []
        queued = threading.Thread(
            target=lambda: queued_result.extend(stub.Generate(generate(max_tokens=3), timeout=120))
        )
        queued.start()
        # The third and later requests are rejected at once (median of 5, measured here).
        deadline = time.monotonic() + 10
        rejections: list[tuple[grpc.RpcError, float]] = []
        while time.monotonic() < deadline and len(rejections) < 5:
            started = time.perf_counter()
            try:
                list(stub.Generate(generate(max_tokens=3), timeout=30))
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    rejections.append((error, time.perf_counter() - started))
            time.sleep(0.01)
        assert len(rejections) == 5, "the queue never overflowed"
        elapsed = statistics.median(seconds for _, seconds in rejections)
        assert elapsed < 0.050, f"rejection took {elapsed * 1e3:.1f} ms (median)"
        for error, _ in rejections:
            trailers = dict(error.trailing_metadata() or ())
            assert float(trailers["retry-after"]) > 0

        running.cancel()
        queued.join(timeout=60)
        assert queued_result and queued_result[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        after = list(stub.Generate(generate(max_tokens=4), timeout=60))
        assert sum(len(r.token_ids) for r in after) == 4

        # Bad parameters, an over-long prompt, bad token ids: INVALID_ARGUMENT, nothing else.
        bad = [
            generate(max_tokens=0),
            generate(temperature=-0.5),
            generate(top_p=0.0),
            generate(logprobs=99),
            generate("word " * 5000, max_tokens=1),
            generate(max_tokens=100_000),
            router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1] * 5000)),
            router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[10**9])),
        ]
        for request in bad:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        after = list(stub.Generate(generate(max_tokens=5), timeout=60))
        assert sum(len(r.token_ids) for r in after) == 5
        assert after[-1].usage.completion_tokens == 5
