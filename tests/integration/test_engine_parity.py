"""The engine on the default model (SmolLM2-135M) against transformers, on CPU.

Greedy parity: prompts of different lengths arriving across steps, with a small token budget
(chunked prefill) and a small KV cache (preemption), must produce exactly the tokens of
transformers' greedy `generate` of each prompt alone. Prefix caching must reuse blocks and not
change outputs; random aborts must leave no blocks or sequences behind.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from services.common.model_files import resolve_model
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "List three colors: red,",
    "In 1969, astronauts landed on the Moon. The mission was called",
    "Question: What is two plus two? Answer:",
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old "
    "woodcutter who had three sons. The youngest son was",
    "The quick brown fox jumps over the lazy dog. " * 4 + "The dog then",
]
MAX_TOKENS = 10
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def files():
    return resolve_model(None)


@pytest.fixture(scope="module")
def tokenizer(files):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files.tokenizer_dir))


@pytest.fixture(scope="module")
def reference(files, tokenizer):
    """transformers' greedy generate of each prompt alone (float32)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(files.weights_dir), dtype=torch.float32)
    model.eval()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0
    )
    results = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            results.append(out[0, ids.shape[1] :].tolist())
    return results


def kv_bytes_per_block(files) -> int:
    config = json.loads((files.weights_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 4
    return per_token * BLOCK_SIZE


def test_greedy_parity_with_chunked_prefill_and_preemption(files, tokenizer, reference):
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    longest = max(len(ids) for ids in prompt_ids) + MAX_TOKENS
    num_blocks = -(-longest // BLOCK_SIZE) + 2  # the longest fits, but not all at once
    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            dtype="float32",
            block_size=BLOCK_SIZE,
            kv_cache_bytes=num_blocks * kv_bytes_per_block(files),
            max_num_batched_tokens=24,
            enable_prefix_caching=False,
        )
    )
    assert engine.info.num_blocks < sum(-(-(len(p) + MAX_TOKENS) // BLOCK_SIZE) for p in prompt_ids)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompt_ids))
    chunked = False
    while pending or engine.has_unfinished():
        for _ in range(2):  # two arrivals, then a step
            if pending:
                index, ids = pending.pop(0)
                engine.add_request(str(index), ids, params)
        step = engine.step()
        chunked = chunked or step.num_batched_tokens == 24
        for delta in step.deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert engine.num_preemptions > 0, "the small KV cache should force a preemption"
    assert chunked, "the small token budget should force chunked prefill"
    for index, expected in enumerate(reference):
        # transformers stops at the model's EOS even when told not to; compare up to it.
        got = outputs[str(index)]
        assert len(got) == MAX_TOKENS
        assert got[: len(expected)] == expected, f"prompt {index}: {PROMPTS[index]!r}"
        if len(expected) < MAX_TOKENS:
            assert expected[-1] in engine.info.eos_token_ids
    assert engine.block_manager.num_free_blocks == engine.info.num_blocks


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_num_batched_tokens=32)


def test_prefix_cache_reuses_blocks_with_same_output(llm, tokenizer, reference):
    long_prompt = tokenizer(PROMPTS[-1])["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([long_prompt[:-3] + [504, 3575]], params)[0]
    assert first.num_cached_prompt_tokens == 0
    second = llm.generate([long_prompt], params)[0]
    assert len(reference[-1]) == MAX_TOKENS  # this prompt's reference has no early EOS
    shared_blocks = (len(long_prompt) - 3) // BLOCK_SIZE
    assert shared_blocks >= 2
    assert second.num_cached_prompt_tokens == shared_blocks * BLOCK_SIZE
    assert second.token_ids == reference[-1]
    assert second.text == tokenizer.decode(reference[-1], skip_special_tokens=True)


def test_random_aborts_return_every_block(llm, tokenizer):
    engine = llm.engine
    rng = random.Random(0)
    initial = engine.block_manager.num_free_blocks
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), tokenizer(prompt)["input_ids"], SamplingParams(max_tokens=6))
    live = {str(i) for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            if delta.finished:
                live.discard(delta.request_id)
        if live and rng.random() < 0.4:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim)
            live.discard(victim)
    assert engine.block_manager.num_free_blocks == initial
    assert engine.load().running == 0 and engine.load().waiting == 0


def test_string_prompts_logprobs_and_seeded_sampling(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    (answer,) = llm.generate("The capital of France is", greedy)
    assert "Paris" in answer.text
    assert answer.finish_reason is not None
    assert len(answer.logprobs) == len(answer.token_ids)
    for entry in answer.logprobs:
        assert entry.top[0][0] == entry.token_id  # greedy takes the most likely token
        assert entry.logprob <= 0.0

    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], seeded)[0].token_ids
    crowd = llm.generate(
        [PROMPTS[3], PROMPTS[1], PROMPTS[5]],
        [SamplingParams(temperature=1.0, max_tokens=8), seeded, SamplingParams(max_tokens=3)],
    )
    assert crowd[1].token_ids == alone
