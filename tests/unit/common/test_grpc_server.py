"""The shared server maps domain errors to status codes and serves health and reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.sluice.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.common.errors import InvalidArgumentError, ResourceExhaustedError
from services.common.grpc_server import LIVENESS_SERVICE, RETRY_AFTER_KEY, start_server


class _Failing(tokenizer_pb2_grpc.TokenizerServicer):
    async def Tokenize(self, request, context):  # noqa: N802 - gRPC method name
        if request.items and request.items[0].text == "full":
            raise ResourceExhaustedError("queue is full", retry_after_s=1.5)
        if request.items and request.items[0].text == "bug":
            raise RuntimeError("secret internals")
        raise InvalidArgumentError("max_tokens must be >= 1")

    async def DetokenizeSession(self, request_iterator, context):  # noqa: N802
        async for _ in request_iterator:
            yield tokenizer_pb2.DetokenizeResponse(sequence_number=7)
            raise InvalidArgumentError("bad update")

    async def TokenizeSession(self, request_iterator, context):  # noqa: N802
        # A streaming handler that writes (not an async generator): errors map the same way.
        async for request in request_iterator:
            await context.write(tokenizer_pb2.TokenizeResponse(sequence_number=8))
            if request.items:
                raise RuntimeError("secret internals")
            raise ResourceExhaustedError("too many batches", retry_after_s=0.5)


def _run(coro):
    return asyncio.run(coro)


def test_errors_map_to_status_codes_and_health_flips() -> None:
    async def scenario() -> None:
        server = await start_server(
            "127.0.0.1:0",
            lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(_Failing(), s),
            ["sluice.v1.Tokenizer"],
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                check = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
                # Alive though not ready: what liveness probes ask.
                live = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE))
                assert live.status == health_pb2.HealthCheckResponse.SERVING
                await server.set_serving(True)
                check = await health.Check(
                    health_pb2.HealthCheckRequest(service="sluice.v1.Tokenizer")
                )
                assert check.status == health_pb2.HealthCheckResponse.SERVING

                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stub.Tokenize(tokenizer_pb2.TokenizeRequest())
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert bad.value.details() == "max_tokens must be >= 1"

                item = tokenizer_pb2.TokenizeItem(text="full")
                with pytest.raises(grpc.aio.AioRpcError) as full:
                    await stub.Tokenize(tokenizer_pb2.TokenizeRequest(items=[item]))
                assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                trailers = dict(full.value.trailing_metadata() or ())
                assert float(trailers[RETRY_AFTER_KEY]) == pytest.approx(1.5)

                item = tokenizer_pb2.TokenizeItem(text="bug")
                with pytest.raises(grpc.aio.AioRpcError) as bug:
                    await stub.Tokenize(tokenizer_pb2.TokenizeRequest(items=[item]))
                assert bug.value.code() == grpc.StatusCode.INTERNAL
                assert "secret" not in bug.value.details()

                call = stub.DetokenizeSession()
                await call.write(tokenizer_pb2.DetokenizeRequest(sequence_number=1))
                first = await call.read()
                assert first.sequence_number == 7
                with pytest.raises(grpc.aio.AioRpcError) as stream_error:
                    await call.read()
                assert stream_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

                for items, code in (([], "RESOURCE_EXHAUSTED"), ([item], "INTERNAL")):
                    call = stub.TokenizeSession()
                    await call.write(tokenizer_pb2.TokenizeRequest(items=items))
                    assert (await call.read()).sequence_number == 8
                    with pytest.raises(grpc.aio.AioRpcError) as writer_error:
                        await call.read()
                    assert writer_error.value.code().name == code
                    assert "secret" not in writer_error.value.details()

                reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
                responses = reflect.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
                names = set()
                async for response in responses:
                    names |= {s.name for s in response.list_services_response.service}
                assert "sluice.v1.Tokenizer" in names
                assert "grpc.health.v1.Health" in names
        finally:
            await server.stop(0)

    _run(scenario())
