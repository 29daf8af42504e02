"""The one SamplingParams codec that the router and the engine both use."""

from __future__ import annotations

import pytest

from protos.sluice.v1 import common_pb2
from services.common.errors import InvalidArgumentError
from services.common.protocol.codec import sampling_params_from_pb, sampling_params_to_pb
from services.common.protocol.sampling_params import SamplingParams


def test_unset_params_take_the_defaults() -> None:
    assert sampling_params_from_pb(common_pb2.SamplingParams()) == SamplingParams()


def test_set_values_are_decoded() -> None:
    given = sampling_params_from_pb(
        common_pb2.SamplingParams(max_tokens=7, temperature=0.0, seed=3, stop=["x"], logprobs=2)
    )
    assert (given.max_tokens, given.temperature, given.seed, given.stop, given.logprobs) == (
        7,
        0.0,
        3,
        ("x",),
        2,
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, seed=3, stop=("x",), logprobs=2),
        SamplingParams(
            max_tokens=9,
            min_tokens=2,
            top_k=40,
            min_p=0.25,
            repetition_penalty=1.5,
            presence_penalty=-0.5,
            frequency_penalty=0.5,
            stop=("a", "bc"),
            stop_token_ids=(7, 8),
            include_stop_str_in_output=True,
            ignore_eos=True,
            logprobs=0,
        ),
    ],
)
def test_round_trip(params: SamplingParams) -> None:
    assert sampling_params_from_pb(sampling_params_to_pb(params)) == params


def test_bad_params_raise_invalid_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="top_p"):
        sampling_params_from_pb(common_pb2.SamplingParams(top_p=0.0))
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        sampling_params_from_pb(common_pb2.SamplingParams(max_tokens=0))
