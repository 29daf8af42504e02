"""Protobuf ↔ domain conversions for the router (kept out of the servicer and the policies).

`sampling_params_from_pb` validates through `SamplingParams` (plain Python, no torch), so a bad
value is an InvalidArgumentError with the same message the engine would give.
"""

from __future__ import annotations

from protos.sluice.v1 import common_pb2, engine_pb2, router_pb2, tokenizer_pb2
from services.common.errors import InvalidArgumentError
from services.engine.sampling_params import SamplingParams
from services.router.request import OutputPiece, RouterRequest

PROMPT_TAIL_TOKENS = 8


def sampling_params_from_pb(params: common_pb2.SamplingParams) -> SamplingParams:
    """A validated SamplingParams; unset optional fields take the documented defaults."""
    values: dict = {
        "min_tokens": params.min_tokens,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": tuple(params.stop),
        "stop_token_ids": tuple(params.stop_token_ids),
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos,
    }
    for name in ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty", "logprobs"):
        if params.HasField(name):
            values[name] = getattr(params, name)
    return SamplingParams(**values)


def sampling_params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
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


def tokenize_item(
    request: router_pb2.GenerateRequest, max_tokens: int
) -> tokenizer_pb2.TokenizeItem:
    """The Tokenize item for a text or chat request (token-id requests need none)."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidArgumentError("the prompt is empty")
        return tokenizer_pb2.TokenizeItem(text=request.prompt, max_tokens=max_tokens)
    if kind == "chat":
        if not request.chat.messages:
            raise InvalidArgumentError("the chat has no messages")
        return tokenizer_pb2.TokenizeItem(chat=request.chat, max_tokens=max_tokens)
    raise InvalidArgumentError("set one of prompt, chat or prompt_token_ids")


def submit_pb(request: RouterRequest) -> engine_pb2.SubmitRequest:
    return engine_pb2.SubmitRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        params=sampling_params_to_pb(request.params),
        adapter=request.adapter,
        priority=request.priority,
    )


def detokenize_options(request: RouterRequest) -> tokenizer_pb2.DetokenizeOptions:
    return tokenizer_pb2.DetokenizeOptions(
        stop=request.params.stop,
        include_stop_str_in_output=request.params.include_stop_str_in_output,
        prompt_tail_ids=request.prompt_token_ids[-PROMPT_TAIL_TOKENS:],
    )


def response_pb(piece: OutputPiece, client_request_id: str) -> router_pb2.GenerateResponse:
    response = router_pb2.GenerateResponse(
        text=piece.text, token_ids=piece.token_ids, request_id=client_request_id
    )
    if piece.logprobs:
        response.logprobs.extend(piece.logprobs)
    if piece.finish_reason:
        response.finish_reason = piece.finish_reason
        response.usage.prompt_tokens = piece.prompt_tokens
        response.usage.completion_tokens = piece.completion_tokens
        response.usage.cached_prompt_tokens = piece.cached_prompt_tokens
        if piece.matched_stop:
            response.matched_stop = piece.matched_stop
    return response
