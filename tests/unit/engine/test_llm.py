"""The offline LLM over a fake runner: prompt forms, per-prompt params, order, text, errors."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgumentError
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import FinishReason
from tests.unit.engine.fake_runner import FakeModelRunner, reference_generate

VOCAB = 101


class CharTokenizer:
    """One token per character: enough to check encode/decode plumbing."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(ch) % VOCAB for ch in text]}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(65 + token % 26) for token in token_ids)


def make_llm() -> LLM:
    runner = FakeModelRunner(vocab_size=VOCAB, num_blocks=32, block_size=4)
    engine = LLMEngine(EngineConfig(model="fake", device="cpu"), model_runner=runner)
    return LLM.from_engine(engine, CharTokenizer())


def test_generate_keeps_order_and_accepts_every_prompt_form():
    llm = make_llm()
    greedy = SamplingParams(temperature=0, max_tokens=4)
    outputs = llm.generate(["hello", [5, 6, 7], "hi"], greedy)
    assert [o.prompt_token_ids for o in outputs] == [
        [ord(c) % VOCAB for c in "hello"],
        [5, 6, 7],
        [ord(c) % VOCAB for c in "hi"],
    ]
    for output in outputs:
        assert output.token_ids == reference_generate(output.prompt_token_ids, 4, VOCAB)
        assert output.finish_reason is FinishReason.LENGTH
        assert output.text == CharTokenizer().decode(output.token_ids)
    single = llm.generate([5, 6, 7], greedy)
    assert len(single) == 1 and single[0].token_ids == outputs[1].token_ids
    assert llm.generate("hello", greedy)[0].token_ids == outputs[0].token_ids
    assert llm.generate([], greedy) == []


def test_per_prompt_params_and_logprobs():
    llm = make_llm()
    outputs = llm.generate(
        [[1, 2], [3, 4]],
        [SamplingParams(temperature=0, max_tokens=2), SamplingParams(max_tokens=5, logprobs=1)],
        use_tqdm=True,
    )
    assert len(outputs[0].token_ids) == 2 and outputs[0].logprobs is None
    assert len(outputs[1].token_ids) == 5 and len(outputs[1].logprobs) == 5


def test_bad_input_raises_and_leaves_engine_clean():
    llm = make_llm()
    with pytest.raises(InvalidArgumentError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        llm.generate([[1, 2], [VOCAB + 1]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgumentError, match="empty"):
        llm.generate([""])
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == 32
