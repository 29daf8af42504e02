"""The open-loop runner and OpenAI client against the SSE fixture server on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadtest.arrivals import arrival_times
from loadtest.datasets import RequestSpec
from loadtest.runner import run
from loadtest.schedule import ClientOptions, LagMonitor, dispatch_lag_s, run_schedule
from tests.unit.loadtest.sse_fixture_server import OpenAIFixtureServer


def specs(count: int, output_tokens: int = 5, prompt: str = "hello world") -> list[RequestSpec]:
    return [
        RequestSpec(index=i, input_tokens=2, output_tokens=output_tokens, prompt_text=prompt)
        for i in range(count)
    ]


def test_slow_server_does_not_delay_the_schedule() -> None:
    # Each stream takes ~0.35 s while requests arrive every 25 ms: a closed loop would fall
    # seconds behind; open loop keeps every send on time and many streams overlap.
    with OpenAIFixtureServer(first_token_delay_s=0.25, token_delay_s=0.025) as server:
        times = arrival_times("constant", 40.0, num_requests=24)
        result = run(specs(24), times, ClientOptions(openai_url=server.url), emit=lambda m: None)
        assert server.max_in_progress >= 8
    records = result.records
    assert [r.status for r in records] == ["OK"] * 24
    # Tolerances leave room for a loaded CI machine; a closed loop would be seconds behind.
    assert max(r.send_lag_s for r in records) < 0.15
    for record, scheduled in zip(records, times, strict=True):
        assert record.scheduled_s == scheduled
        assert record.output_tokens == 5
        assert 0.24 <= record.ttft_s < 1.0
        assert record.tpot_s == pytest.approx(0.025, abs=0.03)
        assert record.e2e_s >= 0.25 + 4 * 0.025 - 0.005


def test_known_delays_give_known_ttft_and_itl() -> None:
    with OpenAIFixtureServer(first_token_delay_s=0.1, token_delay_s=0.04) as server:
        times = [0.0, 0.05]
        result = run(
            specs(2, output_tokens=6), times, ClientOptions(openai_url=server.url), emit=print
        )
        assert server.requests[0]["max_tokens"] == 6
        assert server.requests[0]["ignore_eos"] is True
        assert server.requests[0]["stream"] is True
        assert server.requests[0]["model"] == "fixture-model"
    for record in result.records:
        assert record.status == "OK"
        assert record.ttft_s == pytest.approx(0.1, abs=0.08)
        gaps = record.inter_token_latencies_s()
        assert len(gaps) == 5
        assert sum(gaps) / 5 == pytest.approx(0.04, abs=0.025)


def test_max_concurrency_wait_is_recorded_not_hidden() -> None:
    with OpenAIFixtureServer(first_token_delay_s=0.3, token_delay_s=0.0) as server:
        times = [0.0] * 4
        result = run(
            specs(4, output_tokens=1),
            times,
            ClientOptions(openai_url=server.url),
            max_concurrency=2,
            emit=lambda m: None,
        )
        assert server.max_in_progress == 2
    waits = sorted(r.slot_wait_s for r in result.records)
    assert waits[0] < 0.1 and waits[1] < 0.1
    assert waits[2] > 0.25 and waits[3] > 0.25
    # The send lag includes the slot wait; the dispatch itself was on time.
    assert max(r.send_lag_s for r in result.records) > 0.25
    assert max(r.dispatched_s - r.scheduled_s for r in result.records) < 0.1


def test_http_errors_and_cancellation_are_recorded_by_status() -> None:
    requests = [
        RequestSpec(index=0, input_tokens=1, output_tokens=3, prompt_text="FAIL429"),
        RequestSpec(
            index=1, input_tokens=1, output_tokens=20, prompt_text="x", cancel_after_tokens=3
        ),
        RequestSpec(index=2, input_tokens=1, output_tokens=3, prompt_text="x"),
    ]
    with OpenAIFixtureServer(first_token_delay_s=0.01, token_delay_s=0.01) as server:
        result = run(requests, [0.0, 0.0, 0.0], ClientOptions(openai_url=server.url), emit=print)
    statuses = [r.status for r in result.records]
    assert statuses == ["RESOURCE_EXHAUSTED", "CANCELLED", "OK"]
    assert result.records[1].cancelled
    assert 3 <= result.records[1].output_tokens < 20


def test_unreachable_target_is_unavailable_not_a_crash() -> None:
    async def go() -> list:
        options = ClientOptions(openai_url="http://127.0.0.1:9", model="m", timeout_s=5)
        client = options.make_client()
        await client.start()
        try:
            return await run_schedule(specs(2), [0.0, 0.01], client, start_epoch_s=time.time())
        finally:
            await client.close()

    records = asyncio.run(go())
    assert [r.status for r in records] == ["UNAVAILABLE", "UNAVAILABLE"]


@pytest.mark.slow
def test_two_worker_processes_merge_their_records() -> None:
    with OpenAIFixtureServer(first_token_delay_s=0.05, token_delay_s=0.01) as server:
        times = arrival_times("constant", 50.0, num_requests=20)
        result = run(
            specs(20, output_tokens=3),
            times,
            ClientOptions(openai_url=server.url),
            workers=2,
            emit=print,
        )
    assert [r.index for r in result.records] == list(range(20))
    assert {r.worker for r in result.records} == {0, 1}
    assert all(r.status == "OK" for r in result.records)
    assert max(r.send_lag_s for r in result.records) < 0.1


class _BrokenClient:
    """A client whose send raises for odd indexes (a harness bug must not end the run)."""

    async def send(self, spec: RequestSpec, record, clock) -> None:  # noqa: ANN001
        record.sent_s = clock()
        if spec.index % 2:
            raise RuntimeError("boom")
        record.add_chunk(clock(), 1)
        record.finished_s = clock()
        record.status = "OK"


def test_a_client_exception_is_recorded_and_the_run_goes_on() -> None:
    records = asyncio.run(
        run_schedule(specs(4), [0.0, 0.0, 0.01, 0.01], _BrokenClient(), start_epoch_s=time.time())
    )
    assert [r.status for r in records] == ["OK", "UNKNOWN", "OK", "UNKNOWN"]
    assert "boom" in records[1].error
    assert records[1].finished_s is not None


class _BlockingClient:
    """A client that blocks the event loop for 80 ms per send: dispatch falls behind."""

    async def send(self, spec: RequestSpec, record, clock) -> None:  # noqa: ANN001
        record.sent_s = clock()
        time.sleep(0.08)
        record.finished_s = clock()
        record.status = "OK"


def test_falling_behind_is_warned_at_dispatch_and_shows_in_the_lag() -> None:
    warnings: list[str] = []
    monitor = LagMonitor(threshold_ms=30, emit=warnings.append)
    records = asyncio.run(
        run_schedule(
            specs(4),
            [0.0, 0.01, 0.02, 0.03],
            _BlockingClient(),
            start_epoch_s=time.time(),
            on_dispatch=lambda r: monitor.observe(r.index, dispatch_lag_s(r)),
        )
    )
    assert max(r.send_lag_s for r in records) > 0.1
    assert len(warnings) == 1 and "falling behind" in warnings[0]


class _SlowStartClient(_BrokenClient):
    """Takes 0.3 s to connect; its sends succeed."""

    async def start(self) -> None:
        await asyncio.sleep(0.3)

    async def close(self) -> None:
        return None


class _SlowStartOptions(ClientOptions):
    def make_client(self) -> object:
        return _SlowStartClient()


def test_client_start_up_is_not_counted_as_send_lag() -> None:
    result = run([specs(1)[0]], [0.0], _SlowStartOptions(openai_url="unused"), emit=print)
    assert result.records[0].status == "OK"
    assert result.records[0].send_lag_s < 0.1
