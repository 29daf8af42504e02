"""LLMEngine over a fake model runner: lifecycle, validation, chunked prefill, preemption,
prefix caching and leak-freedom, checked against a cache-less reference generation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import FinishReason
from tests.unit.engine.fake_runner import FakeModelRunner, reference_generate

VOCAB = 101


def make_engine(**overrides) -> tuple[LLMEngine, FakeModelRunner]:
    runner_args = {
        key: overrides.pop(key)
        for key in ("num_blocks", "block_size", "max_model_len", "eos_token_ids")
        if key in overrides
    }
    runner = FakeModelRunner(vocab_size=VOCAB, **runner_args)
    config = EngineConfig(model="fake", device="cpu", **overrides)
    return LLMEngine(config, model_runner=runner), runner


def run_all(engine: LLMEngine, outputs: dict[str, list[int]] | None = None) -> dict:
    outputs = {} if outputs is None else outputs
    reasons = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for delta in engine.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                assert delta.request_id not in reasons, "a request finished twice"
                reasons[delta.request_id] = delta.finish_reason
    else:
        raise AssertionError("engine did not finish")
    return {"tokens": outputs, "reasons": reasons}


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(length)]


def test_info_and_load_describe_the_runner():
    engine, runner = make_engine(num_blocks=32, block_size=4, max_num_seqs=7)
    assert engine.info.num_blocks == 32
    assert engine.info.block_size == 4
    assert engine.info.vocab_size == VOCAB
    assert engine.info.max_num_seqs == 7
    load = engine.load()
    assert (load.free_blocks, load.total_blocks, load.running, load.waiting) == (32, 32, 0, 0)


def test_staggered_chunked_preempted_requests_match_reference():
    rng = random.Random(3)
    engine, runner = make_engine(num_blocks=24, block_size=4, max_num_batched_tokens=16)
    prompts = {
        f"r{i}": random_prompt(rng, length)
        for i, length in enumerate([3, 9, 17, 30, 5, 40, 12, 2, 25])
    }
    max_tokens = {rid: 8 + i for i, rid in enumerate(prompts)}
    ids = list(prompts)
    outputs: dict[str, list[int]] = {}
    for rid in ids[:4]:
        engine.add_request(
            rid, prompts[rid], SamplingParams(temperature=0, max_tokens=max_tokens[rid])
        )
    for rid in ids[4:]:
        for delta in engine.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        engine.add_request(
            rid, prompts[rid], SamplingParams(temperature=0, max_tokens=max_tokens[rid])
        )
    result = run_all(engine, outputs)
    for rid, prompt in prompts.items():
        assert result["tokens"][rid] == reference_generate(prompt, max_tokens[rid], VOCAB), rid
        assert result["reasons"][rid] is FinishReason.LENGTH
    assert engine.num_preemptions > 0, "the small cache should have forced a preemption"
    assert any(
        len(seq.token_ids) < 40 and seq.start_position > 0 and len(seq.token_ids) > 1
        for batch in runner.batches
        for seq in batch.sequences
    ), "no chunked prefill seen"
    assert all(batch.num_tokens <= 16 for batch in runner.batches)
    assert engine.block_manager.num_free_blocks == 24
    assert not engine.scheduler.has_unfinished()


def test_prefix_cache_reuses_blocks_and_gives_same_output():
    rng = random.Random(5)
    engine, runner = make_engine(num_blocks=64, block_size=4)
    prefix = random_prompt(rng, 22)
    first, second = prefix + [7, 8], prefix + [9]
    engine.add_request("a", first, SamplingParams(temperature=0, max_tokens=5))
    run_all(engine)
    hits_before = engine.block_manager.prefix_cache_hits
    engine.add_request("b", second, SamplingParams(temperature=0, max_tokens=5))
    result = run_all(engine)
    # 22 shared tokens = 5 full blocks of 4.
    assert engine.block_manager.prefix_cache_hits - hits_before == 20
    first_step = [seq for seq in runner.batches[-5].sequences]  # b's prefill step
    assert first_step[0].start_position == 20
    assert result["tokens"]["b"] == reference_generate(second, 5, VOCAB)
    # The same prompt again: all but the last block is cached, output identical.
    engine.add_request("c", first, SamplingParams(temperature=0, max_tokens=5))
    result = run_all(engine)
    assert result["tokens"]["c"] == reference_generate(first, 5, VOCAB)


def test_prefix_cache_counts_delta_cached_tokens():
    engine, _ = make_engine(num_blocks=64, block_size=4)
    prompt = list(range(1, 18))
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2))
    run_all(engine)
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=2))
    cached = [d.num_cached_prompt_tokens for d in engine.step().deltas if d.request_id == "b"]
    assert cached == [16]


def test_random_aborts_leak_nothing():
    rng = random.Random(11)
    engine, _ = make_engine(num_blocks=40, block_size=4, max_num_batched_tokens=12)
    live: set[str] = set()
    aborted: set[str] = set()
    reported_abort: list[str] = []
    for i in range(40):
        rid = f"q{i}"
        engine.add_request(
            rid,
            random_prompt(rng, rng.randrange(1, 30)),
            SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20)),
        )
        live.add(rid)
        for _ in range(rng.randrange(0, 3)):
            for delta in engine.step().deltas:
                if delta.finished:
                    live.discard(delta.request_id)
                    if delta.finish_reason is FinishReason.ABORT:
                        reported_abort.append(delta.request_id)
        if live and rng.random() < 0.5:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim)
            assert not engine.abort(victim)
            aborted.add(victim)
            live.discard(victim)
    result = run_all(engine)
    reported_abort += [
        rid for rid, reason in result["reasons"].items() if reason is FinishReason.ABORT
    ]
    assert sorted(reported_abort) == sorted(aborted)
    assert engine.block_manager.num_free_blocks == 40
    assert not engine.scheduler.has_unfinished()
    assert not engine.has_unfinished()
    assert engine.load().running == engine.load().waiting == 0


def test_validation_errors():
    engine, _ = make_engine(num_blocks=8, block_size=4, max_model_len=64)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(InvalidArgumentError, match="empty"):
        engine.add_request("a", [], params)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        engine.add_request("a", [1, VOCAB], params)
    with pytest.raises(InvalidArgumentError, match="context"):
        engine.add_request("a", [1] * 62, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidArgumentError, match="stop token id"):
        engine.add_request("a", [1], SamplingParams(stop_token_ids=[VOCAB + 5]))
    with pytest.raises(InvalidArgumentError, match="request_id"):
        engine.add_request("", [1], params)
    with pytest.raises(NotFoundError, match="adapter"):
        engine.add_request("a", [1], params, adapter="missing")
    with pytest.raises(ResourceExhaustedError, match="KV blocks"):
        engine.add_request("a", [1] * 30, params)  # 34 tokens > 8 blocks * 4
    engine.add_request("a", [1, 2], params)
    with pytest.raises(AlreadyExistsError):
        engine.add_request("a", [1, 2], params)
    assert engine.load().waiting == 1
    run_all(engine)
    engine.add_request("a", [1, 2], params)  # the id is free again once finished


def test_stop_conditions():
    prompt = [5, 6, 7]
    natural = reference_generate(prompt, 30, VOCAB)
    stop_token = natural[3]
    first_stop = natural.index(stop_token)
    engine, _ = make_engine(eos_token_ids=(stop_token,))
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=30))
    engine.add_request(
        "ignore", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    engine.add_request(
        "min", prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=first_stop + 2)
    )
    result = run_all(engine)
    assert result["tokens"]["eos"] == natural[: first_stop + 1]
    assert result["reasons"]["eos"] is FinishReason.STOP
    assert result["tokens"]["ignore"] == natural
    assert result["reasons"]["ignore"] is FinishReason.LENGTH
    min_tokens = result["tokens"]["min"]
    assert len(min_tokens) >= first_stop + 2
    assert stop_token not in min_tokens[: first_stop + 2]

    engine, _ = make_engine()
    engine.add_request(
        "stop_id", prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token])
    )
    result = run_all(engine)
    assert result["tokens"]["stop_id"] == natural[: first_stop + 1]
    assert result["reasons"]["stop_id"] is FinishReason.STOP


def test_priority_runs_lower_value_first():
    engine, runner = make_engine(max_num_seqs=1)
    engine.add_request("late", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2), priority=5)
    engine.add_request("urgent", [4, 5, 6], SamplingParams(temperature=0, max_tokens=2), priority=0)
    order = []
    result = run_all(engine)
    for rid, _ in result["reasons"].items():
        order.append(rid)
    assert order == ["urgent", "late"]


def test_logprobs_reported_per_token():
    engine, _ = make_engine()
    engine.add_request("a", [1, 2], SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    logprobs = []
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            assert delta.logprobs is not None and len(delta.logprobs) == len(delta.new_token_ids)
            logprobs.extend(delta.logprobs)
    assert len(logprobs) == 3
    for entry in logprobs:
        assert len(entry.top) == 2
        assert entry.top[0][0] == entry.token_id  # greedy picks the top token
        assert entry.logprob == pytest.approx(entry.top[0][1])


def test_failed_forward_fails_its_requests_only():
    engine, runner = make_engine()
    original = runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return original(batch)

    runner.execute = flaky
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    deltas = engine.step().deltas
    assert deltas[0].finish_reason is FinishReason.ERROR and "boom" in deltas[0].error
    assert engine.block_manager.num_free_blocks == runner.num_blocks
    engine.add_request("b", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    assert run_all(engine)["tokens"]["b"] == reference_generate([1, 2, 3], 2, VOCAB)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 12),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    requests=st.lists(
        st.tuples(
            st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20),
            st.integers(1, 6),  # max_tokens
            st.integers(0, 2),  # priority
            st.integers(0, 3),  # steps before the next arrival
            st.booleans(),  # aborted after those steps
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_any_configuration_matches_reference_and_frees_everything(
    block_size, spare_blocks, budget, max_num_seqs, prefix_caching, requests
):
    longest = max(len(prompt) + max_tokens for prompt, max_tokens, *_ in requests)
    num_blocks = -(-longest // block_size) + spare_blocks  # the largest request always fits
    engine, _ = make_engine(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
    )
    outputs: dict[str, list[int]] = {}
    aborted = set()
    reasons = {}
    for index, (prompt, max_tokens, priority, wait, abort) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        engine.add_request(str(index), prompt, params, priority=priority)
        for _ in range(wait):
            for delta in engine.step().deltas:
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.finished:
                    reasons[delta.request_id] = delta.finish_reason
        if abort and engine.abort(str(index)):
            aborted.add(str(index))
    result = run_all(engine, outputs)
    result["reasons"].update(reasons)
    for index, (prompt, max_tokens, *_) in enumerate(requests):
        expected = reference_generate(prompt, max_tokens, VOCAB)
        got = result["tokens"].get(str(index), [])
        if str(index) in aborted:
            assert got == expected[: len(got)]
            assert result["reasons"][str(index)] is FinishReason.ABORT
        else:
            assert got == expected
    assert engine.block_manager.num_free_blocks == num_blocks
    assert not engine.has_unfinished()


def test_greedy_fast_path_matches_the_sampler_path():
    """dummy:tiny greedy outputs are the same with and without the runner's execute_greedy."""

    def run(fast: bool) -> dict[str, list[int]]:
        engine = LLMEngine(EngineConfig(model="dummy:tiny", kv_cache_bytes=4 << 20))
        calls = []
        if fast:
            original = engine._execute_greedy
            engine._execute_greedy = lambda batch: calls.append(1) or original(batch)
        else:
            engine._execute_greedy = None
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add_request("a", [5, 6, 7, 8], greedy)
        engine.add_request("b", list(range(100, 130)), greedy)
        with_min = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, ignore_eos=True)
        engine.add_request("c", [9, 10], with_min)
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step().deltas:
                outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        assert not fast or calls  # the fast path ran once "c" passed min_tokens
        return outputs

    fast, slow = run(True), run(False)
    assert fast == slow and all(len(tokens) == 6 for tokens in fast.values())
