"""The router servicer end to end over real gRPC, against in-process fake engine/tokenizer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from protos.sluice.v1 import (
    common_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from services.router.config import RouterConfig
from services.router.server import shutdown, start
from tests.unit.router.router_fakes import FakeEngine, FakeTokenizer, generated_text, start_fake


class Stack:
    def __init__(self, engine: FakeEngine, tokenizer: FakeTokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer

    def params(self, **kwargs) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=0.0, **kwargs)

    async def collect(self, request: router_pb2.GenerateRequest, **kwargs):
        return [r async for r in self.stub.Generate(request, **kwargs)]


def run_stack(
    test: Callable[[Stack], Awaitable[None]],
    *,
    engine: FakeEngine | None = None,
    tokenizer: FakeTokenizer | None = None,
    **config_fields,
) -> None:
    async def scenario() -> None:
        fake_engine = engine or FakeEngine()
        fake_tokenizer = tokenizer or FakeTokenizer()
        engine_server, engine_port = await start_fake(
            fake_engine, engine_pb2_grpc.add_EngineServicer_to_server
        )
        tokenizer_server, tokenizer_port = await start_fake(
            fake_tokenizer, tokenizer_pb2_grpc.add_TokenizerServicer_to_server
        )
        config = RouterConfig(
            port=0,
            engines=(f"127.0.0.1:{engine_port}",),
            tokenizer=f"127.0.0.1:{tokenizer_port}",
            **config_fields,
        )
        core, server = await start(config)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        stack = Stack(fake_engine, fake_tokenizer)
        stack.core, stack.server, stack.channel = core, server, channel
        stack.engine_server, stack.tokenizer_server = engine_server, tokenizer_server
        stack.stub = router_pb2_grpc.RouterStub(channel)
        stack.health = health_pb2_grpc.HealthStub(channel)
        try:
            for _ in range(200):
                if core.serving:
                    break
                await asyncio.sleep(0.01)
            assert core.serving
            await test(stack)
        finally:
            await channel.close()
            await shutdown(core, server, 1.0)
            await engine_server.stop(None)
            await tokenizer_server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Wait until `condition()` holds (polling), instead of guessing how long the stack needs."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.005)


def text_request(prompt: str = "hi", **params) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        prompt=prompt, params=common_pb2.SamplingParams(**{"temperature": 0.0, **params})
    )


def test_streams_one_response_per_step_with_usage() -> None:
    async def check(stack: Stack) -> None:
        responses = await stack.collect(text_request("hello", max_tokens=7))
        assert "".join(r.text for r in responses) == generated_text(7)
        assert sum(len(r.token_ids) for r in responses) == 7
        last = responses[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 7)
        assert all(r.finish_reason == 0 for r in responses[:-1])
        assert stack.core.active == set() and stack.core.running == {}
        assert stack.tokenizer.state == {}

    run_stack(check)


def test_response_headers_arrive_before_the_first_token() -> None:
    """The router sends a stream's headers as the call starts, so a client has read them (and
    asked for the first message) by the time the first token comes: one wake-up less on the
    first token's path. With 0.4 s engine steps the headers must come well before the token."""

    async def check(stack: Stack) -> None:
        call = stack.stub.Generate(text_request("hello", max_tokens=2))
        began = time.monotonic()
        await call.initial_metadata()
        headers_s = time.monotonic() - began
        first = await call.read()
        first_s = time.monotonic() - began
        assert first.token_ids and headers_s < first_s
        assert headers_s < 0.3 <= first_s, (headers_s, first_s)
        last = first
        while (response := await call.read()) is not grpc.aio.EOF:
            last = response
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH

    run_stack(check, engine=FakeEngine(step_s=0.4))


