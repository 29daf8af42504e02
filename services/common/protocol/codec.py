"""Protobuf <-> domain conversions that both ends of a hop share.

The router decodes a client's `sluice.v1.SamplingParams` to validate it before queueing and
encodes it again into the engine's `SubmitRequest`; the engine decodes that. One decoder for
both means one rule for unset optional fields (they take `SamplingParams`' documented defaults)
and one validation message for a bad value (an InvalidArgumentError, sent as INVALID_ARGUMENT).
Messages only one service reads or writes are converted in that service (router/convert.py,
engine/server_convert.py).
"""

from __future__ import annotations

from typing import Any

from protos.sluice.v1 import common_pb2
from services.common.protocol.sampling_params import SamplingParams

# Fields with proto3 presence: unset means "the default", so they are copied only when set.
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs")
_PLAIN_PARAMS = (
    "min_tokens",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "include_stop_str_in_output",
    "ignore_eos",
)


def sampling_params_from_pb(message: common_pb2.SamplingParams) -> SamplingParams:
    """A validated SamplingParams; raises InvalidArgumentError naming the first bad field."""
    values: dict[str, Any] = {name: getattr(message, name) for name in _PLAIN_PARAMS}
    for name in _OPTIONAL_PARAMS:
        if message.HasField(name):
            values[name] = getattr(message, name)
    values["stop"] = tuple(message.stop)
    values["stop_token_ids"] = tuple(message.stop_token_ids)
    return SamplingParams(**values)


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    """The wire form; `sampling_params_from_pb(sampling_params_to_pb(p)) == p`."""
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    return message
