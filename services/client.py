"""A small Python client for the Sluice router: sync `SluiceClient` and asyncio `AsyncSluiceClient`.

    with SluiceClient("127.0.0.1:50051") as client:
        for response in client.generate("Hello", max_tokens=32, temperature=0):
            print(response.text, end="", flush=True)
        print(client.complete(chat=[{"role": "user", "content": "Hi"}]).text)

`generate` takes exactly one of a prompt string, chat messages (dicts with role/content, or
(role, content) pairs) or token ids, plus any SamplingParams field as a keyword; values are sent
as given and the server validates them. Responses are `router_pb2.GenerateResponse` messages.
Errors surface as `grpc.RpcError` with the server's status code and message. Leaving the
iterator early cancels the call, so the server aborts the request and frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.sluice.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.grpc_channel import ROUTER_CLIENT_OPTIONS

ChatInput = Iterable[Mapping[str, str] | tuple[str, str]]
_REPEATED_PARAMS = ("stop", "stop_token_ids")


@dataclass
class Completion:
    """A whole answer gathered from a stream."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # e.g. "stop", "length", "stop_string", "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    request_id: str = ""
    matched_stop: str = ""

    def add(self, response: router_pb2.GenerateResponse) -> None:
        self.text += response.text
        self.token_ids.extend(response.token_ids)
        if response.request_id:
            self.request_id = response.request_id
        if response.finish_reason:
            self.finish_reason = finish_reason_name(response.finish_reason)
            self.prompt_tokens = response.usage.prompt_tokens
            self.completion_tokens = response.usage.completion_tokens
            self.matched_stop = response.matched_stop


def finish_reason_name(value: int) -> str:
    """FINISH_REASON_STOP_STRING -> "stop_string"."""
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def build_request(
    prompt: str | None = None,
    *,
    chat: ChatInput | None = None,
    token_ids: Sequence[int] | None = None,
    adapter: str | None = None,
    request_id: str | None = None,
    priority: int = 0,
    **sampling: Any,
) -> router_pb2.GenerateRequest:
    """A GenerateRequest from Python values; unknown sampling keywords raise TypeError."""
    given = sum(value is not None for value in (prompt, chat, token_ids))
    if given != 1:
        raise TypeError("give exactly one of prompt, chat or token_ids")
    request = router_pb2.GenerateRequest(
        adapter=adapter or "", request_id=request_id or "", priority=priority
    )
    if prompt is not None:
        request.prompt = prompt
    elif chat is not None:
        request.chat.messages.extend(_chat_message(turn) for turn in chat)
        request.chat.SetInParent()
    else:
        request.prompt_token_ids.ids.extend(token_ids or ())
        request.prompt_token_ids.SetInParent()
    params = request.params
    for name, value in sampling.items():
        if value is None:
            continue
        if name not in common_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
            raise TypeError(f"unknown sampling parameter {name!r}")
        if name in _REPEATED_PARAMS:
            values = [value] if isinstance(value, (str, int)) else list(value)
            getattr(params, name).extend(values)
        else:
            setattr(params, name, value)
    request.params.SetInParent()
    return request


def _chat_message(turn: Mapping[str, str] | tuple[str, str]) -> common_pb2.ChatMessage:
    if isinstance(turn, Mapping):
        return common_pb2.ChatMessage(role=turn["role"], content=turn["content"])
    role, content = turn
    return common_pb2.ChatMessage(role=role, content=content)


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class SluiceClient:
    """Blocking client; one channel, closed by `close()` or the `with` block."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._channel = grpc.insecure_channel(target, options=ROUTER_CLIENT_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._api_key = api_key
        self._timeout_s = timeout_s

    def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs: Any
    ) -> Iterator[router_pb2.GenerateResponse]:
        """Stream responses; closing the iterator early cancels the call."""
        request = build_request(prompt, **kwargs)
        call = self._stub.Generate(
            request, timeout=timeout_s or self._timeout_s, metadata=_metadata(self._api_key)
        )
        try:
            yield from call
        finally:
            call.cancel()  # no-op when the stream already ended

    def stream_text(self, prompt: str | None = None, **kwargs: Any) -> Iterator[str]:
        """Only the text deltas (empty ones skipped)."""
        for response in self.generate(prompt, **kwargs):
            if response.text:
                yield response.text

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """The whole answer of one request."""
        completion = Completion()
        for response in self.generate(prompt, **kwargs):
            completion.add(response)
        return completion

    def list_models(self, *, timeout_s: float | None = None) -> list[router_pb2.ModelInfo]:
        reply = self._stub.ListModels(
            router_pb2.ListModelsRequest(),
            timeout=timeout_s or self._timeout_s,
            metadata=_metadata(self._api_key),
        )
        return list(reply.models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SluiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncSluiceClient:
    """asyncio client; `await close()` or `async with`."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self._channel = grpc.aio.insecure_channel(target, options=ROUTER_CLIENT_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._api_key = api_key
        self._timeout_s = timeout_s

    async def generate(
        self, prompt: str | None = None, *, timeout_s: float | None = None, **kwargs: Any
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Stream responses; leaving the loop early cancels the call."""
        request = build_request(prompt, **kwargs)
        call = self._stub.Generate(
            request, timeout=timeout_s or self._timeout_s, metadata=_metadata(self._api_key)
        )
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def stream_text(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[str]:
        """Only the text deltas (empty ones skipped)."""
        async for response in self.generate(prompt, **kwargs):
            if response.text:
                yield response.text

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        completion = Completion()
        async for response in self.generate(prompt, **kwargs):
            completion.add(response)
        return completion

    async def list_models(self, *, timeout_s: float | None = None) -> list[router_pb2.ModelInfo]:
        reply = await self._stub.ListModels(
            router_pb2.ListModelsRequest(),
            timeout=timeout_s or self._timeout_s,
            metadata=_metadata(self._api_key),
        )
        return list(reply.models)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncSluiceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
