"""Sampler: greedy, seeded reproducibility, support restriction, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.protocol.sampling_params import SamplingParams
from services.engine.sampler import Sampler, apply_penalties
from services.engine.sequence import Sequence

_ids = iter(range(10**9))


def make_seq(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Sequence:
    seq_id = next(_ids)
    seq = Sequence(seq_id, f"r{seq_id}", list(prompt), params)
    for token in output:
        seq.append_token(token)
    return seq


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    seqs = [make_seq(SamplingParams(temperature=0)) for _ in range(5)]
    assert Sampler().sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_greedy_rows_mixed_with_random_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    seqs = [make_seq(SamplingParams(temperature=t)) for t in (0, 1.0, 0, 2.0)]
    tokens = Sampler().sample(logits, seqs).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_same_seed_same_tokens_whatever_the_companions():
    vocab = 1000
    generator = torch.Generator().manual_seed(2)
    steps = [torch.randn(6, vocab, generator=generator) for _ in range(8)]

    def run(batch_rows: list[int], companions_seeded: bool) -> list[int]:
        seqs = [make_seq(SamplingParams(temperature=1.0, seed=1234))]
        for i in range(len(batch_rows) - 1):
            seed = 77 + i if companions_seeded else None
            seqs.append(make_seq(SamplingParams(temperature=0.8, top_p=0.9, seed=seed)))
        sampler = Sampler(seed=len(batch_rows))
        tokens = []
        for logits in steps:
            rows = logits[batch_rows]
            tokens.append(sampler.sample(rows, seqs).token_ids[0])
        return tokens

    alone = run([0], False)
    assert alone == run([0, 1, 2, 3], False) == run([0, 5, 4], True)
    other_seed = [make_seq(SamplingParams(temperature=1.0, seed=99))]
    different = [Sampler().sample(logits[[0]], other_seed).token_ids[0] for logits in steps]
    assert different != alone


def sample_many(params: SamplingParams, probs: list[float], rows: int = 3000) -> set[int]:
    logits = probs_logits(probs).repeat(rows, 1)
    seqs = [make_seq(params) for _ in range(rows)]
    return set(Sampler(seed=5).sample(logits, seqs).token_ids)


PROBS = [0.5, 0.3, 0.15, 0.05]


def test_unrestricted_sampling_reaches_whole_support():
    assert sample_many(SamplingParams(temperature=1.0), PROBS) == {0, 1, 2, 3}


def test_top_k_restricts_support():
    assert sample_many(SamplingParams(temperature=1.0, top_k=2), PROBS) == {0, 1}
    assert sample_many(SamplingParams(temperature=1.0, top_k=3), PROBS) == {0, 1, 2}


def test_top_p_keeps_smallest_set_reaching_p():
    assert sample_many(SamplingParams(temperature=1.0, top_p=0.7), PROBS) == {0, 1}
    assert sample_many(SamplingParams(temperature=1.0, top_p=0.85), PROBS) == {0, 1, 2}
    assert sample_many(SamplingParams(temperature=1.0, top_p=0.85, top_k=2), PROBS) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_top():
    assert sample_many(SamplingParams(temperature=1.0, min_p=0.5), PROBS) == {0, 1}
    assert sample_many(SamplingParams(temperature=1.0, min_p=0.2), PROBS) == {0, 1, 2}


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    seq = make_seq(params, prompt=[0, 1], output=[2, 2, 4])
    result = apply_penalties(logits.clone(), [seq])[0]
    expected = [
        2.0 / 2,  # prompt token, positive: divided
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5 / 2 - 0.25 * 2 - 0.5,  # output twice: repetition, frequency x2, presence
        3.0,  # unseen
        -2.0 * 2 - 0.25 - 0.5,  # output once
        1.0,
    ]
    assert result.tolist() == pytest.approx(expected)


def test_penalties_per_row_leave_other_rows_alone():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    penalized = make_seq(SamplingParams(repetition_penalty=1.5), prompt=[1], output=[2])
    plain = make_seq(SamplingParams(), prompt=[1], output=[2])
    result = apply_penalties(logits.clone(), [penalized, plain])
    assert result[1].tolist() == [1.0, 2.0, 3.0]
    assert result[0].tolist() == pytest.approx([1.0, 2.0 / 1.5, 3.0 / 1.5])


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    eos = (1,)
    before = make_seq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]), output=[3])
    assert Sampler(eos_token_ids=eos).sample(logits, [before]).token_ids == [3]
    reached = make_seq(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[2]), output=[3])
    assert Sampler(eos_token_ids=eos).sample(logits, [reached]).token_ids == [1]
    ignore = make_seq(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), output=[3])
    assert Sampler(eos_token_ids=eos).sample(logits, [ignore]).token_ids == [1]


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    seqs = [
        make_seq(SamplingParams(temperature=0, logprobs=2, repetition_penalty=3.0), output=[1]),
        make_seq(SamplingParams(temperature=0)),
    ]
    output = Sampler().sample(logits, seqs)
    raw = torch.log_softmax(logits[0], -1)
    entry = output.logprobs[0]
    assert entry.token_id == output.token_ids[0]
    assert entry.logprob == pytest.approx(raw[entry.token_id].item())
    assert [token for token, _ in entry.top] == [1, 2]
    assert entry.top[0][1] == pytest.approx(raw[1].item())
    assert output.logprobs[1] is None
    assert all(math.isfinite(value) for _, value in entry.top)


def test_temperature_sharpens_distribution():
    probs = [0.4, 0.35, 0.25]
    cold = sample_many(SamplingParams(temperature=0.01), probs, rows=500)
    assert cold == {0}


def test_top_p_on_a_flat_distribution_reaches_past_the_candidate_guess():
    vocab = 2000
    logits = torch.zeros(400, vocab)
    seqs = [make_seq(SamplingParams(temperature=1.0, top_p=0.9)) for _ in range(400)]
    tokens = Sampler(seed=3).sample(logits, seqs).token_ids
    assert max(tokens) > 600  # beyond the first 512 candidates
    assert all(token < vocab for token in tokens)


def test_seeded_top_p_row_is_unaffected_by_companions_needing_the_fallback():
    vocab = 3000
    generator = torch.Generator().manual_seed(4)
    peaked = torch.randn(vocab, generator=generator) * 4
    flat = torch.zeros(vocab)

    def run(with_flat_companion: bool) -> list[int]:
        seeded = make_seq(SamplingParams(temperature=1.0, top_p=0.8, seed=42))
        seqs = [seeded]
        rows = [peaked]
        if with_flat_companion:
            seqs.append(make_seq(SamplingParams(temperature=1.0, top_p=0.95)))
            rows.append(flat)
        sampler = Sampler()
        return [sampler.sample(torch.stack(rows), seqs).token_ids[0] for _ in range(6)]

    assert run(False) == run(True)