def test_adaptive_pacing_gathers_tokens_above_the_message_budget() -> None:
    async def check(stack: Stack) -> None:
        requests = [text_request(f"p{i}", max_tokens=400) for i in range(4)]
        results = await asyncio.gather(*(stack.collect(r) for r in requests))
        for responses in results:
            assert "".join(r.text for r in responses) == generated_text(400)  # nothing lost
            assert len(responses[0].token_ids) == 1  # the first token goes at once
            assert max(len(r.token_ids) for r in responses) <= 4  # --stream-max-interval
            assert len(responses) < 400 * 0.6  # several tokens per response, once measured
        assert stack.core.pacing.interval == 4
        await eventually(  # the sweep publishes it for operators
            lambda: REGISTRY.get_sample_value("sluice_router_stream_interval") == 4,
            "the interval gauge published",
        )
        assert REGISTRY.get_sample_value("sluice_router_streamed_tokens_per_second") > 100

    # 4 streams of a step every 2 ms against a budget of 100 responses/s: interval capped at 4.
    run_stack(
        check,
        engine=FakeEngine(max_model_len=1024),
        stream_message_budget=100.0,
        stream_max_interval=4,
    )


def test_adaptive_pacing_never_holds_a_token_past_the_hold_limit() -> None:
    async def check(stack: Stack) -> None:
        responses = await stack.collect(text_request("slow", max_tokens=8))
        assert "".join(r.text for r in responses) == generated_text(8)
        # A step every 150 ms is over the budget of 1 response/s (interval 8), but no token
        # may wait more than 20 ms for the next one: each goes out on its own.
        assert [len(r.token_ids) for r in responses] == [1] * 8

    run_stack(
        check,
        engine=FakeEngine(step_s=0.15),
        stream_message_budget=1.0,
        stream_max_interval=8,
        stream_max_hold_ms=20.0,
    )


def test_fixed_stream_interval_gathers_that_many_tokens() -> None:
    async def check(stack: Stack) -> None:
        responses = await stack.collect(text_request("hello", max_tokens=10))
        assert "".join(r.text for r in responses) == generated_text(10)
        assert [len(r.token_ids) for r in responses] == [1, 3, 3, 3]

    run_stack(check, stream_interval=3)


def test_chat_and_token_id_inputs_and_list_models() -> None:
    async def check(stack: Stack) -> None:
        chat = router_pb2.GenerateRequest(
            chat=common_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role="user", content="x")]
            ),
            params=stack.params(max_tokens=3),
            request_id="mine",
        )
        responses = await stack.collect(chat)
        assert responses[-1].usage.prompt_tokens == 1
        assert {r.request_id for r in responses} == {"mine"}
        ids = router_pb2.GenerateRequest(
            prompt_token_ids=common_pb2.TokenIds(ids=[70, 71]), params=stack.params(max_tokens=2)
        )
        assert "".join(r.text for r in await stack.collect(ids)) == "ab"
        models = await stack.stub.ListModels(router_pb2.ListModelsRequest())
        assert models.models[0].name == "fake" and models.models[0].context_length == 128

    run_stack(check)


