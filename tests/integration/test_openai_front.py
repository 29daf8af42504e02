"""The router's OpenAI-compatible HTTP front on the real stack, driven by the `openai` package.

One stack with `--http-port` serves most tests (default model, greedy); a second one with an
API keys file and a one-request queue produces 401 and 429; a router with no engine or
tokenizer to reach produces 503. Every status of the gRPC table appears as its HTTP status in
OpenAI's error shape, and the stack keeps serving afterwards.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from loadtest.cli import main as bench_main
from services.client import SluiceClient
from services.common.ports import free_port
from services.launcher import Stack
from tests.integration.conftest import default_stack_config
from tests.integration.test_stack_cancel import engine_free_blocks, wait_for_free_blocks


class Front:
    def __init__(self, stack: Stack, http_port: int) -> None:
        self.stack = stack
        self.port = http_port
        self.url = f"http://127.0.0.1:{http_port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        self.model = self.client.models.list().data[0].id


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """A raw HTTP POST (no SDK in the way): the status and the JSON answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def settled_free_blocks(engine: str) -> int:
    """The engine's free KV blocks once they stop changing."""
    free, _ = engine_free_blocks(engine)
    for _ in range(100):
        time.sleep(0.2)
        now, _ = engine_free_blocks(engine)
        if now == free:
            return free
        free = now
    return free


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    port = free_port()
    config = default_stack_config(
        tmp_path_factory.mktemp("openai-stack-logs"), router_args=("--http-port", str(port))
    )
    with Stack(config) as stack:
        yield Front(stack, port)


def test_models_lists_the_served_model(front: Front) -> None:
    models = front.client.models.list().data
    assert [m.id for m in models] == [front.model]
    with SluiceClient(front.stack.router_address, timeout_s=30) as client:
        assert client.list_models()[0].name == front.model


