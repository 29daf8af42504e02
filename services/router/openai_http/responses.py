"""GenerateResponse messages -> OpenAI JSON: stream chunks, whole answers, usage, logprobs.

A streamed response becomes one chunk (`text_completion` or `chat.completion.chunk`); a chat
stream opens with the assistant's role. Token log-probabilities name tokens as `token_id:<id>`
(the form vLLM uses with `--return-tokens-as-token-ids`): the router holds ids, not token
strings. Finish reasons: EOS or a stop string or id -> "stop", max_tokens or the context ->
"length"; an aborted request -> "abort".
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from protos.sluice.v1 import common_pb2, router_pb2
from services.router.openai_http.requests import OpenAIRequest

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def dumps(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def usage(response: router_pb2.GenerateResponse) -> dict:
    counts = response.usage
    return {
        "prompt_tokens": counts.prompt_tokens,
        "completion_tokens": counts.completion_tokens,
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": counts.cached_prompt_tokens},
    }


class ResponseBuilder:
    """Builds one request's OpenAI bodies (see the module docstring)."""

    def __init__(self, request: OpenAIRequest, request_id: str) -> None:
        self.request = request
        self.chat = request.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, choices: list, obj: str | None = None) -> dict:
        body = {
            "id": self.id,
            "object": obj or self.object,
            "created": self.created,
            "model": self.request.model,
            "choices": choices,
        }
        if self.request.include_usage:
            body["usage"] = None
        return body

    def role_chunk(self) -> dict:
        """A chat stream's first chunk: the assistant's turn begins."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return self._envelope([{**choice, "finish_reason": None}])

    def chunk(self, response: router_pb2.GenerateResponse) -> dict:
        """One streamed response as a chunk."""
        choice: dict = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": response.text} if response.text else {}
        else:
            choice["text"] = response.text
        choice["logprobs"] = self._logprobs(response.logprobs) if self.request.logprobs else None
        choice["finish_reason"] = FINISH_REASONS.get(response.finish_reason)
        return self._envelope([choice])

    def usage_chunk(self, last: router_pb2.GenerateResponse) -> dict:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        body = self._envelope([])
        body["usage"] = usage(last)
        return body

    def whole(self, responses: Iterable[router_pb2.GenerateResponse]) -> dict:
        """A non-streamed answer from all of the request's responses."""
        responses = list(responses)
        text = "".join(r.text for r in responses)
        logprobs = None
        if self.request.logprobs:
            logprobs = self._logprobs([p for r in responses for p in r.logprobs])
        choice: dict = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = FINISH_REASONS.get(responses[-1].finish_reason)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.request.model,
            "choices": [choice],
            "usage": usage(responses[-1]),
        }
        return body

    def _logprobs(self, logprobs: Iterable[common_pb2.TokenLogprob]) -> dict:
        if self.chat:
            return {
                "content": [
                    {
                        "token": _token(p.token_id),
                        "logprob": p.logprob,
                        "bytes": None,
                        "top_logprobs": [
                            {"token": _token(t.token_id), "logprob": t.logprob, "bytes": None}
                            for t in p.top
                        ],
                    }
                    for p in logprobs
                ],
                "refusal": None,
            }
        logprobs = list(logprobs)
        return {
            "tokens": [_token(p.token_id) for p in logprobs],
            "token_logprobs": [p.logprob for p in logprobs],
            "top_logprobs": [{_token(t.token_id): t.logprob for t in p.top} for p in logprobs],
        }


def _token(token_id: int) -> str:
    return f"token_id:{token_id}"
