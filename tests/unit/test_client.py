"""The Python client: request building, sync and asyncio streaming, errors, cancellation, keys.

Runs against a fake Router servicer on an in-process gRPC server (no model).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from protos.sluice.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.client import AsyncSluiceClient, SluiceClient, build_request, finish_reason_name


class FakeRouter(router_pb2_grpc.RouterServicer):
    """Streams the prompt back word by word; max_tokens given as 0 is INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()  # a call ended before its stream was complete
        self.completed = threading.Event()

    def Generate(self, request, context):  # noqa: ANN001, N802
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        context.add_callback(self._on_done(context))
        if request.params.HasField("max_tokens") and request.params.max_tokens == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1, got 0")
        words = self._words(request)
        for index, word in enumerate(words):
            if not context.is_active():
                return
            last = index == len(words) - 1
            yield router_pb2.GenerateResponse(
                text=word,
                token_ids=[index],
                request_id=request.request_id or "assigned",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=len(words))
                if last
                else None,
            )
            if request.params.min_tokens == 99:  # slow stream, for cancellation tests
                time.sleep(0.05)
        self.completed.set()

    def _on_done(self, context):  # noqa: ANN001, ANN202
        def done() -> None:
            if not self.completed.is_set():
                self.cancelled.set()

        return done

    @staticmethod
    def _words(request: router_pb2.GenerateRequest) -> list[str]:
        if request.HasField("chat"):
            text = " ".join(turn.content for turn in request.chat.messages)
        elif request.HasField("prompt_token_ids"):
            text = " ".join(str(i) for i in request.prompt_token_ids.ids)
        else:
            text = request.prompt
        words = text.split(" ")
        return [words[0], *(" " + word for word in words[1:])]

    def ListModels(self, request, context):  # noqa: ANN001, N802
        return router_pb2.ListModelsResponse(
            models=[router_pb2.ModelInfo(name="fake", context_length=128, vocab_size=10)]
        )


@contextlib.contextmanager
def fake_router() -> Iterator[tuple[str, FakeRouter]]:
    servicer = FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


def test_build_request_inputs_and_params() -> None:
    request = build_request("hi", max_tokens=5, temperature=0.0, stop="x", seed=None)
    assert request.WhichOneof("input") == "prompt" and request.prompt == "hi"
    assert request.params.HasField("max_tokens") and request.params.max_tokens == 5
    assert request.params.HasField("temperature") and request.params.temperature == 0.0
    assert not request.params.HasField("seed")
    assert list(request.params.stop) == ["x"]
    chat = build_request(chat=[{"role": "user", "content": "a"}, ("assistant", "b")])
    assert [(m.role, m.content) for m in chat.chat.messages] == [("user", "a"), ("assistant", "b")]
    ids = build_request(
        token_ids=[1, 2], adapter="sql", request_id="r1", priority=2, stop_token_ids=[7]
    )
    assert list(ids.prompt_token_ids.ids) == [1, 2]
    assert (ids.adapter, ids.request_id, ids.priority) == ("sql", "r1", 2)
    assert list(ids.params.stop_token_ids) == [7]


def test_build_request_refuses_ambiguous_input_and_unknown_params() -> None:
    with pytest.raises(TypeError):
        build_request()
    with pytest.raises(TypeError):
        build_request("a", token_ids=[1])
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        build_request("a", temprature=0.5)


def test_finish_reason_name() -> None:
    assert finish_reason_name(common_pb2.FINISH_REASON_STOP_STRING) == "stop_string"
    assert finish_reason_name(common_pb2.FINISH_REASON_LENGTH) == "length"


def test_sync_client_streams_lists_and_sends_the_key() -> None:
    with fake_router() as (address, servicer), SluiceClient(address, api_key="k1") as client:
        pieces = [r.text for r in client.generate("one two three", max_tokens=3)]
        assert pieces == ["one", " two", " three"]
        assert list(client.stream_text("a b")) == ["a", " b"]
        completion = client.complete(chat=[("user", "hello world")], request_id="abc")
        assert completion.text == "hello world"
        assert completion.finish_reason == "length"
        assert completion.token_ids == [0, 1]
        assert (completion.prompt_tokens, completion.completion_tokens) == (3, 2)
        assert completion.request_id == "abc"
        assert [m.name for m in client.list_models()] == ["fake"]
        assert servicer.metadata[0]["authorization"] == "Bearer k1"


def test_sync_client_errors_carry_the_status() -> None:
    with fake_router() as (address, _), SluiceClient(address) as client:
        with pytest.raises(grpc.RpcError) as caught:
            list(client.generate("x", max_tokens=0))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in caught.value.details()


def test_leaving_the_stream_early_cancels_the_call() -> None:
    with fake_router() as (address, servicer), SluiceClient(address) as client:
        stream = client.generate(" ".join(["w"] * 200), min_tokens=99)
        assert next(stream).text == "w"
        stream.close()
        assert servicer.cancelled.wait(5.0)
        assert not servicer.completed.is_set()


def test_async_client_streams_errors_and_lists() -> None:
    async def scenario(address: str) -> None:
        async with AsyncSluiceClient(address) as client:
            pieces = [r.text async for r in client.generate(token_ids=[4, 5, 6])]
            assert pieces == ["4", " 5", " 6"]
            assert [text async for text in client.stream_text("x y")] == ["x", " y"]
            completion = await client.complete("a b")
            assert completion.text == "a b" and completion.finish_reason == "length"
            assert [m.context_length for m in await client.list_models()] == [128]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.complete("x", max_tokens=0)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with fake_router() as (address, _):
        asyncio.run(scenario(address))
