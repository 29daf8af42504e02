"""The router in a real stack (separate processes, dummy:tiny model): admission and validation.

- A full queue answers RESOURCE_EXHAUSTED with a retry-after trailer within 50 ms (measured on
  the client), and the stack serves the next request normally.
- A request that could start only when a long running one ends is refused at once, the wait
  it is told near that request's remaining tokens at their pace.
- Bad parameters and an over-long prompt answer INVALID_ARGUMENT; the stack keeps serving.
"""

from __future__ import annotations

import re
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


def test_a_request_that_could_not_start_in_time_is_refused_with_the_wait_it_faces(
    stack_factory,
) -> None:
    """One sequence slot, a request of 1,500 tokens running on the default model: a new one
    would start when that ends, which the engine's finish profile tells the router (a finish
    rate measured on short requests would promise a slot within a fraction of a second)."""
    bound_s = 0.3
    stack = stack_factory(
        router_args=(*("--max-inflight-per-engine", "1", "--max-queue-delay-s", str(bound_s)),),
    )
    with grpc.insecure_channel(stack.router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for _ in range(3):  # finished requests: the engine has a finish rate to report
            list(stub.Generate(generate(max_tokens=4), timeout=60))
        running = stub.Generate(generate(max_tokens=1500), timeout=300)
        received = len(next(running).token_ids)
        started, counted = time.monotonic(), received
        while time.monotonic() - started < 0.8:  # the engine's rates fold in meanwhile
            received += len(next(running).token_ids)
        pace = (received - counted) / (time.monotonic() - started)
        left_s = (1500 - received) / pace
        assert left_s > 3 * bound_s, f"the long request ends too soon to test ({left_s:.2f}s)"
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate(max_tokens=3), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        told = float(re.search(r"wait about ([0-9.]+)s", info.value.details()).group(1))
        assert left_s / 2 < told < left_s * 2, (told, left_s)
        trailers = dict(info.value.trailing_metadata() or ())
        assert float(trailers["retry-after"]) >= 1.0
        running.cancel()
        deadline = time.monotonic() + 30
        while True:  # the slot frees once the cancel has reached the engine
            try:
                after = list(stub.Generate(generate(max_tokens=5), timeout=60))
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the slot never freed"
                time.sleep(0.1)
        assert sum(len(r.token_ids) for r in after) == 5