def test_logprobs_only_when_asked() -> None:
    async def check(stack: Stack) -> None:
        asked = await stack.collect(text_request(max_tokens=4, logprobs=1))
        logprobs = [lp for r in asked for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == [t for r in asked for t in r.token_ids]
        assert all(lp.logprob == -0.5 for lp in logprobs) and len(logprobs) == 4
        plain = await stack.collect(text_request(max_tokens=4))
        assert all(not r.logprobs for r in plain)

    run_stack(check)


def test_stop_string_ends_stream_and_aborts_engine() -> None:
    async def check(stack: Stack) -> None:
        responses = await stack.collect(text_request(max_tokens=50, stop=["def"]))
        assert "".join(r.text for r in responses) == "abc"
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP_STRING
        assert responses[-1].matched_stop == "def"
        await eventually(lambda: not stack.engine.live, "engine sequence released")
        assert len(stack.engine.aborted) == 1

    run_stack(check)


@pytest.mark.parametrize(
    ("request_message", "code"),
    [
        (text_request(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        (text_request(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
        (text_request(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
        (text_request("x" * 200, max_tokens=1), grpc.StatusCode.INVALID_ARGUMENT),
        (text_request("x" * 100, max_tokens=100), grpc.StatusCode.INVALID_ARGUMENT),
        (text_request(""), grpc.StatusCode.INVALID_ARGUMENT),
        (router_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
        (
            router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1, 999])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (router_pb2.GenerateRequest(prompt="a", adapter="nope"), grpc.StatusCode.NOT_FOUND),
        (
            router_pb2.GenerateRequest(prompt="a", request_id="x" * 300),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_bad_requests_get_clear_status_and_stack_keeps_serving(request_message, code) -> None:
    async def check(stack: Stack) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(request_message)
        assert info.value.code() == code
        assert info.value.details()
        ok = await stack.collect(text_request(max_tokens=2))
        assert ok[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run_stack(check)


def test_queue_overflow_rejects_fast_with_retry_after() -> None:
    slow = FakeEngine(step_s=0.05)

    async def check(stack: Stack) -> None:
        first = asyncio.ensure_future(stack.collect(text_request(max_tokens=6)))
        await eventually(lambda: len(stack.engine.submitted) == 1, "first request on the engine")
        second = asyncio.ensure_future(stack.collect(text_request(max_tokens=2)))
        await eventually(lambda: len(stack.core.queue) == 1, "second request queued")
        started = time.perf_counter()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=2))
        elapsed = time.perf_counter() - started
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(info.value.trailing_metadata() or ())
        assert float(trailers["retry-after"]) >= 0.25
        assert elapsed < 0.2  # in-process; the 50 ms bound is checked across processes
        assert (await first)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (await second)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run_stack(
        check, engine=slow, max_inflight_per_engine=1, max_queued_requests=1, retry_after_s=0.25
    )


def test_deadline_while_queued_never_reaches_engine() -> None:
    slow = FakeEngine(step_s=0.05)

    async def check(stack: Stack) -> None:
        first = asyncio.ensure_future(stack.collect(text_request(max_tokens=8)))
        await eventually(lambda: len(stack.engine.submitted) == 1, "first request on the engine")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=2), timeout=0.1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(0.05)
        assert len(stack.core.queue) == 0
        await first
        assert len(stack.engine.submitted) == 1

    run_stack(check, engine=slow, max_inflight_per_engine=1)


def test_deadline_while_running_aborts_on_engine() -> None:
    async def check(stack: Stack) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=100), timeout=0.15)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(
            lambda: not (stack.engine.live or stack.core.active or stack.tokenizer.state),
            "engine, router and tokenizer state released",
        )
        assert stack.engine.live == {} and len(stack.engine.aborted) == 1
        assert stack.core.active == set() and stack.tokenizer.state == {}

    run_stack(check, engine=FakeEngine(step_s=0.01))


def test_client_cancel_aborts_on_engine_and_frees_detokenizer() -> None:
    slow = FakeEngine(step_s=0.01)

    async def check(stack: Stack) -> None:
        call = stack.stub.Generate(text_request(max_tokens=120))
        seen = 0
        async for _ in call:
            seen += 1
            if seen == 3:
                break
        call.cancel()
        await eventually(
            lambda: not (stack.engine.live or stack.core.active or stack.tokenizer.state),
            "engine, router and tokenizer state released",
        )
        assert stack.engine.live == {}
        assert len(stack.engine.aborted) == 1
        assert stack.tokenizer.cancelled == stack.engine.aborted
        assert stack.core.running == {} and stack.core.active == set()

    run_stack(check, engine=slow)


def test_engine_gone_fails_in_flight_with_unavailable() -> None:
    async def check(stack: Stack) -> None:
        call = stack.stub.Generate(text_request(max_tokens=100))
        await call.read()
        await stack.engine_server.stop(None)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 1.0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=2))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        health = await stack.health.Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING

    run_stack(check, engine=FakeEngine(step_s=0.02))


def test_router_reconnects_when_the_engine_comes_back() -> None:
    async def check(stack: Stack) -> None:
        port = int(stack.core.config.engines[0].rpartition(":")[2])
        await stack.engine_server.stop(None)
        for _ in range(200):
            if not stack.core.serving:
                break
            await asyncio.sleep(0.01)
        assert not stack.core.serving
        server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(FakeEngine(), server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        try:
            for _ in range(300):
                if stack.core.serving:
                    break
                await asyncio.sleep(0.01)
            assert stack.core.serving
            responses = await stack.collect(text_request(max_tokens=3))
            assert "".join(r.text for r in responses) == generated_text(3)
            health = await stack.health.Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(None)

    run_stack(check, reconnect_min_backoff_s=0.05, reconnect_max_backoff_s=0.2)


@pytest.mark.parametrize("sessions", [True, False], ids=["session", "unary-fallback"])
def test_prompts_of_one_loop_turn_share_one_tokenize_batch(sessions: bool) -> None:
    async def check(stack: Stack) -> None:
        client = stack.core.tokenizer
        items = [tokenizer_pb2.TokenizeItem(text=f"p{i}") for i in range(6)]
        results = await asyncio.gather(*(client.tokenize(item) for item in items))
        assert results == [[ord("p"), ord(str(i))] for i in range(6)]
        assert stack.tokenizer.tokenize_batches == [6]
        # A batch the tokenizer rejects as a whole is retried item by item.
        items.append(tokenizer_pb2.TokenizeItem(text="REJECT-BATCH"))
        results = await asyncio.gather(
            *(client.tokenize(item) for item in items), return_exceptions=True
        )
        assert results[:6] == [[ord("p"), ord(str(i))] for i in range(6)]
        assert isinstance(results[6], InvalidArgumentError)
        assert stack.tokenizer.tokenize_batches[1:] == [7] + [1] * 7
        # The stream when the tokenizer's Info offers it; else Tokenize calls.
        assert client.clients[0].tokenize_session_supported is sessions
        assert stack.tokenizer.tokenize_calls == (0 if sessions else 9)
        responses = await stack.collect(text_request(max_tokens=3))
        assert "".join(r.text for r in responses) == generated_text(3)

    run_stack(check, tokenizer=FakeTokenizer(sessions=sessions))


class SilentTokenizer(FakeTokenizer):
    """Takes TokenizeSession batches and never answers them."""

    async def TokenizeSession(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:
            self.tokenize_batches.append(len(request.items))
        if False:  # an async generator that yields nothing
            yield


def test_a_prompt_the_tokenizer_never_answers_fails_at_its_deadline() -> None:
    async def check(stack: Stack) -> None:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await stack.core.tokenizer.tokenize(tokenizer_pb2.TokenizeItem(text="hi"), 0.2)
        assert 0.15 < time.monotonic() - started < 1.5
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=2), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stack.engine.submitted == []

    run_stack(check, tokenizer=SilentTokenizer())


def test_prompts_waiting_on_a_lost_tokenizer_fail_unavailable_and_the_session_reopens() -> None:
    async def check(stack: Stack) -> None:
        client = stack.core.tokenizer
        waiting = asyncio.ensure_future(client.tokenize(tokenizer_pb2.TokenizeItem(text="hi")))
        await eventually(lambda: stack.tokenizer.tokenize_batches == [1], "the batch sent")
        started = time.monotonic()
        await stack.tokenizer_server.stop(None)
        with pytest.raises(UnavailableError):
            await waiting
        assert time.monotonic() - started < 2.0  # failed with the session, not at its timeout
        await eventually(lambda: not stack.core.serving, "router not serving")
        port = int(stack.core.config.tokenizer.rpartition(":")[2])
        server = grpc.aio.server()
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(FakeTokenizer(), server)
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        await server.start()
        try:
            await eventually(lambda: stack.core.serving, "router serving again")
            assert client.clients[0].tokenize_session_supported
            responses = await stack.collect(text_request(max_tokens=3))
            assert "".join(r.text for r in responses) == generated_text(3)
        finally:
            await server.stop(None)

    run_stack(
        check,
        tokenizer=SilentTokenizer(),
        tokenize_timeout_s=30.0,
        reconnect_min_backoff_s=0.05,
        reconnect_max_backoff_s=0.2,
    )


def test_api_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("secret-1\n")

    async def check(stack: Stack) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=1))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=1), metadata=(("x-api-key", "nope"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", "Bearer secret-1"),)
        responses = await stack.collect(text_request(max_tokens=1), metadata=good)
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run_stack(check, api_keys_file=str(keys))


def test_drain_finishes_in_flight_and_refuses_new() -> None:
    async def check(stack: Stack) -> None:
        running = asyncio.ensure_future(stack.collect(text_request(max_tokens=30)))
        await eventually(lambda: stack.core.running, "the first request on the engine")
        drain = asyncio.ensure_future(stack.core.drain(5.0))
        await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stack.collect(text_request(max_tokens=2))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        responses = await running
        assert "".join(r.text for r in responses) == generated_text(30)
        assert await drain is True
        health = await stack.health.Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING

    run_stack(check, engine=FakeEngine(step_s=0.01))
