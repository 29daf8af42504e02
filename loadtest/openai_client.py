"""OpenAI-compatible target: streaming `/v1/completions` over HTTP (`--openai-url URL`).

The same harness measures a peer (vLLM, TGI, SGLang): the prompt goes as text with
``max_tokens`` = the wanted output length, ``ignore_eos`` (honoured by vLLM and SGLang) and
``stream_options.include_usage``. Each SSE event with text counts as one token unless the final
usage says more arrived (then the extra tokens are added to the last chunk). HTTP errors are
recorded under the gRPC status name of the same meaning (429 → RESOURCE_EXHAUSTED, ...). The
connection pool is unlimited so no request waits inside the client unseen.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp

from loadtest.datasets import RequestSpec, words_text
from loadtest.records import RequestRecord

HTTP_TO_GRPC = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ALREADY_EXISTS",
    413: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def completions_url(url: str) -> str:
    """Accept a base URL, a `/v1` URL or the full `/v1/completions` URL."""
    url = url.rstrip("/")
    if url.endswith("/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/completions"
    return url + "/v1/completions"


class OpenAIClient:
    """Sends requests to an OpenAI-compatible server and records their streamed timeline."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        timeout_s: float | None = None,
        temperature: float = 0.0,
        api_key: str | None = None,
    ) -> None:
        self._url = completions_url(url)
        self._model = model
        self._timeout_s = timeout_s
        self._temperature = temperature
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session; find the model name from /v1/models when none was given."""
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=self._headers
        )
        if self._model is None:
            self._model = await self._first_model()

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _first_model(self) -> str:
        models_url = self._url.rsplit("/completions", 1)[0] + "/models"
        try:
            async with self._session.get(models_url) as response:  # type: ignore[union-attr]
                if response.status == 200:
                    body = await response.json()
                    if body.get("data"):
                        return str(body["data"][0]["id"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            pass
        return "default"

    def build_body(self, spec: RequestSpec) -> dict:
        """The JSON body of one streaming completion request."""
        prompt = spec.prompt_text
        if prompt is None:
            prompt = words_text(spec.prompt_token_ids or ())
        body = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": spec.output_tokens,
            "temperature": self._temperature,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        if spec.adapter:
            body["model"] = spec.adapter
        return body

    async def send(
        self, spec: RequestSpec, record: RequestRecord, clock: Callable[[], float]
    ) -> None:
        """Stream one request; fills `record` (never raises for a server-side failure)."""
        if self._session is None:
            raise RuntimeError("OpenAIClient.start() was not awaited")
        body = self.build_body(spec)
        record.sent_s = clock()
        usage_tokens = None
        try:
            async with self._session.post(self._url, json=body) as response:
                if response.status != 200:
                    record.status = HTTP_TO_GRPC.get(response.status, "UNKNOWN")
                    record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    record.retry_after_s = _seconds(response.headers.get("Retry-After"))
                else:
                    usage_tokens = await self._read_stream(response, spec, record, clock)
        except asyncio.TimeoutError:
            record.status, record.error = "DEADLINE_EXCEEDED", "client timeout"
        except aiohttp.ClientError as error:
            record.status, record.error = "UNAVAILABLE", f"{type(error).__name__}: {error}"
        record.finished_s = clock()
        if usage_tokens is not None and record.status == "OK" and record.chunk_tokens:
            extra = usage_tokens - record.output_tokens
            if extra > 0:
                record.chunk_tokens[-1] += extra
                record.output_tokens += extra

    async def _read_stream(
        self,
        response: aiohttp.ClientResponse,
        spec: RequestSpec,
        record: RequestRecord,
        clock: Callable[[], float],
    ) -> int | None:
        usage_tokens = None
        async for raw_line in response.content:
            line = raw_line.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                record.status = "OK"
                return usage_tokens
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                continue
            if event.get("error"):
                record.status = "INTERNAL"
                record.error = str(event["error"])[:200]
                return None
            now = clock()
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    record.add_chunk(now, 1)
                if choice.get("finish_reason"):
                    record.finish_reason = str(choice["finish_reason"]).upper()
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            cancel_at = spec.cancel_after_tokens
            reached = cancel_at is not None and record.output_tokens >= cancel_at
            if reached and not record.finish_reason:
                record.cancelled = True
                record.status = "CANCELLED"
                response.close()
                return None
        # Stream ended without [DONE]: fine if a finish_reason arrived.
        record.status = "OK" if record.finish_reason else "UNAVAILABLE"
        if record.status != "OK":
            record.error = "stream ended before a finish_reason"
        return usage_tokens


def _seconds(value: str | None) -> float | None:
    """A Retry-After header given in seconds (None: absent or an HTTP date)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
