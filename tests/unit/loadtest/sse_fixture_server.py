"""A test fixture server speaking the OpenAI streaming-completions format over loopback.

It streams canned tokens with known delays (first token after `first_token_delay_s`, then one
token per event every `token_delay_s`), so tests can
check the harness's arithmetic and open-loop timing against known answers. It also serves
`/v1/models` and a `/metrics` page whose `sluice_router_queue_depth_requests` gauge is the
number of streams in progress. A prompt containing "FAIL429" is answered with HTTP 429.
It is a fixture for the OpenAI client path, not a model server.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web


class OpenAIFixtureServer:
    """Runs the fixture on 127.0.0.1 in a background thread with its own event loop."""

    def __init__(
        self,
        *,
        first_token_delay_s: float = 0.05,
        token_delay_s: float = 0.01,
    ) -> None:
        self.first_token_delay_s = first_token_delay_s
        self.token_delay_s = token_delay_s
        self.in_progress = 0
        self.max_in_progress = 0
        self.requests: list[dict] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OpenAIFixtureServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fixture-model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP sluice_router_queue_depth_requests Streams in progress.\n"
            "# TYPE sluice_router_queue_depth_requests gauge\n"
            f"sluice_router_queue_depth_requests {self.in_progress}\n"
            "# HELP sluice_engine_kv_blocks_used Fixture KV use.\n"
            "# TYPE sluice_engine_kv_blocks_used gauge\n"
            f"sluice_engine_kv_blocks_used {self.in_progress * 4}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if "FAIL429" in str(body.get("prompt", "")):
            return web.json_response({"error": "rate limited"}, status=429)
        total = int(body["max_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.in_progress += 1
        self.max_in_progress = max(self.max_in_progress, self.in_progress)
        try:
            await asyncio.sleep(self.first_token_delay_s)
            for sent in range(1, total + 1):
                if sent > 1:
                    await asyncio.sleep(self.token_delay_s)
                finish = "length" if sent == total else None
                event = {"choices": [{"index": 0, "text": " tok", "finish_reason": finish}]}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
            usage = {"prompt_tokens": 1, "completion_tokens": total, "total_tokens": total + 1}
            await response.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            )
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.in_progress -= 1
        return response
