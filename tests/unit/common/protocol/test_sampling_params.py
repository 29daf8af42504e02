"""SamplingParams.argmax_from: when a plain argmax picks every token (what lets the engine skip
the sampler and plan steps ahead)."""

from __future__ import annotations

import math

import pytest

from services.common.protocol.sampling_params import SamplingParams
from services.engine.sequence import Sequence


def test_greedy_params_pick_by_argmax_from_min_tokens() -> None:
    assert SamplingParams(temperature=0.0).argmax_from == 0
    assert SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8).argmax_from == 3


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": 0.7},
        {"logprobs": 2},
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
    ],
)
def test_anything_the_sampler_does_rules_argmax_out(change: dict) -> None:
    assert SamplingParams(**{"temperature": 0.0, **change}).argmax_from == math.inf


def test_a_sequence_reads_it_once_and_counts_its_outputs() -> None:
    seq = Sequence(0, "r", [1, 2], SamplingParams(temperature=0.0, min_tokens=2, max_tokens=5))
    assert seq.argmax_from == 2
    assert len(seq.output_token_ids) < seq.argmax_from  # EOS still masked: the sampler's turn
    seq.append_token(7)
    seq.append_token(8)
    assert len(seq.output_token_ids) >= seq.argmax_from
