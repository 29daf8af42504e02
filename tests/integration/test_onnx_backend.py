"""The onnxruntime backend on the default model (SmolLM2-135M, float32, CPU) against torch.

Greedy tokens must be identical to the torch backend's: with requests arriving across steps
(continuous batching), a small token budget (chunked prefill) and a shared prompt prefix
(prefix caching), through LLMEngine, LLM.generate and a `sluice up --backend onnxruntime` stack.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.client import SluiceClient
from services.common.ports import free_port
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old "
    "woodcutter who had three sons. The youngest son was",
    "Question: What is two plus two? Answer:",
]
# Shares its first blocks with PROMPTS[2]; arrives after it, so they come from the cache.
PREFIX_PROMPT = PROMPTS[2][:-8] + "the eldest son was"
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from services.common.model_files import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(None).tokenizer_dir))


def run_engine(backend: str, prompt_ids: list[list[int]]) -> tuple[dict[str, list[int]], int]:
    """Two arrivals per step, a 24-token budget; (tokens per request, cached prompt tokens)."""
    engine = LLMEngine(
        EngineConfig(
            backend=backend,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=24,
            enable_prefix_caching=True,
        )
    )
    assert engine.info.backend == backend
    outputs: dict[str, list[int]] = {}
    cached = 0
    pending = list(enumerate(prompt_ids))
    while pending or engine.has_unfinished():
        for _ in range(2):
            if pending:
                index, ids = pending.pop(0)
                engine.add_request(str(index), ids, GREEDY)
        step = engine.step()
        for delta in step.deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                cached += delta.num_cached_prompt_tokens or 0
    return outputs, cached


def test_engine_steps_match_torch(tokenizer):
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    prompt_ids.append(tokenizer(PREFIX_PROMPT)["input_ids"])
    expected, cached_torch = run_engine("torch", prompt_ids)
    got, cached_onnx = run_engine("onnxruntime", prompt_ids)
    assert got == expected
    assert all(len(tokens) == MAX_TOKENS for tokens in got.values())
    assert cached_onnx == cached_torch > 0


def test_generate_matches_torch():
    torch_llm = LLM(device="cpu", dtype="float32", max_num_batched_tokens=32)
    expected = [output.token_ids for output in torch_llm.generate(PROMPTS, GREEDY)]
    onnx_llm = LLM(backend="onnxruntime", device="cpu", dtype="float32", max_num_batched_tokens=32)
    outputs = onnx_llm.generate(PROMPTS, GREEDY)
    assert [output.token_ids for output in outputs] == expected
    assert "Paris" in outputs[0].text


def test_sluice_up_with_the_onnxruntime_backend(tokenizer):
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS[:2]]
    expected = [
        output.token_ids
        for output in LLM(device="cpu", dtype="float32").generate(prompt_ids, GREEDY)
    ]
    port = free_port()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "services.cli", "up", "--port", str(port)),
            *("--no-ray", "--no-redis", "--engines", "1", "--metrics-port", "0"),
            *("--device", "cpu", "--backend", "onnxruntime", "--startup-timeout-s", "300"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready = process.stdout.readline()
        assert ready.strip() == f"Sluice router ready at 127.0.0.1:{port}"
        with SluiceClient(f"127.0.0.1:{port}", timeout_s=120.0) as client:
            for ids, tokens in zip(prompt_ids, expected, strict=True):
                completion = client.complete(
                    token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                )
                assert completion.token_ids == tokens
    finally:
        process.terminate()
        process.wait(timeout=60)
