"""Tracing at the edges: off by default, and when on, the interceptor and the channel's spans.

Real grpc.aio servers (through `start_server`) and channels (through `open_channel`) with small
servicers; spans go to in-memory exporters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protos.sluice.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common import tracing
from services.common.errors import InvalidArgumentError, NotFoundError
from services.common.grpc_channel import open_channel
from services.common.grpc_server import start_server
from services.common.tracing.grpc_edges import TracedChannel
from services.common.tracing.runtime import Runtime


class FakeRouter(router_pb2_grpc.RouterServicer):
    async def Generate(self, request, context):  # noqa: N802
        if request.prompt == "unknown":
            raise NotFoundError("no such adapter")
        yield router_pb2.GenerateResponse(request_id="r7")  # headers-only piece: no tokens
        yield router_pb2.GenerateResponse(token_ids=[5], request_id="r7")
        yield router_pb2.GenerateResponse(token_ids=[6], request_id="r7")


class FakeEngine(engine_pb2_grpc.EngineServicer):
    async def EngineSession(self, request_iterator, context):  # noqa: N802
        step = 0
        live: list[str] = []
        async for request in request_iterator:
            live += [submit.request_id for submit in request.submits]
            for _ in range(2):  # every live request gets a token in each of two steps
                step += 1
                updates = [engine_pb2.SequenceUpdate(request_id=i, token_ids=[1]) for i in live]
                yield engine_pb2.EngineStep(step_index=step, updates=updates)


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    async def TokenizeSession(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:  # answered with context.write
            await context.write(
                tokenizer_pb2.TokenizeResponse(sequence_number=request.sequence_number)
            )

    async def DetokenizeSession(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:
            yield tokenizer_pb2.DetokenizeResponse(
                sequence_number=request.sequence_number,
                deltas=[tokenizer_pb2.TextDelta(request_id=u.request_id) for u in request.updates],
            )


def _register(server: grpc.aio.Server) -> None:
    router_pb2_grpc.add_RouterServicer_to_server(FakeRouter(), server)
    engine_pb2_grpc.add_EngineServicer_to_server(FakeEngine(), server)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(FakeTokenizer(), server)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[grpc.aio.Channel, str]]:
    running = await start_server("127.0.0.1:0", _register, ["sluice.v1.Router"])
    address = f"127.0.0.1:{running.port}"
    channel = open_channel(address)
    try:
        yield channel, address
    finally:
        await channel.close()
        await running.stop(0)


@pytest.fixture
def traced(monkeypatch):
    """Tracing on (as configure() leaves it) with in-memory exporters: (calls, hops)."""
    calls, hops = InMemorySpanExporter(), InMemorySpanExporter()
    runtime = Runtime(
        tracing.TracingConfig(trace_dir="unused", trace_sample_ratio=0.0),
        "sluice-test",
        exporters=(calls,),
        hop_exporters=(hops,),
    )
    monkeypatch.setattr(tracing, "_runtime", runtime)
    yield runtime, calls, hops
    runtime.shutdown()


def _by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    spans: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def test_off_by_default_nothing_is_wrapped() -> None:
    import importlib

    for module in ("grpc_edges", "jsonl", "runtime", "step_spans"):  # no name shadows the API
        importlib.import_module(f"services.common.tracing.{module}")
    config = tracing.TracingConfig()
    assert not config.enabled
    tracing.configure(config, "sluice-test")
    assert not tracing.enabled()
    assert tracing.server_interceptors() == ()
    assert tracing.step_hook() is None

    async def plain_channel() -> None:  # an aio channel belongs to a running loop
        channel = grpc.aio.insecure_channel("127.0.0.1:1")
        assert tracing.traced_channel(channel) is channel
        await channel.close()

    asyncio.run(plain_channel())
    with pytest.raises(InvalidArgumentError, match="trace_sample_ratio"):
        tracing.TracingConfig(trace_dir="x", trace_sample_ratio=1.5)


def test_settings_come_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SLUICE_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("SLUICE_TRACE_SAMPLE_RATIO", "0.25")
    config = tracing.TracingConfig.from_environment()
    assert config.enabled and config.trace_sample_ratio == 0.25
    assert config.trace_dir == str(tmp_path) and config.otlp_traces_endpoint == ""


def test_unsampled_calls_pass_through_and_record_nothing(traced) -> None:
    runtime, calls, _ = traced

    async def scenario() -> list[router_pb2.GenerateResponse]:
        async with serving() as (channel, _):
            stub = router_pb2_grpc.RouterStub(channel)
            responses = [r async for r in stub.Generate(router_pb2.GenerateRequest(prompt="hi"))]
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="unknown")):
                    pass
            assert failed.value.code() == grpc.StatusCode.NOT_FOUND  # still mapped
            return responses

    responses = asyncio.run(scenario())
    assert [list(r.token_ids) for r in responses] == [[], [5], [6]]  # passed through untouched
    runtime.force_flush()
    # Ratio 0 and no sampled parent: the client's span is not sampled, so neither is the
    # server's (its context says so), and nothing is recorded on either side.
    assert not calls.get_finished_spans()


def test_a_sampled_client_call_is_traced_on_both_sides(traced) -> None:
    runtime, calls, _ = traced
    # The client's own tracing samples every call (as the benchmark's probe does); the server
    # samples none of its own (ratio 0) but follows the client's decision.
    sampled = Runtime(tracing.TracingConfig(trace_dir="unused"), "sluice-probe", exporters=(calls,))

    async def scenario() -> None:
        async with serving() as (_, address):
            client = TracedChannel(grpc.aio.insecure_channel(address), sampled)
            stub = router_pb2_grpc.RouterStub(client)
            async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="hi")):
                pass
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="unknown")):
                    pass
            await client.close()

    asyncio.run(scenario())
    sampled.force_flush()
    runtime.force_flush()
    sampled.shutdown()
    spans = calls.get_finished_spans()
    clients = sorted((s for s in spans if s.kind.name == "CLIENT"), key=lambda s: s.start_time)
    servers = sorted((s for s in spans if s.kind.name == "SERVER"), key=lambda s: s.start_time)
    assert len(clients) == len(servers) == 2
    for client, server in zip(clients, servers, strict=True):
        assert server.name == client.name == "sluice.v1.Router/Generate"
        assert server.context.trace_id == client.context.trace_id
        assert server.parent.span_id == client.context.span_id
        assert client.start_time <= server.start_time <= server.end_time <= client.end_time
    ok_client, ok_server = clients[0], servers[0]
    assert ok_server.attributes["sluice.input"] == "prompt"
    assert ok_server.attributes["sluice.request_id"] == "r7"
    for span in (ok_client, ok_server):
        (event,) = span.events  # once, at the first response that carries tokens
        assert event.name == "first_token" and span.status.is_ok
    assert not servers[1].status.is_ok and not clients[1].status.is_ok
    assert not servers[1].events


def test_session_streams_record_first_token_hops_at_both_ends(traced) -> None:
    runtime, calls, hops = traced

    async def scenario() -> None:
        async with serving() as (channel, _):
            engine = engine_pb2_grpc.EngineStub(channel).EngineSession()
            await engine.write(
                engine_pb2.EngineRequest(submits=[engine_pb2.SubmitRequest(request_id="a")])
            )
            steps = [await engine.read(), await engine.read()]
            await engine.write(
                engine_pb2.EngineRequest(submits=[engine_pb2.SubmitRequest(request_id="b")])
            )
            steps += [await engine.read(), await engine.read()]
            assert [s.step_index for s in steps] == [1, 2, 3, 4]
            engine.cancel()
            tokenizer = tokenizer_pb2_grpc.TokenizerStub(channel)
            tokenize = tokenizer.TokenizeSession()
            await tokenize.write(tokenizer_pb2.TokenizeRequest(sequence_number=9))
            assert (await tokenize.read()).sequence_number == 9
            tokenize.cancel()
            detokenize = tokenizer.DetokenizeSession()
            first = tokenizer_pb2.DetokenizeUpdate(request_id="a", token_ids=[1])
            first.options.stop.append("x")  # a request's first update opens its state
            later = tokenizer_pb2.DetokenizeUpdate(request_id="b", token_ids=[1])
            await detokenize.write(
                tokenizer_pb2.DetokenizeRequest(sequence_number=1, updates=[first, later])
            )
            await detokenize.read()
            await detokenize.write(
                tokenizer_pb2.DetokenizeRequest(sequence_number=2, updates=[later])
            )
            await detokenize.read()
            detokenize.cancel()

    asyncio.run(scenario())
    runtime.force_flush()
    spans = _by_name(hops)

    def ids(name: str) -> list[tuple]:
        return [
            (
                tuple(s.attributes.get("sluice.request_ids", ())),
                s.attributes.get("sluice.step_index"),
            )
            for s in sorted(spans[name], key=lambda s: s.start_time)
        ]

    for end in ("sent", "received"):  # client and server see the same hops
        assert ids(f"EngineRequest {end}") == [(("a",), None), (("b",), None)]
        # Steps 2 and 4 carry no first token; step 3 carries b's first and a's third.
        assert ids(f"EngineStep {end}") == [(("a",), 1), (("b",), 3)]
        assert [
            s.attributes["sluice.sequence_number"] for s in spans[f"TokenizeRequest {end}"]
        ] == [9]
        assert [
            s.attributes["sluice.sequence_number"] for s in spans[f"TokenizeResponse {end}"]
        ] == [9]
        assert ids(f"DetokenizeRequest {end}") == [(("a",), None)]
        assert ids(f"DetokenizeResponse {end}") == [(("a",), None)]
    methods = {s.attributes["rpc.method"] for s in hops.get_finished_spans()}
    assert methods == {
        "/sluice.v1.Engine/EngineSession",
        "/sluice.v1.Tokenizer/TokenizeSession",
        "/sluice.v1.Tokenizer/DetokenizeSession",
    }
    assert not calls.get_finished_spans()  # session streams make no call spans


def test_every_service_takes_the_settings_as_flags(monkeypatch) -> None:
    from services.engine.worker_config import WorkerConfig
    from services.router.config import RouterSettings
    from services.tokenizer.config import settings_from_argv

    monkeypatch.setenv("SLUICE_TRACE_SAMPLE_RATIO", "0.5")  # a flag wins over the environment
    flags = ["--otlp-traces-endpoint", "http://collector:4317", "--trace-sample-ratio", "0.1"]
    expected = tracing.TracingConfig(
        otlp_traces_endpoint="http://collector:4317", trace_sample_ratio=0.1
    )
    assert RouterSettings.from_argv(flags).tracing == expected
    assert WorkerConfig.from_argv(["--model", "dummy:tiny", *flags]).tracing == expected
    assert settings_from_argv(flags)[1] == expected
    assert RouterSettings.from_argv([]).tracing == tracing.TracingConfig(trace_sample_ratio=0.5)


def test_configure_writes_json_lines_and_sends_only_call_spans_to_a_collector(
    tmp_path, monkeypatch
) -> None:
    from opentelemetry.exporter.otlp.proto.grpc import trace_exporter

    endpoints = []

    class Collector(InMemorySpanExporter):  # stands in for the OTLP exporter
        def __init__(self, endpoint: str) -> None:
            super().__init__()
            endpoints.append(endpoint)

    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", Collector)
    try:
        tracing.configure(
            tracing.TracingConfig(otlp_traces_endpoint="http://127.0.0.1:9"), "sluice-a"
        )
        assert endpoints == ["http://127.0.0.1:9"]
        assert tracing.enabled() and len(tracing.server_interceptors()) == 1
        assert tracing.step_hook() is None  # step and hop spans go to a trace directory only
        assert tracing._runtime.hops is None

        tracing.configure(tracing.TracingConfig(trace_dir=str(tmp_path)), "sluice-b")
        runtime = tracing._runtime
        hook = tracing.step_hook()
        hook(1_000, 2_000, 7, ["s1/r1"], 12)
        span = runtime.calls.start_span("sluice.v1.Router/Generate", start_time=500)
        span.add_event("first_token", timestamp=900)
        span.end(end_time=1_500)
    finally:
        tracing.shutdown()  # flushes
    assert not tracing.enabled()
    (path,) = tmp_path.glob("sluice-b-*.jsonl")
    lines = {line["name"]: line for line in map(json.loads, path.read_text().splitlines())}
    step = lines["engine step"]
    assert (step["start_ns"], step["end_ns"], step["service"]) == (1_000, 2_000, "sluice-b")
    assert step["attributes"] == {
        "sluice.step_index": 7,
        "sluice.request_ids": ["s1/r1"],
        "sluice.batched_tokens": 12,
    }
    call = lines["sluice.v1.Router/Generate"]
    assert call["events"] == [{"name": "first_token", "time_ns": 900, "attributes": {}}]
    assert len(call["trace_id"]) == 32 and call["parent_span_id"] is None
