"""The OpenAI-compatible HTTP front end to end over real HTTP, against in-process fakes.

The router core, its gRPC server and the HTTP front run on this test's loop; the fake engine
generates 'a', 'b', 'c', ... one token per step (tests/unit/router/router_fakes.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from protos.sluice.v1 import engine_pb2_grpc, tokenizer_pb2_grpc
from services.common.redis_store import MemoryStore
from services.router.config import RouterConfig
from services.router.idempotency import IdempotencyCache
from services.router.openai_http.app import HttpFront
from services.router.server import shutdown, start
from tests.unit.router.router_fakes import FakeEngine, FakeTokenizer, generated_text, start_fake


class Front:
    def __init__(
        self, engine: FakeEngine, session: aiohttp.ClientSession, base: str, grpc_port: int
    ) -> None:
        self.engine, self.session, self.base, self.grpc_port = engine, session, base, grpc_port

    async def post(self, path: str, body: object, **kwargs) -> tuple[int, dict, dict]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with self.session.post(self.base + path, data=data, **kwargs) as response:
            return response.status, await response.json(), dict(response.headers)

    async def events(self, path: str, body: dict, **kwargs) -> list:
        async with self.session.post(self.base + path, json=body, **kwargs) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = (await response.read()).decode()
        assert raw.endswith("data: [DONE]\n\n")
        events = [line[len("data: ") :] for line in raw.split("\n\n") if line]
        return [json.loads(e) for e in events[:-1]] + [events[-1]]


def run_front(
    test: Callable[[Front], Awaitable[None]],
    *,
    engine: FakeEngine | None = None,
    core_options: dict | None = None,
    **fields,
) -> None:
    async def scenario() -> None:
        fake_engine = engine or FakeEngine()
        engine_server, engine_port = await start_fake(
            fake_engine, engine_pb2_grpc.add_EngineServicer_to_server
        )
        tokenizer_server, tokenizer_port = await start_fake(
            FakeTokenizer(), tokenizer_pb2_grpc.add_TokenizerServicer_to_server
        )
        config = RouterConfig(
            port=0,
            engines=(f"127.0.0.1:{engine_port}",),
            tokenizer=f"127.0.0.1:{tokenizer_port}",
            **fields,
        )
        core, server = await start(config, **(core_options or {}))
        front = HttpFront(core, max_body_bytes=64 * 1024)
        port = await front.start("127.0.0.1", 0)
        session = aiohttp.ClientSession()
        try:
            for _ in range(200):
                if core.serving:
                    break
                await asyncio.sleep(0.01)
            assert core.serving
            await test(Front(fake_engine, session, f"http://127.0.0.1:{port}", server.port))
            assert core.active == set()
        finally:
            await session.close()
            await shutdown(core, server, 1.0, front=front)
            await engine_server.stop(None)
            await tokenizer_server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def completion(**fields) -> dict:
    return {"model": "fake", "prompt": "hello", "temperature": 0, **fields}


def chat(**fields) -> dict:
    messages = [{"role": "user", "content": "hello"}]
    return {"model": "fake", "messages": messages, "temperature": 0, **fields}


def test_completion_without_stream_has_text_usage_and_finish_reason() -> None:
    async def check(front: Front) -> None:
        status, body, _ = await front.post("/v1/completions", completion(max_tokens=7))
        assert status == 200
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["model"] == "fake"
        (choice,) = body["choices"]
        assert choice["text"] == generated_text(7) and choice["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 7
        assert body["usage"]["total_tokens"] == 12

    run_front(check)


def test_completion_stream_ends_with_done_and_usage_chunk() -> None:
    async def check(front: Front) -> None:
        body = completion(max_tokens=5, stream=True, stream_options={"include_usage": True})
        events = await front.events("/v1/completions", body)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        assert "".join(c["choices"][0]["text"] for c in chunks) == generated_text(5)
        assert all(c["usage"] is None for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5

    run_front(check)


def test_chat_stream_opens_with_the_role_and_chat_whole_has_a_message() -> None:
    async def check(front: Front) -> None:
        events = await front.events("/v1/chat/completions", chat(max_tokens=4, stream=True))
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == generated_text(4) and "usage" not in chunks[-1]
        status, body, _ = await front.post("/v1/chat/completions", chat(max_tokens=3))
        assert status == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}

    run_front(check)


def test_logprobs_name_tokens_by_id() -> None:
    async def check(front: Front) -> None:
        status, body, _ = await front.post("/v1/completions", completion(max_tokens=2, logprobs=1))
        assert status == 200
        logprobs = body["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 2
        assert all(t.startswith("token_id:") for t in logprobs["tokens"])
        status, body, _ = await front.post(
            "/v1/chat/completions", chat(max_tokens=2, logprobs=True, top_logprobs=1)
        )
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 2 and content[0]["token"] == f"token_id:{ord('a')}"
        status, body, _ = await front.post("/v1/completions", completion(max_tokens=2))
        assert body["choices"][0]["logprobs"] is None

    run_front(check)


def test_models_health_and_metrics() -> None:
    async def check(front: Front) -> None:
        async with front.session.get(front.base + "/v1/models") as response:
            models = await response.json()
        assert [m["id"] for m in models["data"]] == ["fake"]
        assert models["data"][0]["max_model_len"] == 128
        async with front.session.get(front.base + "/health") as response:
            assert response.status == 200
        async with front.session.get(front.base + "/metrics") as response:
            assert response.status == 200
            assert "sluice_router_admitted_requests_total" in await response.text()

    run_front(check)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b'{"model": "fake", "prompt": "x", "temperature": NaN}', 400, None),
        ("/v1/completions", b"\xff\xfe", 400, None),
        ("/v1/completions", completion(n=2), 400, "n"),
        ("/v1/completions", completion(max_tokens="5"), 400, "max_tokens"),
        ("/v1/completions", completion(temperature=500), 400, None),
        ("/v1/completions", completion(model="nope"), 404, "model"),
        ("/v1/chat/completions", chat(model="nope"), 404, "model"),
        ("/v1/completions", completion(prompt="x" * 100_000), 413, None),
        ("/v1/nothing", completion(), 404, None),
    ],
)
def test_bad_requests_get_openai_errors_and_the_front_keeps_serving(
    path: str, body: object, status: int, param: str | None
) -> None:
    async def check(front: Front) -> None:
        got, answer, _ = await front.post(path, body)
        assert got == status
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["message"] and answer["error"]["param"] == param
        got, answer, _ = await front.post("/v1/completions", completion(max_tokens=2))
        assert got == 200 and answer["choices"][0]["text"] == "ab"

    run_front(check)


def test_wrong_method_is_405_in_openai_shape() -> None:
    async def check(front: Front) -> None:
        async with front.session.get(front.base + "/v1/completions") as response:
            assert response.status == 405
            assert (await response.json())["error"]["type"] == "invalid_request_error"

    run_front(check)


def test_api_keys_are_bearer_tokens(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-good\n")

    async def check(front: Front) -> None:
        for headers in ({}, {"Authorization": "Bearer sk-bad"}):
            status, body, _ = await front.post("/v1/completions", completion(), headers=headers)
            assert status == 401 and body["error"]["type"] == "authentication_error"
        async with front.session.get(front.base + "/v1/models") as response:
            assert response.status == 401
        good = {"Authorization": "Bearer sk-good"}
        status, body, _ = await front.post(
            "/v1/completions", completion(max_tokens=1), headers=good
        )
        assert status == 200 and body["choices"][0]["text"] == "a"

    run_front(check, api_keys_file=str(keys))


def test_queue_full_is_429_with_retry_after() -> None:
    async def check(front: Front) -> None:
        first = asyncio.ensure_future(front.post("/v1/completions", completion(max_tokens=6)))
        await eventually(lambda: len(front.engine.submitted) == 1)
        second = asyncio.ensure_future(front.post("/v1/completions", completion(max_tokens=2)))
        await asyncio.sleep(0.05)
        status, body, headers = await front.post("/v1/completions", completion(max_tokens=2))
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) >= 1
        assert (await first)[0] == 200 and (await second)[0] == 200

    run_front(
        check,
        engine=FakeEngine(step_s=0.05),
        max_inflight_per_engine=1,
        max_queued_requests=1,
        retry_after_s=0.25,
    )


def test_timeout_header_gives_504_and_aborts_on_the_engine() -> None:
    async def check(front: Front) -> None:
        headers = {"Sluice-Timeout-S": "0.15"}
        status, body, _ = await front.post(
            "/v1/completions", completion(max_tokens=100), headers=headers
        )
        assert status == 504 and body["error"]["type"] == "timeout_error"
        await eventually(lambda: not front.engine.live)
        assert len(front.engine.aborted) == 1
        status, _, _ = await front.post(
            "/v1/completions", completion(), headers={"Sluice-Timeout-S": "x"}
        )
        assert status == 400

    run_front(check, engine=FakeEngine(step_s=0.01))


def test_an_error_after_the_stream_began_is_one_error_event_before_done() -> None:
    async def check(front: Front) -> None:
        body = completion(max_tokens=100, stream=True)
        events = await front.events("/v1/completions", body, headers={"Sluice-Timeout-S": "0.2"})
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["text"] == "a"
        error = events[-2]["error"]
        assert error["type"] == "timeout_error" and error["code"] == "deadline_exceeded"
        await eventually(lambda: not front.engine.live)

    run_front(check, engine=FakeEngine(step_s=0.01))


def test_idempotency_key_replays_and_a_different_body_is_409() -> None:
    async def check(front: Front) -> None:
        key = {"Idempotency-Key": "order-17"}
        status, first, _ = await front.post(
            "/v1/completions", completion(max_tokens=4), headers=key
        )
        assert status == 200 and first["id"] == "cmpl-order-17"
        status, again, _ = await front.post(
            "/v1/completions", completion(max_tokens=4), headers=key
        )
        assert status == 200 and again["choices"] == first["choices"]
        assert len(front.engine.submitted) == 1  # replayed, not generated twice
        status, body, _ = await front.post("/v1/completions", completion(max_tokens=5), headers=key)
        assert status == 409 and body["error"]["type"] == "conflict_error"

    run_front(check, core_options={"idempotency": IdempotencyCache(MemoryStore())})


def test_client_disconnect_mid_stream_aborts_on_the_engine() -> None:
    async def check(front: Front) -> None:
        body = completion(max_tokens=120, stream=True)
        async with front.session.post(front.base + "/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            await response.content.readuntil(b"\n\n")
            response.close()
        await eventually(lambda: not front.engine.live)
        assert len(front.engine.aborted) == 1

    run_front(check, engine=FakeEngine(step_s=0.01))


def test_client_disconnect_while_waiting_for_a_whole_answer_aborts() -> None:
    async def check(front: Front) -> None:
        task = asyncio.ensure_future(front.post("/v1/completions", completion(max_tokens=120)))
        await eventually(lambda: len(front.engine.live) == 1)
        task.cancel()
        await eventually(lambda: not front.engine.live)
        assert len(front.engine.aborted) == 1

    run_front(check, engine=FakeEngine(step_s=0.01))


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)
