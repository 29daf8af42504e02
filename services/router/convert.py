"""Protobuf ↔ domain conversions for the router (kept out of the servicer and the policies).

Messages only the router builds: Tokenize items, engine submits, detokenize options and client
responses. Sampling parameters go through the shared codec (services/common/protocol/codec.py),
so a bad value is an InvalidArgumentError with the same message the engine would give.
"""

from __future__ import annotations

from protos.sluice.v1 import engine_pb2, router_pb2, tokenizer_pb2
from services.common.errors import InvalidArgumentError
from services.common.protocol.codec import sampling_params_to_pb
from services.router.request import OutputPiece, RouterRequest

PROMPT_TAIL_TOKENS = 8


def tokenize_item(
    request: router_pb2.GenerateRequest, max_prompt_tokens: int
) -> tokenizer_pb2.TokenizeItem:
    """The Tokenize item for a text or chat request (token-id requests need none).

    The tokenizer rejects a prompt longer than `max_prompt_tokens` (0: no limit)."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        if not request.prompt:
            raise InvalidArgumentError("the prompt is empty")
        return tokenizer_pb2.TokenizeItem(text=request.prompt, max_prompt_tokens=max_prompt_tokens)
    if kind == "chat":
        if not request.chat.messages:
            raise InvalidArgumentError("the chat has no messages")
        return tokenizer_pb2.TokenizeItem(chat=request.chat, max_prompt_tokens=max_prompt_tokens)
    raise InvalidArgumentError("set one of prompt, chat or prompt_token_ids")


def submit_pb(request: RouterRequest) -> engine_pb2.SubmitRequest:
    """The engine's submit; an adapter's goes with its registered spec (what to load)."""
    submit = engine_pb2.SubmitRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        params=sampling_params_to_pb(request.params),
        adapter=request.adapter,
        priority=request.priority,
        # Stop strings are checked on each step's text: those tokens must come every step.
        hold_tokens=not request.params.stop,
    )
    if request.adapter_record is not None:
        submit.adapter_spec.CopyFrom(request.adapter_record.to_pb())
    return submit


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
