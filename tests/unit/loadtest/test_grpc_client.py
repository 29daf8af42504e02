"""The Sluice gRPC client: request building and outcomes against an unreachable target."""

from __future__ import annotations

import asyncio
import time

from loadtest.datasets import RequestSpec
from loadtest.grpc_client import GrpcClient, served_model
from loadtest.schedule import LagMonitor, run_schedule


def test_request_carries_token_ids_length_and_adapter() -> None:
    client = GrpcClient("127.0.0.1:1")
    spec = RequestSpec(
        index=7, input_tokens=3, output_tokens=12, prompt_token_ids=(5, 6, 7), adapter="sql"
    )
    request = client.build_request(spec)
    assert request.WhichOneof("input") == "prompt_token_ids"
    assert list(request.prompt_token_ids.ids) == [5, 6, 7]
    assert request.params.max_tokens == 12
    assert request.params.ignore_eos is True
    assert request.params.temperature == 0.0
    assert request.adapter == "sql"
    assert request.request_id.startswith("bench-") and request.request_id.endswith("-7")
    text = client.build_request(
        RequestSpec(index=0, input_tokens=1, output_tokens=1, prompt_text="hi")
    )
    assert text.WhichOneof("input") == "prompt"
    assert text.prompt == "hi"
    other_run = GrpcClient("127.0.0.1:9", channels=1).build_request(spec)
    assert other_run.request_id != request.request_id  # ids are idempotency keys: per run


def test_unreachable_router_is_recorded_unavailable() -> None:
    async def go() -> list:
        client = GrpcClient("127.0.0.1:9", channels=2, timeout_s=3.0, connect_timeout_s=0.3)
        await client.start()
        try:
            spec = RequestSpec(index=0, input_tokens=1, output_tokens=2, prompt_token_ids=(1,))
            return await run_schedule([spec], [0.0], client, start_epoch_s=time.time())
        finally:
            await client.close()

    (record,) = asyncio.run(go())
    assert record.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert record.output_tokens == 0
    assert record.ttft_s is None


def test_lag_monitor_warns_when_sends_fall_behind_but_not_repeatedly() -> None:
    messages: list[str] = []
    monitor = LagMonitor(threshold_ms=20, emit=messages.append)
    monitor.observe(0, 0.005)
    assert messages == []
    monitor.observe(1, 0.5)
    monitor.observe(2, 0.6)  # within the quiet period: not repeated
    assert len(messages) == 1
    assert "500.0 ms" in messages[0] and "--workers" in messages[0]


def test_served_model_of_an_unreachable_router_is_none() -> None:
    assert served_model("127.0.0.1:9", timeout_s=1.0) is None