def test_chat_answers_paris_streamed_and_whole(front: Front) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = front.client.chat.completions.create(
        model=front.model, messages=messages, max_tokens=32, temperature=0
    )
    answer = whole.choices[0].message.content
    assert "Paris" in answer and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens <= 32 and whole.usage.prompt_tokens > 5
    chunks = list(
        front.client.chat.completions.create(
            model=front.model,
            messages=messages,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_greedy_completion_is_the_grpc_text_with_the_same_usage(front: Front) -> None:
    prompt = "The three primary colors are"
    with SluiceClient(front.stack.router_address, timeout_s=60) as client:
        grpc_answer = client.complete(prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
    whole = front.client.completions.create(
        model=front.model,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].text == grpc_answer.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == grpc_answer.prompt_tokens
    assert whole.usage.completion_tokens == grpc_answer.completion_tokens == 20
    assert whole.usage.total_tokens == grpc_answer.prompt_tokens + 20
    chunks = list(
        front.client.completions.create(
            model=front.model,
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == grpc_answer.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_a_stop_string_finishes_with_stop(front: Front) -> None:
    whole = front.client.completions.create(
        model=front.model, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"]
    )
    assert whole.choices[0].finish_reason == "stop" and " 7" not in whole.choices[0].text


@pytest.mark.parametrize(
    ("model", "extra", "status", "error"),
    [
        (None, {"n": 2}, 400, openai.BadRequestError),
        (None, {"frobnicate": True}, 400, openai.BadRequestError),
        (None, {"temperature": -1}, 400, openai.BadRequestError),
        ("no-such-model", {}, 404, openai.NotFoundError),
    ],
)
def test_errors_map_to_openai_exceptions(
    front: Front, model: str | None, extra: dict, status: int, error: type
) -> None:
    with pytest.raises(error) as raised:
        front.client.completions.create(
            model=model or front.model, prompt="Hi", max_tokens=2, extra_body=extra
        )
    assert raised.value.status_code == status
    assert raised.value.body["message"]


def test_malformed_bodies_and_huge_bodies_are_4xx_and_the_stack_keeps_serving(
    front: Front,
) -> None:
    for content, status in (
        (b"{not json", 400),
        (b'{"model": 5, "prompt": "x"}', 400),
        (b"x" * (9 * 1024 * 1024), 413),
    ):
        got, answer = post(front.port, "/v1/completions", content)
        assert got == status and answer["error"]["message"]
    whole = front.client.completions.create(model=front.model, prompt="Hi", max_tokens=2)
    assert whole.usage.completion_tokens >= 1


def test_a_tiny_timeout_is_504(front: Front) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        front.client.completions.create(
            model=front.model,
            prompt="Tell me a long story.",
            max_tokens=400,
            extra_body={"ignore_eos": True},
            extra_headers={"Sluice-Timeout-S": "0.3"},
        )
    assert raised.value.status_code == 504


def test_slow_reader_and_disconnect_mid_stream_free_the_kv_blocks(front: Front) -> None:
    engine = front.stack.engine_addresses[0]
    initial = settled_free_blocks(engine)  # requests of earlier tests may still be ending
    body = {
        "model": front.model,
        "prompt": "Tell me a long story about a lighthouse.",
        "max_tokens": 400,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200
    events = 0
    while events < 3:
        if response.readline().startswith(b"data: "):
            events += 1
            time.sleep(0.2)  # a slow reader
    assert engine_free_blocks(engine)[0] < initial  # the stream holds blocks now
    connection.close()  # gone mid-stream
    assert wait_for_free_blocks(engine, initial, timeout_s=30) == initial


def test_bench_counts_the_same_tokens_over_http_and_grpc(front: Front, tmp_path: Path) -> None:
    def run(*target: str, name: str) -> list[dict]:
        out = tmp_path / f"{name}.json"
        common = ["--arrival", "constant", "--rate", "4", "--num-requests", "6", "--seed", "5"]
        shape = ["--input-mean", "16", "--input-stdev", "4", "--output-mean", "8"]
        code = bench_main([*target, *common, *shape, "--out", str(out), "--no-progress"])
        assert code == 0
        return json.loads(out.read_text())["requests"]

    over_grpc = run("--target", front.stack.router_address, name="grpc")
    over_http = run("--openai-url", front.url + "/v1", name="http")
    assert [r["status"] for r in over_http] == ["OK"] * 6
    assert [r["output_tokens"] for r in over_http] == [r["output_tokens"] for r in over_grpc]
    assert sum(r["output_tokens"] for r in over_http) > 6


def test_api_keys_and_a_full_queue(stack_factory, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-test-one\n")
    port = free_port()
    stack = stack_factory(
        router_args=(
            *("--http-port", str(port), "--api-keys-file", str(keys)),
            *("--max-queued-requests", "1", "--max-inflight-per-engine", "1"),
            # the queued request waits for all 300 tokens of the running one: well past the
            # default delay bound, which would refuse it; this test is about the count bound
            *("--max-queue-delay-s", "120"),
        )
    )
    base = f"http://127.0.0.1:{port}/v1"
    stranger = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as raised:
        stranger.models.list()
    assert raised.value.status_code == 401
    client = openai.OpenAI(base_url=base, api_key="sk-test-one", max_retries=0)
    model = client.models.list().data[0].id
    long = {"model": model, "prompt": "Count slowly.", "max_tokens": 300}
    long["extra_body"] = {"ignore_eos": True}
    results: list = []
    background = [
        threading.Thread(target=lambda: results.append(client.completions.create(**long)))
        for _ in range(2)
    ]
    for thread in background:
        thread.start()
        time.sleep(1.0)  # the first runs on the engine, the second waits in the queue
    with pytest.raises(openai.RateLimitError) as raised:
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert raised.value.status_code == 429
    assert int(raised.value.response.headers["Retry-After"]) >= 1
    for thread in background:
        thread.join(timeout=300)
    assert [r.usage.completion_tokens for r in results] == [300, 300]
    del stack


def test_no_engine_to_reach_is_503(tmp_path: Path) -> None:
    http_port = free_port()
    nowhere = f"127.0.0.1:{free_port()}"
    router = subprocess.Popen(
        [
            sys.executable,
            *("-m", "services.router.server", "--port", "0", "--http-port", str(http_port)),
            *("--engines", nowhere, "--tokenizer", nowhere),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "router.log").open("w"),
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
                connection.request("GET", "/health")
                health = connection.getresponse().status
                connection.close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and router.poll() is None
                time.sleep(0.2)
        assert health == 503
        body = json.dumps({"model": "any", "prompt": "Hi"}).encode()
        status, answer = post(http_port, "/v1/completions", body, {"Sluice-Timeout-S": "0.5"})
        assert status == 503 and answer["error"]["type"] == "service_unavailable_error"
    finally:
        router.terminate()
        router.wait(timeout=30)
