"""The tokenizer service over the wire: Tokenize, DetokenizeSession, Info, health, reflection.

Most tests run the real grpc.aio server in-process on a free loopback port (with the tokenizer
loaded once per module); one starts it as a subprocess the way `sluice serve tokenizer` does.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.sluice.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import start
from services.tokenizer.tokenize import TokenizerModel

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model() -> TokenizerModel:
    return TokenizerModel.load(None)


def _run_with_server(
    model: TokenizerModel,
    scenario: Callable[[grpc.aio.Channel], Awaitable[None]],
    **config_fields,
) -> None:
    async def main() -> None:
        config = TokenizerConfig(port=0, **config_fields)
        server = await start(config, model)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                await scenario(channel)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_tokenize_batch_with_per_item_errors(model) -> None:
    chat = common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content="What is the capital of France?")]
    )

    async def scenario(channel) -> None:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        response = await stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(
                items=[
                    tokenizer_pb2.TokenizeItem(text="Hello world"),
                    tokenizer_pb2.TokenizeItem(text=""),
                    tokenizer_pb2.TokenizeItem(chat=chat),
                    tokenizer_pb2.TokenizeItem(text="one two three four five", max_prompt_tokens=2),
                    tokenizer_pb2.TokenizeItem(),
                ]
            )
        )
        results = response.results
        assert len(results) == 5
        assert list(results[0].token_ids) == model.hf_tokenizer.encode("Hello world")
        assert results[1].error.code == "INVALID_ARGUMENT"
        assert not results[2].error.code
        rendered = model.render_chat(
            [{"role": "user", "content": "What is the capital of France?"}]
        )
        assert list(results[2].token_ids) == model.encode_text(rendered, False)
        assert results[3].error.code == "INVALID_ARGUMENT"
        assert re.search(r"prompt is \d+ tokens", results[3].error.message)
        assert results[4].error.code == "INVALID_ARGUMENT"

    _run_with_server(model, scenario)


def test_too_many_items_is_invalid_argument(model) -> None:
    async def scenario(channel) -> None:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        items = [tokenizer_pb2.TokenizeItem(text="x")] * 3
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(items=items))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    _run_with_server(model, scenario, max_batch_items=2)


def test_tokenize_session_answers_every_batch_by_sequence_number(model) -> None:
    long_text = "All work and no play makes a dull model. " * 80  # encoded off the event loop
    batches = {
        1: ["Hello world", "What is the capital of France?"],
        2: [long_text],
        3: ["x"] * 3,  # over max_batch_items: refused, the stream goes on
        4: ["", "one two three"],  # an item error fails that item only
        5: ["short after long"],
    }

    async def scenario(channel) -> None:
        call = tokenizer_pb2_grpc.TokenizerStub(channel).TokenizeSession()
        for number, texts in batches.items():
            items = [tokenizer_pb2.TokenizeItem(text=t) for t in texts]
            await call.write(tokenizer_pb2.TokenizeRequest(items=items, sequence_number=number))
        await call.done_writing()
        answers = {}
        async for response in call:
            assert response.sequence_number not in answers  # each batch answered once
            answers[response.sequence_number] = response
        assert sorted(answers) == sorted(batches)
        for number in (1, 2, 5):
            got = [list(r.token_ids) for r in answers[number].results]
            assert got == [model.hf_tokenizer.encode(t) for t in batches[number]]
        assert answers[3].error.code == "INVALID_ARGUMENT" and not answers[3].results
        assert "at most 2 items" in answers[3].error.message
        first, second = answers[4].results
        assert first.error.code == "INVALID_ARGUMENT"
        assert list(second.token_ids) == model.hf_tokenizer.encode("one two three")
        assert await call.code() == grpc.StatusCode.OK

    _run_with_server(model, scenario, max_batch_items=2)


def test_detokenize_session_multiplexes_requests_with_stops_and_unicode(model) -> None:
    texts = {
        "emoji": "Bonjour 😀👍🏽 🇫🇷 ok",
        "cjk": " 世界你好。日本語",
        "stop": "The answer is Paris. Human: next question",
    }
    ids = {rid: model.encode_text(text, False) for rid, text in texts.items()}

    async def scenario(channel) -> None:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        requests: asyncio.Queue = asyncio.Queue()

        async def outbound():
            while True:
                message = await requests.get()
                if message is None:
                    return
                yield message

        call = stub.DetokenizeSession(outbound())
        received = dict.fromkeys(texts, "")
        closed: dict[str, tokenizer_pb2.TextDelta] = {}
        longest = max(len(v) for v in ids.values())
        for step in range(longest + 1):
            updates = []
            for rid, token_ids in ids.items():
                if rid in closed:
                    continue
                update = tokenizer_pb2.DetokenizeUpdate(
                    request_id=rid, token_ids=token_ids[step : step + 1]
                )
                if step == 0:
                    update.options.stop.append(" Human:")
                update.finished = step + 1 >= len(token_ids)
                updates.append(update)
            updates.append(tokenizer_pb2.DetokenizeUpdate(request_id="ghost", token_ids=[5]))
            await requests.put(
                tokenizer_pb2.DetokenizeRequest(updates=updates, sequence_number=step)
            )
            response = await call.read()
            assert response.sequence_number == step
            for delta in response.deltas:
                if delta.request_id == "ghost":
                    assert delta.error.code == "NOT_FOUND"
                    continue
                assert "\ufffd" not in delta.text
                received[delta.request_id] += delta.text
                if delta.closed:
                    closed[delta.request_id] = delta
            if len(closed) == len(texts):
                break
        await requests.put(None)
        assert await call.read() == grpc.aio.EOF
        assert received["emoji"] == texts["emoji"]
        assert received["cjk"] == texts["cjk"]
        assert received["stop"] == "The answer is Paris."
        assert closed["stop"].stop_hit and closed["stop"].matched_stop == " Human:"
        assert not closed["emoji"].stop_hit

    _run_with_server(model, scenario)


def test_info_health_and_reflection(model) -> None:
    async def scenario(channel) -> None:
        info = await tokenizer_pb2_grpc.TokenizerStub(channel).Info(
            tokenizer_pb2.TokenizerInfoRequest()
        )
        assert info.model == model.name
        assert info.vocab_size == model.vocab_size
        assert list(info.eos_token_ids) == list(model.eos_token_ids)
        assert info.has_chat_template
        assert info.tokenize_session  # routers use the stream
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "sluice.v1.Tokenizer"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for reply in reflection.ServerReflectionInfo(ask()):
            names = {s.name for s in reply.list_services_response.service}
            assert "sluice.v1.Tokenizer" in names
            assert "grpc.health.v1.Health" in names
            break

    _run_with_server(model, scenario)


def test_server_runs_as_a_subprocess_and_stops_on_sigterm() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.tokenizer.server",
            "--port",
            "0",
            "--shutdown-grace-s",
            "1",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        address = None
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            found = re.search(r"tokenizer listening on (\S+)", line)
            if found:
                address = found.group(1)
                break
        assert address, f"no ready line; stderr: {process.stderr.read()[-2000:]}"
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="sluice.v1.Tokenizer"), timeout=10
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            response = tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(
                tokenizer_pb2.TokenizeRequest(items=[tokenizer_pb2.TokenizeItem(text="Hi there")]),
                timeout=10,
            )
            assert len(response.results[0].token_ids) >= 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
