"""Sluice target: Router.Generate server-streaming over gRPC (`--target HOST:PORT`).

Synthetic prompts go as ``prompt_token_ids`` (text prompts, e.g. ShareGPT without a tokenizer,
as ``prompt``), with ``ignore_eos`` and ``max_tokens`` = the wanted output length. Calls are
spread over a small pool of channels so HTTP/2's per-connection stream limit does not queue
requests inside the client where the harness could not see it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Callable

import grpc

from loadtest.datasets import RequestSpec
from loadtest.records import RequestRecord
from protos.sluice.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.grpc_channel import ROUTER_CLIENT_OPTIONS

_CONNECT_TIMEOUT_S = 5.0
_FINISH_NAMES = {
    value.number: value.name.removeprefix("FINISH_REASON_")
    for value in common_pb2.FinishReason.DESCRIPTOR.values
}


class GrpcClient:
    """Sends requests to a Sluice router and records their streamed timeline."""

    def __init__(
        self,
        target: str,
        *,
        channels: int = 4,
        timeout_s: float | None = None,
        temperature: float = 0.0,
        api_key: str | None = None,
        connect_timeout_s: float = _CONNECT_TIMEOUT_S,
    ) -> None:
        self._target = target
        self._connect_timeout_s = connect_timeout_s
        self._channel_count = max(1, channels)
        self._timeout_s = timeout_s
        self._temperature = temperature
        # Request ids are idempotency keys on a Redis-backed router: unique per run, so a
        # second run never replays (or conflicts with) the first one's stored results.
        self._run_id = uuid.uuid4().hex[:12]
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: itertools.cycle | None = None

    async def start(self) -> None:
        """Open the channels (inside the event loop that will use them)."""
        # Sluice's client options: a short reconnect backoff and retries of calls refused
        # before the router answered (services/common/grpc_channel.py), as SluiceClient has.
        options = list(ROUTER_CLIENT_OPTIONS)
        for _ in range(self._channel_count):
            # A local subchannel pool gives each channel its own connection.
            channel_options = [*options, ("grpc.use_local_subchannel_pool", 1)]
            self._channels.append(grpc.aio.insecure_channel(self._target, options=channel_options))
        self._stubs = itertools.cycle([router_pb2_grpc.RouterStub(c) for c in self._channels])
        # Connect before the schedule starts, so the first requests don't pay for it; a target
        # that is down is not an error here: its requests will record UNAVAILABLE.
        await asyncio.gather(*(self._wait_ready(c) for c in self._channels))

    async def _wait_ready(self, channel: grpc.aio.Channel) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(channel.channel_ready(), timeout=self._connect_timeout_s)

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels:
            await channel.close()
        self._channels.clear()

    def build_request(self, spec: RequestSpec) -> router_pb2.GenerateRequest:
        """The GenerateRequest for one spec."""
        params = common_pb2.SamplingParams(
            max_tokens=spec.output_tokens, ignore_eos=True, temperature=self._temperature
        )
        request = router_pb2.GenerateRequest(
            params=params, adapter=spec.adapter, request_id=f"bench-{self._run_id}-{spec.index}"
        )
        if spec.prompt_token_ids is not None:
            request.prompt_token_ids.ids.extend(spec.prompt_token_ids)
        else:
            request.prompt = spec.prompt_text or ""
        return request

    async def send(
        self, spec: RequestSpec, record: RequestRecord, clock: Callable[[], float]
    ) -> None:
        """Stream one request; fills `record` (never raises for a server-side failure)."""
        if self._stubs is None:
            raise RuntimeError("GrpcClient.start() was not awaited")
        stub = next(self._stubs)
        request = self.build_request(spec)
        record.sent_s = clock()
        call = stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata)
        usage_tokens = None
        try:
            async for response in call:
                record.add_chunk(clock(), len(response.token_ids))
                if response.finish_reason:
                    record.finish_reason = _FINISH_NAMES.get(response.finish_reason, "")
                if response.HasField("usage") and response.usage.completion_tokens:
                    usage_tokens = response.usage.completion_tokens
                cancel_at = spec.cancel_after_tokens
                reached = cancel_at is not None and record.output_tokens >= cancel_at
                if reached and not response.finish_reason:
                    call.cancel()
                    record.cancelled = True
                    record.status = "CANCELLED"
                    break
            else:
                record.status = "OK"
        except grpc.aio.AioRpcError as error:
            record.status = error.code().name
            record.error = error.details() or ""
            record.retry_after_s = retry_after_s(error.trailing_metadata())
        except Exception as error:  # noqa: BLE001 - any client failure is a recorded outcome
            record.status = "UNKNOWN"
            record.error = f"{type(error).__name__}: {error}"
        record.finished_s = clock()
        if record.status == "OK" and record.finish_reason == "ERROR":
            record.status = "INTERNAL"
            record.error = record.error or "finish_reason ERROR"
        if usage_tokens is not None and record.status == "OK":
            record.output_tokens = max(record.output_tokens, usage_tokens)


def retry_after_s(metadata) -> float | None:
    """The server's retry-after hint in trailing metadata, in seconds (None: none given)."""
    for key, value in metadata or ():
        if key == "retry-after":
            try:
                return float(value)
            except (TypeError, ValueError):
                return None
    return None


def served_model(
    target: str, *, api_key: str | None = None, timeout_s: float = 5.0
) -> router_pb2.ModelInfo | None:
    """The router's served model (ListModels), or None when it can't say (down, no engine)."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    try:
        with grpc.insecure_channel(target) as channel:
            response = router_pb2_grpc.RouterStub(channel).ListModels(
                router_pb2.ListModelsRequest(), timeout=timeout_s, metadata=metadata
            )
    except grpc.RpcError:
        return None
    return response.models[0] if response.models else None
